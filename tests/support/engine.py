"""Helpers for engine tests: build an ``Engine`` over an in-memory client inside trio."""

from __future__ import annotations

import contextlib
from pathlib import Path

import trio

from batchfs.objclient.memory import MemoryClient
from batchfs.engine.config import MountConfig
from batchfs.objclient.config import Source
from batchfs.engine.filesystem import Engine
from batchfs.engine.namespace import ROOT_INODE

KiB = 1024
MiB = 1024 * KiB


def config(**kw) -> MountConfig:
    base = dict(source=Source("ais", "mem://", "b"), mountpoint=Path("/nonexistent"),
                chunk_size_bytes=64 * KiB, parallel_per_file=4, parallel_total=8,
                memory_budget_bytes=4 * MiB, memory_cache_bytes=1 * MiB,
                request_timeout_seconds=5.0, metadata_ttl_seconds=60.0)
    base.update(kw)
    return MountConfig(**base)


@contextlib.asynccontextmanager
async def engine(client, **kw):
    cfg = config(**kw)
    async with trio.open_nursery() as nursery:
        eng = await Engine.start(cfg, client, nursery)
        try:
            yield eng
        finally:
            await eng.aclose()
            nursery.cancel_scope.cancel()


async def resolve(eng: Engine, path: str) -> int:
    ino = ROOT_INODE
    for part in path.split("/"):
        ino = (await eng.lookup(ino, part)).ino
    return ino


async def read_all(eng: Engine, path: str, block: int = 128 * KiB) -> bytes:
    fh = (await eng.open(await resolve(eng, path))).fh
    try:
        out, off = [], 0
        while True:
            data = await eng.read(fh, off, block)
            if not data:
                return b"".join(out)
            out.append(data)
            off += len(data)
    finally:
        eng.release(fh)


def memory_client(**kw) -> MemoryClient:
    c = MemoryClient(**kw)
    c.buckets["b"] = {}
    return c
