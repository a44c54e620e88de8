"""An emulated network for benchmarks: a TCP proxy that delays every byte by a fixed time.

The kernel here has no netem, so loopback answers a request in ~0.1 ms where a datacenter
object store takes 1-5 ms and S3 10-30 ms. Every benchmark side (the batchfs mount, s3fs,
rclone, the SDK, curl) talks to the server through the same ``DelayLine`` to measure what
per-request latency does to it.

Design (one line per connection, two directions each):

- One thread per direction ``recv``s whatever arrived, stamps it with its due time
  ``arrival + one_way``, and sends the head piece when it is due, waiting in between in
  ``select`` for whichever comes first. Pieces leave in arrival order (one FIFO per
  direction), so TCP's ordering holds, and a piece
  is never sent early: the round trip of a 1-byte exchange is ``2 * one_way`` plus the
  proxy's own handoff cost (measured by ``--selftest``, documented in docs/network.md).
- Bandwidth is not capped unless ``rate`` is given (a token bucket per direction, in bytes per
  second); bytes in flight are bounded by ``window`` per direction (the reader stops reading
  when that much is queued, so TCP flow control pushes back on the sender, as a full
  bandwidth-delay product would).
- ``setup`` delays the upstream connect: the handshake cost of a new TCP (or TLS) connection,
  paid once per connection, which is what connection reuse saves.
- Threads, not asyncio: asyncio's epoll waits in whole milliseconds (a 0.5 ms one-way delay
  would round to 1 ms), while ``select`` with the timer slack set to 1 ns wakes within tens
  of microseconds. A proxy holds tens of connections in a benchmark, so threads are cheap.
- Zero delay and no rate: ``splice`` moves the bytes through a pipe inside the kernel, no
  copy into Python (``--selftest`` compares it with direct loopback).

Run it as its own process (``python -m bench.delayline --upstream HOST:PORT --rtt-ms 5``), so
its CPU shows apart from the measured processes; it prints ``delayline: listening on
http://HOST:PORT`` when ready. Loopback addresses only: it refuses any other upstream.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import ipaddress
import os
import select
import socket
import statistics
import sys
import threading
import time

PIECE = 1 << 20  # most bytes one recv takes; bigger pieces mean fewer thread handoffs
DEFAULT_WINDOW = 64 << 20  # bytes queued per direction before the reader stops reading
REALTIME = True  # see _prompt_wakeups; --no-realtime turns it off
F_SETPIPE_SZ = 1031  # fcntl: a pipe that holds a whole piece, so one splice moves it


def _prompt_wakeups() -> None:
    """Make the calling thread wake on time: exact timers and, when allowed, real-time priority.

    Linux coalesces a sleeping thread's wakeups by 50 us by default (the timer slack), and on
    a loaded 2-core machine a woken thread waits behind the running ones for hundreds of
    microseconds: both would add to every delay. SCHED_FIFO (root only) lets the line's
    threads run the moment their bytes are due; they sleep in select or splice otherwise, so
    they take the CPU only for the copies they make. Both settings are per thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK = 1 ns
    except (OSError, AttributeError):
        pass
    if REALTIME:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        except (OSError, AttributeError):
            pass


def _check_loopback(host: str) -> None:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    for info in infos:
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise ValueError(f"{host} is not a loopback address: the delay line is for local benchmarks only")


