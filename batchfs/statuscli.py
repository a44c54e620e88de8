"""``batchfs status``: why a ``.batch/`` file failed, in words, without knowing where to look.

A control file's errors reach its reader as a bare errno (EINVAL from ``write``/``close``/
``read``, EIO from ``read``); the reason stays in the read-only sibling ``NAME.status`` (JSON).
This command reads those files and prints them for people: ``batchfs status
MOUNT/.batch/NAME`` (or ``NAME.status``), or ``batchfs status MOUNT`` for every batch of
the caller in that mount. It only reads files through the mount (no request to the daemon
or the server), so it sees exactly what the caller may see: other users' batches are
private (docs/batch.md, "Privacy and scope").

Exit status: 0 when no batch shown has failed, 1 when one has (or could not be read),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROG = "batchfs status"
CONTROL_DIR = ".batch"
STATUS_SUFFIX = ".status"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="say why a .batch/ file failed (reads its NAME.status)",
        description="Print the state of .batch/ control files and, for a failed one, the reason "
        "(the errno that write, close or read returned says only EINVAL or EIO). PATH is "
        "MOUNT/.batch/NAME, its NAME.status, the .batch/ directory, or a mount root (every "
        "batch of yours in it). Exit status: 0 none failed, 1 one failed or could not be read, "
        "2 bad arguments. See batchfs-manifest(5).",
        epilog="Example: batchfs status /mnt/imagenet/.batch/step1")
    p.add_argument("paths", metavar="PATH", nargs="+", help="a batch file, its .status, .batch/ or a mount root")
    p.add_argument("--json", action="store_true", help="print the status documents as JSON (default: text)")
    p.set_defaults(func=cmd_status)


def _status_files(path: str) -> list[str]:
    """The NAME.status files PATH stands for (raises OSError with a readable message)."""
    if os.path.isdir(path):
        d = path if os.path.basename(os.path.normpath(path)) == CONTROL_DIR else os.path.join(path, CONTROL_DIR)
        if not os.path.isdir(d):
            raise OSError(f"{path}: not a batchfs mount (no {CONTROL_DIR}/ in it)")
        return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(STATUS_SUFFIX)]
    if os.path.basename(os.path.dirname(os.path.abspath(path))) != CONTROL_DIR:
        raise OSError(f"{path}: not a {CONTROL_DIR}/ file of a batchfs mount")
    return [path if path.endswith(STATUS_SUFFIX) else path + STATUS_SUFFIX]


def _read(status_path: str) -> dict:
    try:
        with open(status_path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise OSError(f"{status_path.removesuffix(STATUS_SUFFIX)}: no such batch") from None
    except PermissionError:
        raise OSError(f"{status_path.removesuffix(STATUS_SUFFIX)}: another user's batch "
                      "(control files are private to their creator)") from None
    except ValueError as e:
        raise OSError(f"{status_path}: not a status document ({e})") from None


def _text(path: str, st: dict) -> str:
    lines = [f"{path}: {st.get('state')} ({st.get('kind', 'batch')})"]
    if st.get("reason"):
        lines.append(f"  reason: {st['reason']}")
    if "entries" in st:
        lines.append(f"  entries: {st['entries']}, members done: {st.get('members_done', 0)}, "
                     f"missing (__404__/ placeholders): {st.get('missing', 0)}, "
                     f"bytes produced: {st.get('bytes_produced', 0)}")
    prog = st.get("progress")
    if isinstance(prog, dict):
        e = prog.get("entries", {})
        g = prog.get("groups")
        if isinstance(g, dict):  # a plan of .rowgroups/ files
            lines.append(f"  plan: {prog.get('state')}, row groups planned {g.get('total')}, made {g.get('made')}, "
                         f"served {g.get('served')}, waited {g.get('waited')}, read through "
                         f"{g.get('read_through')}, errors {g.get('errors')}")
        else:
            lines.append(f"  plan: {prog.get('state')}, entries planned {e.get('planned')}, fetched "
                         f"{e.get('fetched')}, served {e.get('served')}, read through {e.get('read_through')}, "
                         f"errors {e.get('errors')}")
        for err in prog.get("errors") or []:
            lines.append(f"  error: {err}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    failed, docs = False, []
    for path in args.paths:
        try:
            files = _status_files(path)
            if not files:
                print(f"{path}: no batches of yours", file=sys.stderr)
            for sf in files:
                st = _read(sf)
                batch = sf.removesuffix(STATUS_SUFFIX)
                failed |= st.get("state") == "failed"
                if args.json:
                    docs.append({"path": batch, **st})
                else:
                    print(_text(batch, st))
        except OSError as e:
            print(f"{PROG}: {e.args[0] if len(e.args) == 1 else e}", file=sys.stderr)
            failed = True
    if args.json:
        print(json.dumps(docs, indent=1))
    return 1 if failed else 0
