"""The fixtures of the layers that need a server process (tests/server, tests/mount): each
folder's conftest imports them, so tests/unit never starts one. ``server`` is one real server
process per session and folder (two data directories, 1 MiB chunks); ``bucket`` is a fresh
bucket on it per test."""

from __future__ import annotations

import pytest

from tests.support.objects import CHUNK, new_bucket
from tests.support.processes import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("server")
    srv = ServerProcess([base / "d1", base / "d2"], "--chunk-size", str(CHUNK))
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture
def bucket(server) -> str:
    return new_bucket(server.url)
