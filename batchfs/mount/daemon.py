"""Running a mount: foreground or background, readiness, signals, logging, systemd notify.

Background mode (the default) forks BEFORE trio starts (forking a running trio process is
unsafe). The child detaches (setsid, cwd /, stdio to the log file or /dev/null) and serves;
the parent waits on a pipe for one line from the child:

    READY            the mount is live: the parent exits 0
    ERROR <message>  startup failed (server unreachable, bucket missing, FUSE refused): the
                     parent prints the message and exits 1

EOF without a line means the child died; the parent then reports its exit status. Either way
the parent makes sure nothing is left mounted before exiting non-zero.

"Live" means the mountpoint is in /proc/self/mountinfo. ``fs.serve`` calls ``on_ready`` from
inside trio; we must not stat the mountpoint there (the stat would be a FUSE request to the
very loop we block), so a helper thread polls mountinfo and only then announces READY — on
the pipe, and with ``READY=1`` on $NOTIFY_SOCKET when systemd started us (Type=notify).

SIGTERM, SIGINT and SIGHUP cancel ``fs.serve``, which unmounts on the way out, so stopping the
process never leaves a dead "Transport endpoint is not connected" mountpoint behind.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from batchfs.engine.config import MountConfig
from batchfs.wire.units import is_decimal

log = logging.getLogger("batchfs")

_READY_POLL_SECONDS = 0.01
_MOUNT_APPEAR_SECONDS = 10.0  # after on_ready, the mount must show in mountinfo within this
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class MountError(Exception):
    """The mount cannot be started or stopped (mountpoint, log file, fusermount3): one line."""


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and is_decimal(field[i + 1:i + 4]):
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(path: Path | str) -> bool:
    """True if something is mounted on ``path``, read from mountinfo.

    Unlike os.path.ismount this sends no request to the filesystem, so it works on a dead FUSE
    mount (which os.path.ismount reports as not mounted) and from inside the daemon.
    """
    target = os.path.realpath(path)  # non-strict: a dead mount's ENOTCONN does not raise
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ", 5)
                if len(fields) > 4 and _unescape_mountinfo(fields[4]) == target:
                    return True
    except OSError:
        return os.path.ismount(path)
    return False


def unmount(path: Path, lazy: bool = False) -> None:
    """fusermount3 -u [-z]; raises MountError with fusermount3's own message on failure."""
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(path)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise MountError("fusermount3 not found (install the fuse3 package)") from None
    except subprocess.TimeoutExpired:
        raise MountError(f"fusermount3 -u {path} did not finish within 60s") from None
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise MountError(f"cannot unmount {path}: {msg[-1] if msg else f'fusermount3 exited {r.returncode}'}")


