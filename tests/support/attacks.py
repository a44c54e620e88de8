"""The GetBatch attacks of tests/server/test_attacks_getbatch.py, as pieces the attack
benchmark (bench/attack_getbatch.py) uses too: a compression bomb, and a client that sends a
streamed GetBatch and never reads the reply."""

from __future__ import annotations

import json
import socket
import tarfile
import zlib
from pathlib import Path

MiB = 1024 * 1024
SMALL = b"hello world\n" * 10  # the member after the bomb's zeros


def write_bomb(path: Path, mib: int) -> None:
    """TAR of ``mib`` MiB of zeros ('zeros.bin') then 'small.txt', gzip level 9, streamed."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    with open(path, "wb") as f:
        def header(name: str, size: int) -> bytes:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = size, 0o644, 0
            return ti.tobuf(tarfile.USTAR_FORMAT)
        f.write(z.compress(header("zeros.bin", mib * MiB)))
        block = bytes(MiB)
        for _ in range(mib):
            f.write(z.compress(block))
        f.write(z.compress(header("small.txt", len(SMALL)) + SMALL + bytes(-len(SMALL) % 512) + bytes(1024)))
        f.write(z.flush())


def raw_moss(url: str, bucket: str, entries: list[dict], strm: bool = True) -> socket.socket:
    """A GetBatch (streamed, or buffered with ``strm=False``) on a raw socket whose reply is never read."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"in": entries, "strm": strm}).encode()
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(f"GET /v1/ml/moss/{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s
