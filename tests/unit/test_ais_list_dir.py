"""``AisClient.list_dir`` asks for a non-recursive listing and reads both answers a server may
give: ``EntryIsDir`` entries (AIStore's LsNoRecursion, and ours), resumed by the server's
token; or a recursive page (a server that ignores the flag), where each subdirectory is
reported once and a page ending inside one skips the rest of its subtree."""

from __future__ import annotations

import json

import httpx
import msgpack
import pytest

from batchfs.objclient.ais import ENTRY_IS_DIR, LS_NO_RECURSION, AisClient
from batchfs.objclient.config import ClientConfig, Source
from batchfs.wire.names import MAX_OBJNAME_BYTES, past_subtree


def _client(replies: list[dict], asked: list[dict]) -> AisClient:
    """A client whose HTTP goes to a stand-in server answering ``replies`` in turn (msgpack,
    as AIStore does) and recording each listing's message value."""
    c = AisClient(ClientConfig(Source("ais", "http://127.0.0.1:9", "b")))

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.content)["value"])
        return httpx.Response(200, content=msgpack.packb(replies.pop(0)),
                              headers={"Content-Type": "application/msgpack"})

    c.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return c


def _obj(name: str) -> dict:
    return {"n": name, "s": 3, "cs": "c", "v": "1", "f": 0}


@pytest.mark.trio
async def test_a_non_recursive_page_gives_each_directory_once_and_resumes_at_the_token():
    asked: list[dict] = []
    c = _client([{"Entries": [_obj("d/a"), {"n": "d/b/", "f": ENTRY_IS_DIR}, {"n": "d/c/", "f": ENTRY_IS_DIR}],
                  "ContinuationToken": "d/c/"},
                 {"Entries": [_obj("d/z")], "ContinuationToken": ""}], asked)
    first = await c.list_dir("b", "d/", "", 3)
    assert [f.key for f in first.files] == ["d/a"] and first.dirs == ["b", "c"]
    assert first.next_token == "c:d/c/"  # the server's token: it resumes after the subtree
    last = await c.list_dir("b", "d/", first.next_token, 3)
    assert [f.key for f in last.files] == ["d/z"] and last.dirs == [] and last.next_token == ""
    assert [(v["prefix"], v["continuation_token"], v["start_after"]) for v in asked] == \
        [("d/", "", ""), ("d/", "d/c/", "")]
    assert all(v["flags"] == LS_NO_RECURSION for v in asked)
    await c.http.aclose()


@pytest.mark.trio
async def test_a_recursive_answer_is_understood_too():
    asked: list[dict] = []
    c = _client([{"Entries": [_obj("d/a"), _obj("d/b/1"), _obj("d/b/2"), _obj("d/c/x/1")],
                  "ContinuationToken": "d/c/x/1"}], asked)
    page = await c.list_dir("b", "d/", "", 4)
    assert [f.key for f in page.files] == ["d/a"] and page.dirs == ["b", "c"]
    assert page.next_token == f"s:{past_subtree('d/c/')}"  # past the rest of d/c/, not into it
    await c.http.aclose()



def _recursive_server(names: list[str]):
    """A stand-in for a server that ignores LsNoRecursion: every name under the prefix, in
    UTF-8 byte order, strictly after ``start_after`` or the token, ``pagesize`` a page."""
    ordered = sorted(names, key=str.encode)

    def answer(request: httpx.Request) -> httpx.Response:
        v = json.loads(request.content)["value"]
        after = (v["continuation_token"] or v["start_after"]).encode()
        rest = [n for n in ordered if n.startswith(v["prefix"]) and n.encode() > after]
        page = rest[:v["pagesize"]]
        token = page[-1] if len(rest) > len(page) else ""
        return httpx.Response(200, content=msgpack.packb({"Entries": [_obj(n) for n in page],
                                                          "ContinuationToken": token}),
                              headers={"Content-Type": "application/msgpack"})
    return answer


@pytest.mark.trio
async def test_a_subtree_skipped_on_a_recursive_server_stays_skipped_whatever_its_names():
    """A page that ends inside ``d/c/`` restarts past the whole subtree, also past names made of
    U+10FFFF (the greatest code point) and a name of the greatest length. Restarting after
    ``d/c/`` + one U+10FFFF found ``d/c/\U0010ffffx`` and reported ``c`` again, page after page;
    names longer than the limit, past the padded end, are paged through without a restart."""
    top = "\U0010ffff"
    deep = "d/c/" + top * ((MAX_OBJNAME_BYTES - 4) // 4)  # 1024 bytes
    # and names longer than our limit (AIStore allows them): past the end, paged through
    longer = ["d/c/" + top * k for k in (300, 301, 302, 303, 304)]
    names = ["d/a", "d/c/1", "d/c/2", "d/c/" + top, "d/c/" + top * 2 + "x", "d/c/" + top * 2 + "y",
             "d/c/" + top * 3, deep, *longer, "d/c0", "d/z"]
    assert len(deep.encode()) == MAX_OBJNAME_BYTES
    c = AisClient(ClientConfig(Source("ais", "http://127.0.0.1:9", "b")))
    c.http = httpx.AsyncClient(transport=httpx.MockTransport(_recursive_server(names)))
    files, dirs, token = [], [], ""
    for _ in range(20):
        page = await c.list_dir("b", "d/", token, 2)
        files += [f.key for f in page.files]
        dirs += page.dirs
        token = page.next_token
        if not token:
            break
    await c.http.aclose()
    assert (files, dirs, token) == (["d/a", "d/c0", "d/z"], ["c"], "")
    assert past_subtree("d/c/") > deep and past_subtree("d/c/").encode() > deep.encode()
    assert past_subtree("d/c/").encode() < b"d/c0"