class _Direction:
    """One direction of one connection, run by one thread: a FIFO of (due time, bytes).

    The thread waits in ``select`` (microsecond timeouts, unlike epoll's milliseconds) for
    either new bytes or the head piece's due time, so no second thread sits between a
    piece's arrival and its departure."""

    def __init__(self, src: socket.socket, dst: socket.socket, one_way: float, rate: float | None,
                 window: int, on_done) -> None:
        self.src, self.dst = src, dst
        self.one_way, self.rate, self.window = one_way, rate, window
        self.on_done = on_done
        self.bytes = 0

    def start(self) -> None:
        plain = self.one_way == 0 and self.rate is None
        threading.Thread(target=self._splice if plain else self._delay, daemon=True).start()

    def _splice(self) -> None:
        """Zero delay, no cap: move bytes socket -> pipe -> socket inside the kernel."""
        _prompt_wakeups()
        r, w = os.pipe()
        try:
            fcntl.fcntl(r, F_SETPIPE_SZ, PIECE)
        except OSError:
            pass
        src, dst = self.src.fileno(), self.dst.fileno()
        try:
            while True:
                n = os.splice(src, w, PIECE)
                if n == 0:
                    break
                while n:
                    moved = os.splice(r, dst, n)
                    n -= moved
                    self.bytes += moved
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)
        self.on_done()

    def _delay(self) -> None:
        _prompt_wakeups()
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        queued, eof, tokens, last = 0, False, 0.0, time.monotonic()
        try:
            while True:
                now = time.monotonic()
                while queue and queue[0][0] <= now:
                    due, data = queue[0]
                    if self.rate is not None:  # token bucket, at most one piece of burst
                        tokens = min(tokens + (now - last) * self.rate, float(PIECE))
                        last = now
                        if tokens < len(data):
                            time.sleep((len(data) - tokens) / self.rate)
                            tokens, last = 0.0, time.monotonic()
                        else:
                            tokens -= len(data)
                    self.dst.sendall(data)
                    self.bytes += len(data)
                    queue.popleft()
                    queued -= len(data)
                    now = time.monotonic()
                if eof and not queue:
                    self.dst.shutdown(socket.SHUT_WR)
                    break
                timeout = max(0.0, queue[0][0] - now) if queue else None
                if eof or queued >= self.window:  # full window: let TCP push back on the sender
                    time.sleep(timeout or 0.0)
                    continue
                if select.select([self.src], [], [], timeout)[0]:
                    data = self.src.recv(PIECE)
                    if not data:
                        eof = True
                        continue
                    queue.append((time.monotonic() + self.one_way, data))
                    queued += len(data)
        except OSError:
            pass
        self.on_done()


class DelayLine:
    """A listening proxy: every accepted connection is forwarded to ``upstream`` through two
    delayed directions. ``rtt`` and ``setup`` in seconds, ``rate`` in bytes per second."""

    def __init__(self, upstream: tuple[str, int], rtt: float, *, listen: tuple[str, int] = ("127.0.0.1", 0),
                 rate: float | None = None, setup: float = 0.0, window: int = DEFAULT_WINDOW,
                 calibrate: bool = True) -> None:
        if rtt < 0 or setup < 0 or (rate is not None and rate <= 0):
            raise ValueError("rtt and setup must be >= 0 and rate > 0")
        _check_loopback(upstream[0])
        _check_loopback(listen[0])
        self.upstream, self.rate, self.setup, self.window = upstream, rate, setup, window
        self.rtt = rtt
        # The line's own cost per direction (a recv, a send and the wakeups between them) is
        # measured once and taken off the delay, so what a client sees is the RTT it asked for.
        self.handoff = _measure_handoff() if calibrate and rtt > 0 else 0.0
        self.one_way = max(0.0, rtt / 2 - self.handoff)
        self.sock = socket.create_server(listen, backlog=1024)
        self.address = self.sock.getsockname()[:2]
        self.connections = 0
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def start(self) -> DelayLine:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _connect(self, client: socket.socket) -> None:
        _prompt_wakeups()
        if self.setup:
            time.sleep(self.setup)
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        remaining = [2]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                client.close()
                server.close()

        _Direction(client, server, self.one_way, self.rate, self.window, done).start()
        _Direction(server, client, self.one_way, self.rate, self.window, done).start()


CALIBRATION_RTT = 0.002  # seconds; long enough that every hop really sleeps, as in use


def _measure_handoff(samples: int = 200) -> float:
    """Seconds one direction adds beyond its delay, less what loopback costs anyway: the
    1-byte RTT through an uncompensated line set to ``CALIBRATION_RTT``, minus that setting
    and the direct RTT, halved. It is mostly the timer's wake-up latency (50-65 us on this
    virtual machine even under SCHED_FIFO) and one ``send``."""
    echo, addr = _echo_server()
    try:
        direct = measure_rtt(addr, samples)
        line = DelayLine(addr, CALIBRATION_RTT, calibrate=False).start()
        try:
            through = measure_rtt(line.address, samples)
        finally:
            line.close()
    finally:
        echo.close()
    return max(0.0, (through - CALIBRATION_RTT - direct) / 2)


# ---------------------------------------------------------------- self test


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    sock = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                data = conn.recv(PIECE)
                if not data:
                    return
                if data[:1] == b"B":  # bulk request: "B<n>\n" -> n bytes
                    n = int(data[1:].split(b"\n")[0])
                    block = b"\0" * PIECE
                    while n > 0:
                        conn.sendall(block[:min(n, PIECE)])
                        n -= PIECE
                    return
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return sock, sock.getsockname()[:2]


