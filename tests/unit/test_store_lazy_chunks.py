"""An object version opened lazily (``OpenObject(bring=...)``, what a spread version gets for
GetBatch and shard reads): a chunk is brought only when a read reaches it, a sequential reader
lets the chunks it passed go, and a second holder keeps them (no descriptor closed under a
reader in another thread)."""

from __future__ import annotations

import os
import shutil

from server.archive.members import RangeSource
from server.store.reader import OpenObject
from server.store.store import Store

MiB = 1 << 20


def _lazy(store: Store, tmp_path, data: bytes):
    """The object's version with every chunk brought as a temporary copy, and the bring log."""
    meta = store.put_bytes("b", "o", data)
    with store.open("b", "o") as whole:
        paths = [os.readlink(f"/proc/self/fd/{fd}") for fd, _ in whole.files]
    brought: list[int] = []

    def bring(i: int):
        brought.append(i)
        copy = tmp_path / f"chunk-{i}-{len(brought)}"
        shutil.copyfile(paths[i], copy)
        return copy, True

    return OpenObject(meta, [(None, c.size) for c in meta.chunks], store, bring=bring), brought


def open_chunks(obj: OpenObject) -> list[int]:
    return [i for i, (fd, _) in enumerate(obj.files) if fd >= 0]


def test_chunks_are_brought_when_reached_and_let_go_once_passed(tmp_path):
    store = Store([tmp_path / "d"], 1 * MiB)
    store.create_bucket("b")
    data = os.urandom(6 * MiB + 5)
    obj, brought = _lazy(store, tmp_path, data)
    try:
        assert open_chunks(obj) == [] and brought == []
        assert obj.pread(3 * MiB + 10, 3 * MiB + 20) == data[3 * MiB + 10:3 * MiB + 20]
        assert brought == [3] and open_chunks(obj) == [3]
        assert not list(tmp_path.glob("chunk-*"))  # the temporary copy is unlinked once open
        src = RangeSource(obj, MiB // 2, 5 * MiB, close_obj=False)
        got, most = b"", 0
        while piece := src.read(300_000):
            got += piece
            most = max(most, len(open_chunks(obj)))
        assert got == data[MiB // 2:MiB // 2 + 5 * MiB]
        assert most <= 2 and open_chunks(obj) == [5]  # never more than the chunk read and the next
        assert brought == [3, 0, 1, 2, 4, 5]  # each once: chunk 3 was still open when reached
        obj.hold()  # another thread reads: nothing is closed under it
        RangeSource(obj, 5 * MiB, MiB, close_obj=False).read(MiB)
        RangeSource(obj, 0, 10, close_obj=False).read(10)
        assert open_chunks(obj) == [0, 5]
        obj.release()
    finally:
        obj.close()
    assert obj.files == []  # every brought chunk closed with the object


def test_a_shard_index_scan_keeps_a_chunk_or_two(tmp_path):
    """Building a TAR shard's index reads every header: with a lazily opened version the chunks
    the scan has passed go, and the index equals the one of a version opened whole."""
    import io
    import tarfile

    from server.archive.shards import build_index

    store = Store([tmp_path / "d"], 1 * MiB)
    store.create_bucket("b")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(30):
            ti = tarfile.TarInfo(f"m/{i:02d}")
            ti.size = 200_000
            tf.addfile(ti, io.BytesIO(os.urandom(ti.size)))
    obj, brought = _lazy(store, tmp_path, buf.getvalue())
    most = [0]
    bring = obj._bring

    def counting(i):
        most[0] = max(most[0], len(open_chunks(obj)) + 1)
        return bring(i)

    obj._bring = counting
    try:
        index = build_index(obj, None)
    finally:
        obj.close()
    with store.open("b", "o") as whole:
        assert index.members == build_index(whole, None).members and len(index.members) == 30
    assert sorted(set(brought)) == list(range(len(obj.meta.chunks))) and most[0] <= 2
