"""Secrets at rest: reading a token file and keeping only the SHA-256 digests of its tokens.

Invariants: a token file readable or writable by other users is refused (as ssh refuses a
readable key), as is one that is not a regular file, is larger than 1 MiB, or holds a token that
is too short or that an HTTP header cannot carry. Only digests are kept in memory; comparing
them is the access check's business (``server.api.auth``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

MIN_TOKEN_CHARS = 16  # a shorter secret can be guessed online


def token_digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def read_private_file(path: Path, what: str) -> str:
    """The ASCII text of a secret file; ValueError (naming ``what``) when it is accessible by
    other users, not a regular file, larger than 1 MiB or not ASCII."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the file we read, not whatever the path points to a moment later
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path}: not a regular file")
        if st.st_mode & 0o007:
            raise ValueError(f"{what} {path} is accessible by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); restrict it: chmod 600 {path}")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1024 * 1024 + 1)
    finally:
        os.close(fd)
    if len(raw) > 1024 * 1024:
        raise ValueError(f"{what} {path}: larger than 1 MiB")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: must be ASCII") from None


def load_token_file(path: Path) -> tuple[bytes, ...]:
    """The SHA-256 digests of the tokens in ``path``: one token per line, blank lines and
    lines starting with ``#`` ignored. Refused (ValueError with the reason) when the file is
    readable or writable by others, missing, empty, or holds a token that is too short or
    has characters a header cannot carry."""
    text = read_private_file(path, "auth token file")
    digests = []
    for n, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if any(not 0x21 <= ord(c) <= 0x7E for c in token):
            raise ValueError(f"auth token file {path}, line {n}: a token has no spaces or control characters")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"auth token file {path}, line {n}: token shorter than {MIN_TOKEN_CHARS} "
                             "characters (make one with: openssl rand -hex 32)")
        digests.append(token_digest(token))
    if not digests:
        raise ValueError(f"auth token file {path}: no token in it (one per line)")
    return tuple(dict.fromkeys(digests))
