"""``batchfs-server cluster-status URL``: an operator's view of a cluster, from any gateway.

It reads the gateway's ``GET /v1/cluster/status`` (the map, each node's health as the gateway
sees it, each live target's rebalance progress) and prints one line per node. Exit status: 0
when every node is up and no rebalance is running, 3 while a rebalance runs (or is due again)
or a target is leaving (``cluster remove``, or maintenance until parked), 4 when a target is
down (not one parked in maintenance), 1 when the gateway cannot be asked (the reason on stderr). A token-protected gateway takes
the token from ``--token-file`` or ``AIS_AUTHN_TOKEN`` (as the aistore SDK does).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx

from server.tokens import read_private_file


def _rebalance(r: dict | None) -> str:
    if not r:
        return ""
    if "error" in r:
        return f"rebalance: ? ({r['error']})"
    state = "running" if r.get("running") else f"to run again in {r['retry_in']:g} s" if r.get("retry_in") else "done"
    cap = r.get("capacity") or {}
    text = (f"{_gib(cap.get('free_bytes'))} free of {_gib(cap.get('total_bytes'))}; " if cap else "") + (
        f"rebalance to v{r.get('map_version')} {state}; since the target started: checked {r.get('checked', 0)}, "
        f"copied {r.get('copied', 0)}, deleted {r.get('deleted', 0)}, stale {r.get('stale', 0)}, "
        f"failed {r.get('failed', 0)}")
    text += f", resumed after {r['resumed_from']}" if r.get("resumed_from") else ""
    fresh = r.get("fresh") or {}
    if fresh.get("checking") or fresh.get("pulled") or fresh.get("deleted"):  # (server.api.freshness)
        text += (f"; reads {'check' if fresh.get('checking') else 'checked'} other copies: "
                 f"{fresh.get('pulled', 0)} newer brought here, {fresh.get('deleted', 0)} deleted meanwhile")
    text += f", {r['owed_deletes']} chunk deletes owed to targets that were down" if r.get("owed_deletes") else ""
    return text + (f" (last error: {r['last_error']})" if r.get("failed") and r.get("last_error") else "")


def _gib(n) -> str:
    return "?" if not isinstance(n, int) else f"{n / 2**30:,.1f} GiB"


def render(doc: dict) -> tuple[str, int]:
    """The table for a status document, and the exit status it calls for."""
    placed = sum(1 for n in doc["nodes"] if n["kind"] != "proxy" and not n.get("leaving"))
    # a bucket wanting more copies than there are targets keeps one a target (say so)
    per_bucket = ", ".join(f"{b}: {c}" + (f" wanted, {placed} kept" if c > placed else "")
                           for b, c in sorted((doc.get("bucket_copies") or {}).items()))
    lines = [f"cluster {doc['uuid']}, map v{doc['version']}, {doc['copies']} cop{'y' if doc['copies'] == 1 else 'ies'} "
             "of each object"
             + (f" ({per_bucket})" if per_bucket else "")]
    rows = []
    for n in sorted(doc["nodes"], key=lambda n: (n["kind"] != "proxy", n["id"])):
        kind = "gateway" + (" (primary)" if n.get("primary") else "") if n["kind"] == "proxy" else "target"
        state = "?" if n["alive"] is None else "up" if n["alive"] else "DOWN"  # ?: a secondary does not probe gateways
        state += _leaving_state(n)
        rows.append((n["id"], kind, state, n["url"], _rebalance(n.get("rebalance"))))
    widths = [max(len(r[i]) for r in rows + [("NODE", "ROLE", "STATE", "URL", "")]) for i in range(4)]
    for r in [("NODE", "ROLE", "STATE", "URL", "")] + rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + ("  " + r[4] if r[4] else ""))
    targets = [n for n in doc["nodes"] if n["kind"] != "proxy"]
    # a parked target is in maintenance and holds nothing: down or still, it is as the operator wants
    code = 4 if any(not n["alive"] and not n.get("parked") for n in targets) else \
        3 if any((n.get("rebalance") or {}).get("running") or (n.get("rebalance") or {}).get("retry_in")
                 or (n.get("leaving") and not n.get("parked")) for n in targets) else 0
    return "\n".join(lines), code


def _leaving_state(n: dict) -> str:
    if n.get("parked"):
        return ", maintenance (parked: holds nothing, may be shut down)"
    if n.get("maintenance"):
        return ", maintenance (its objects are moving to the others)"
    return ", leaving" if n.get("leaving") else ""  # cluster remove: its objects are moving to the others


def add_token_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", type=Path, metavar="FILE", help="a file holding the bearer token of a "
                   "token-protected cluster (without it: the token itself from $AIS_AUTHN_TOKEN, if set, as the "
                   "aistore SDK takes it)")


def auth_headers(token_file: Path | None) -> dict:
    """The bearer header for ``--token-file`` (its first token line) or ``$AIS_AUTHN_TOKEN``.
    ValueError for a token file other users may read or write (refused as the server refuses
    its own), a missing one, or one without a token."""
    if token_file is None:
        token = os.environ.get("AIS_AUTHN_TOKEN")
    else:
        text = read_private_file(token_file, "token file")
        token = next((t for t in (line.strip() for line in text.splitlines()) if t and not t.startswith("#")), "")
        if not token:
            raise ValueError(f"token file {token_file}: no token in it")
    return {"Authorization": f"Bearer {token}"} if token else {}


def headers_or_none(token_file: Path | None, command: str) -> dict | None:
    """``auth_headers``, or None after saying on stderr why the token file is refused."""
    try:
        return auth_headers(token_file)
    except ValueError as e:
        print(f"batchfs-server {command}: {e}", file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="batchfs-server cluster-status", description="Print a cluster's nodes (id, role, up or DOWN, URL) and each target's rebalance "
                                "progress, as the gateway at URL sees them.",
                                epilog="exit status: 0 every target up (or parked in maintenance) and no rebalance due, 3 rebalance "
                                "running (or due again) or a target leaving (or in maintenance, not yet parked), 4 a target "
                                "down (a gateway down shows as DOWN, or ? through a secondary, which does not probe gateways), 1 no answer")
    p.add_argument("gateway", metavar="URL", help="a gateway, e.g. http://10.0.0.1:8080")
    add_token_argument(p)
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    a = p.parse_args(argv)
    headers = headers_or_none(a.token_file, "cluster status")
    if headers is None:
        return 1
    url = a.gateway.rstrip("/") + "/v1/cluster/status"
    try:
        r = httpx.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"batchfs-server cluster-status: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"batchfs-server cluster-status: {url}: HTTP {r.status_code}: {r.text[:300]}"
              + (" (is it a gateway? single nodes have no cluster status)" if r.status_code == 404 else ""),
              file=sys.stderr)
        return 1
    doc = r.json()
    text, code = render(doc)
    print(r.text if a.json else text)
    return code