def measure_rtt(address: tuple[str, int], count: int = 200) -> float:
    """Median seconds for a 1-byte request and its 1-byte reply on one connection."""
    with socket.create_connection(address) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            t = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bulk(address: tuple[str, int], nbytes: int) -> float:
    """Bytes per second of one stream of ``nbytes``."""
    buf = bytearray(PIECE)
    with socket.create_connection(address) as s:
        t = time.perf_counter()
        s.sendall(b"B%d\n" % nbytes)
        got = 0
        while got < nbytes:
            n = s.recv_into(buf)
            if n == 0:
                break
            got += n
        return got / (time.perf_counter() - t)


def selftest(rtts_ms: list[float], bulk_mib: int) -> int:
    echo, addr = _echo_server()
    print(f"{'setting':>12} {'1-byte RTT median':>18} {'error':>8}   "
          f"(SCHED_FIFO {'on' if REALTIME else 'off'})")
    base = measure_rtt(addr)
    print(f"{'loopback':>12} {base * 1e3:15.3f} ms {'':>8}")
    worst = 0.0
    for ms in rtts_ms:
        line = DelayLine(addr, ms / 1e3).start()
        got = measure_rtt(line.address, count=max(20, int(200 / max(ms, 1))))
        err = (got - ms / 1e3) / (ms / 1e3) if ms else 0.0
        if ms >= 1:  # sub-millisecond settings are shown, not promised (timer wake-up jitter)
            worst = max(worst, abs(err))
        print(f"{ms:9.2f} ms {got * 1e3:15.3f} ms {err * 100:+7.1f}%   (handoff taken off: "
              f"{line.handoff * 1e6:.0f} us per direction)")
        line.close()
    direct = measure_bulk(addr, bulk_mib << 20)
    line = DelayLine(addr, 0.0).start()
    proxied = measure_bulk(line.address, bulk_mib << 20)
    line.close()
    print(f"bulk {bulk_mib} MiB: loopback {direct / 2**20:,.0f} MiB/s, through the line at 0 ms "
          f"{proxied / 2**20:,.0f} MiB/s ({proxied / direct:.2f}x)")
    echo.close()
    ok = worst <= 0.10
    print(f"worst RTT error {worst * 100:.1f}% ({'within' if ok else 'beyond'} 10%)")
    return 0 if ok else 1


class LineProcess:
    """``python -m bench.delayline`` in its own process in front of ``upstream_url``, so its CPU
    is apart from the measured processes (``pid`` for accounting); ``url`` is where clients go.
    ``rtt_ms`` 0 still proxies (splice), so every side of a comparison pays the same hop."""

    def __init__(self, upstream_url: str, rtt_ms: float, timeout: float = 30.0):
        import subprocess
        from urllib.parse import urlsplit

        u = urlsplit(upstream_url)
        self.rtt_ms = rtt_ms
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.delayline", "--upstream", f"{u.hostname}:{u.port}",
                                      "--rtt-ms", str(rtt_ms)], stdout=subprocess.PIPE, text=True,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("delayline: listening on "):
            self.close()
            raise RuntimeError(f"the delay line did not start within {timeout} s: {line!r}")
        self.url = line.split()[-1]
        self.pid = self.proc.pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="delayline", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", type=_hostport, metavar="HOST:PORT", help="the server to forward to (loopback)")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), metavar="HOST:PORT",
                   help="address to listen on; port 0 picks a free one (default: 127.0.0.1:0)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time added, milliseconds (default: 0)")
    p.add_argument("--rate-mibps", type=float, help="bandwidth cap per direction, MiB/s (default: none)")
    p.add_argument("--setup-ms", type=float, default=0.0,
                   help="extra delay before each new connection reaches the server, milliseconds (default: 0)")
    p.add_argument("--selftest", action="store_true",
                   help="validate against an echo server: 1-byte RTT at 0.5/1/5/10 ms (1 ms and up must be "
                   "within 10%%; exit 1 otherwise) and one bulk stream at 0 ms vs direct loopback")
    p.add_argument("--bulk-mib", type=int, default=1024, help="bulk stream size for --selftest (default: 1024)")
    p.add_argument("--no-realtime", action="store_true",
                   help="do not raise the line's threads to SCHED_FIFO (the default when run as root)")
    args = p.parse_args(argv)
    global REALTIME
    REALTIME = not args.no_realtime
    if args.selftest:
        return selftest([0.5, 1.0, 5.0, 10.0], args.bulk_mib)
    if not args.upstream:
        p.error("--upstream is required (or --selftest)")
    try:
        line = DelayLine(args.upstream, args.rtt_ms / 1e3, listen=args.listen,
                         rate=args.rate_mibps * 2**20 if args.rate_mibps else None, setup=args.setup_ms / 1e3)
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"delayline: listening on {line.url}", flush=True)
    try:
        line.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