def sd_notify(message: str) -> bool:
    """Send a systemd notification (e.g. "READY=1") if $NOTIFY_SOCKET is set; never raises.

    The protocol is one datagram on a Unix socket; a leading "@" names an abstract socket.
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or not (addr[0] in "/@"):
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False


def setup_logging(config: MountConfig, foreground: bool) -> None:
    """Foreground: stderr. Background: the log file (stdio already points there), else syslog."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if foreground and config.log_file is not None:
        handler = logging.FileHandler(config.log_file)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    elif foreground or config.log_file is not None:  # in the background stderr IS the log file
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(address="/dev/log",
                                                 facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        handler.setFormatter(logging.Formatter(f"batchfs[{os.getpid()}]: %(levelname)s %(name)s: %(message)s"))
    else:  # no file, no syslog socket (containers): nowhere to write
        handler = logging.NullHandler()
    root.addHandler(handler)
    root.setLevel(config.log_level)
    # httpx logs every request at INFO: that is debug detail for a filesystem daemon
    logging.getLogger("httpx").setLevel(logging.DEBUG if config.log_level == "DEBUG" else logging.WARNING)


def _announce_when_mounted(config: MountConfig, announce: Callable[[str], None]) -> None:
    """Thread body: wait until the mount shows in mountinfo, then announce READY (or an error)."""
    deadline = time.monotonic() + _MOUNT_APPEAR_SECONDS
    while not is_mounted(config.mountpoint):
        if time.monotonic() > deadline:
            announce(f"ERROR the filesystem reported ready but {config.mountpoint} is not mounted")
            return
        time.sleep(_READY_POLL_SECONDS)
    log.info("mounted %s on %s", config.source.endpoint, config.mountpoint)
    announce("READY")
    sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {config.mountpoint}")


async def serve_until_signal(config: MountConfig, on_ready: Callable[[], None]) -> None:
    """Serve the mount until it is unmounted from outside or SIGTERM/SIGINT/SIGHUP arrives (the one
    place the mount handles signals): a signal cancels ``adapter.serve``, which unmounts cleanly."""
    import trio

    from batchfs.mount import adapter as fs

    async with trio.open_nursery() as nursery:
        async def serve() -> None:
            await fs.serve(config, on_ready)
            nursery.cancel_scope.cancel()  # unmounted (from outside, or on a signal fs.serve took)

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            nursery.start_soon(serve)
            async for signum in signals:
                log.info("%s: unmounting %s", signal.Signals(signum).name, config.mountpoint)
                nursery.cancel_scope.cancel()  # fs.serve unmounts on cancellation
                break


def serve_blocking(config: MountConfig, announce: Callable[[str], None], log_errors: bool) -> int:
    """Run the mount in this process until unmounted or signalled. Returns the exit status.

    ``announce`` receives exactly one line: "READY" or "ERROR <message>". ``log_errors`` also
    logs a startup error (in the background, where the log is the only record of it).
    """
    import trio

    announced = threading.Event()
    lock = threading.Lock()  # the ready thread and this one may both try to announce

    def once(line: str) -> None:
        with lock:
            if announced.is_set():
                return
            announced.set()
        announce(line)

    def on_ready() -> None:
        threading.Thread(target=_announce_when_mounted, args=(config, once), daemon=True,
                         name="batchfs-ready").start()

    from batchfs.errors import SourceError

    try:
        trio.run(serve_until_signal, config, on_ready)
    except Exception as group:
        e = _first_leaf(group)  # the nursery wraps what fs.serve raised in an ExceptionGroup
        if isinstance(e, SourceError):  # its message already names the source
            if log_errors:
                log.error("%s", e)
            once(f"ERROR {e}")
        else:
            log.error("the filesystem stopped on an error", exc_info=group)
            once(f"ERROR cannot mount on {config.mountpoint}: {type(e).__name__}: {e}")
        return 1
    finally:
        sd_notify("STOPPING=1")
    if not announced.is_set():
        once(f"ERROR the filesystem stopped before {config.mountpoint} was live")
        return 1
    log.info("unmounted %s", config.mountpoint)
    return 0


def _first_leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _startup_deadline_seconds(config: MountConfig) -> float:
    # the engine's own bounded checks (connect, HEAD/list with retries), plus slack for FUSE
    return config.connect_timeout_seconds + config.request_timeout_seconds + 30.0


def run(config: MountConfig, foreground: bool, source_text: str) -> int:
    """Mount; in the background unless ``foreground``. Returns the exit status for the CLI."""
    if foreground:
        setup_logging(config, foreground=True)

        def announce(line: str) -> None:
            if line.startswith("ERROR "):
                print(f"batchfs: {line[6:]}", file=sys.stderr, flush=True)

        return serve_blocking(config, announce, log_errors=False)

    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(read_fd)
        status = 1
        try:
            _detach(config)
            setup_logging(config, foreground=False)

            def announce(line: str) -> None:
                try:
                    os.write(write_fd, (line.replace("\n", " ") + "\n").encode())
                    os.close(write_fd)
                except OSError:
                    pass  # the parent is gone; nothing to tell

            status = serve_blocking(config, announce, log_errors=True)
        finally:
            logging.shutdown()
            os._exit(status)
    os.close(write_fd)
    return _wait_for_child(pid, read_fd, config, source_text)


def _detach(config: MountConfig) -> None:
    os.setsid()
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDWR)
    out = null
    if config.log_file is not None:
        out = os.open(config.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)


def _wait_for_child(pid: int, read_fd: int, config: MountConfig, source_text: str) -> int:
    deadline = time.monotonic() + _startup_deadline_seconds(config)
    buf = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                _stop_child(pid)
                _cleanup_mount(config.mountpoint)
                return _error(source_text, config, f"not live within {_startup_deadline_seconds(config):g}s; gave up")
            ready, _, _ = select.select([pipe], [], [], left)
            if ready:
                chunk = pipe.read(4096)
                if not chunk:
                    break
                buf += chunk
    line = buf.decode(errors="replace").strip()
    if line == "READY":
        return 0
    if line.startswith("ERROR "):
        _reap(pid, 30.0)
        _cleanup_mount(config.mountpoint)
        print(f"batchfs: {line[6:]}", file=sys.stderr)
        return 1
    status = _reap(pid, 30.0)
    _cleanup_mount(config.mountpoint)
    where = f"; see {config.log_file}" if config.log_file else ""
    return _error(source_text, config, f"the mount process exited ({status}) before the mount was live{where}")


def _error(source_text: str, config: MountConfig, message: str) -> int:
    print(f"batchfs: cannot mount {source_text} on {config.mountpoint}: {message}", file=sys.stderr)
    return 1


def _reap(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"status {os.waitstatus_to_exitcode(status)}"
        time.sleep(0.01)
    _stop_child(pid)
    return "killed"


def _stop_child(pid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.01)


def _cleanup_mount(path: Path) -> None:
    """Safety net: a failed startup must leave nothing mounted."""
    if is_mounted(path):
        try:
            unmount(path, lazy=True)
        except MountError as e:
            print(f"batchfs: {e}", file=sys.stderr)
