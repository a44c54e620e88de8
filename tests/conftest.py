"""Shared fixtures: one real server process per session, a fresh bucket per test."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.support.processes import ServerProcess

CHUNK = 1 << 20  # the session server stores objects above 1 MiB as 1 MiB chunks


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
    name = "t" + uuid.uuid4().hex[:10]
    r = httpx.post(f"{server.url}/v1/buckets/{name}", json={"action": "create-bck", "name": "", "value": None})
    r.raise_for_status()
    return name


def put(server, bucket: str, name: str, data: bytes) -> None:
    r = httpx.put(f"{server.url}/v1/objects/{bucket}/{name}", content=data, timeout=60)
    r.raise_for_status()


def pytest_addoption(parser):
    group = parser.getgroup("soak", "tests/test_soak.py (run with -m soak)")
    group.addoption("--soak-seconds", type=float, default=120.0,
                    help="seconds of client traffic in the soak test (default: 120)")
    group.addoption("--soak-seed", type=int, default=9, help="seed of the soak test's clients (default: 9)")
