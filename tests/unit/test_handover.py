"""How the walk hands objects over (server.cluster.handover): ``--rebalance-rate``, its copies
paced to a byte rate on average, and the option as a flag and in a TOML file; the fence that keeps
two targets with different maps from both letting go of an object."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.cluster.handover import DropFence, NewerMap, Pace
from server.cli import build_parser, config_from_args
from server.config import ServerConfig


def test_copies_wait_their_turn_at_the_rate():
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        pace, start, done = Pace(1 << 20), loop.time(), []
        for size in (256 << 10, 256 << 10, 0, 256 << 10):  # 1 MiB/s: 0.25 s each, a 0-byte copy free
            await pace.paid(size)
            done.append(loop.time() - start)
        return done

    done = asyncio.run(run())
    assert 0.2 < done[0] < 0.3  # each rests for the bytes it sent
    assert 0.45 < done[1] < 0.6 and done[2] - done[1] < 0.05 and 0.7 < done[3] < 0.9


def test_no_limit_never_waits():
    async def run() -> float:
        loop = asyncio.get_running_loop()
        pace, start = Pace(0), loop.time()
        for _ in range(100):
            await pace.paid(1 << 30)
        return loop.time() - start

    assert asyncio.run(run()) < 0.05


def test_the_rate_as_a_flag_and_in_a_file(tmp_path):
    secret = tmp_path / "s"
    args = ["--role", "target", "--join", "http://127.0.0.1:1", "--cluster-secret-file", str(secret)]
    assert config_from_args(build_parser().parse_args(args + ["--rebalance-rate", "100MiB"])).rebalance_rate_bytes \
        == 100 << 20
    toml = tmp_path / "t.toml"
    toml.write_text('rebalance_rate = "2MiB"\n')
    assert config_from_args(build_parser().parse_args(args + ["--config", str(toml)])).rebalance_rate_bytes == 2 << 20
    assert ServerConfig().rebalance_rate_bytes == 0  # no limit by default
    with pytest.raises(ValueError, match="rebalance_rate_bytes"):
        ServerConfig(rebalance_rate_bytes=-1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(args + ["--rebalance-rate", "fast"])


def _let_go(fence: DropFence, walk, current, delete=lambda: None, name: str = "o"):
    return asyncio.run(fence.let_go("b", name, walk, current, delete))


def test_no_copy_is_let_go_while_another_map_is_known_here_or_at_an_asker():
    fence, v7, seen = DropFence(), (7, "aa"), []

    def delete():
        seen.append(fence.busy("b", "o"))  # answered "busy", never "held", while it runs
    _let_go(fence, v7, v7, delete)
    assert seen == [True] and not fence.busy("b", "o")
    with pytest.raises(NewerMap, match="not joined"):  # a restart: nothing heard from the primary yet
        _let_go(fence, v7, None)
    with pytest.raises(NewerMap, match="v8 arrived"):  # this target learned a newer map since its walk began
        _let_go(fence, v7, (8, "bb"))
    fence.asked(7, "aa")  # an asker with the same map: no fence
    _let_go(fence, v7, v7)
    fence.asked(7, "cc")  # another map of the same version (two primaries)
    with pytest.raises(NewerMap, match="another map v7"):
        _let_go(fence, v7, v7)
    fence.asked(9, "dd")  # a peer walking map v9 asked what this target holds
    fence.asked(3)  # an older asker (or one of an earlier release: no digest) does not lower the fence
    with pytest.raises(NewerMap, match="v9"):
        _let_go(fence, (8, "ee"), (8, "ee"))
    _let_go(fence, (9, "dd"), (9, "dd"))  # the walk of that map may
    assert not fence.busy("b", "o")


def test_a_cancelled_drop_keeps_the_name_busy_until_its_delete_returns():
    async def run() -> list:
        fence, release, states = DropFence(), threading.Event(), []
        task = asyncio.ensure_future(fence.let_go("b", "o", (1, "a"), (1, "a"), lambda: release.wait(5)))
        await asyncio.sleep(0.05)
        task.cancel()  # the walk stopped (a sibling failed): the delete thread goes on
        await asyncio.sleep(0.05)
        states.append(fence.busy("b", "o"))
        release.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not fence.busy("b", "o"):
                break
        states.append(fence.busy("b", "o"))
        return states

    assert asyncio.run(run()) == [True, False]


def test_a_failed_delete_leaves_the_name_not_busy():
    fence = DropFence()

    def delete():
        raise OSError("disk")
    with pytest.raises(OSError):
        _let_go(fence, (1, "a"), (1, "a"), delete)
    assert not fence.busy("b", "o")


def test_a_bad_value_names_its_flag(tmp_path, capsys):
    from server import cli

    args = ["--role", "target", "--join", "http://127.0.0.1:1", "--cluster-secret-file", str(tmp_path / "s"),
            "--data", str(tmp_path)]
    with pytest.raises(SystemExit):
        cli.main(args + ["--rebalance-objects", "100"])
    assert "error: rebalance_objects must be an integer from 1 to 64, got 100 (option --rebalance-objects)" \
        in capsys.readouterr().err


def test_who_asked_is_kept_across_a_restart(tmp_path):
    path = tmp_path / "fence.json"
    fence = DropFence(path)
    assert fence.asked(9, "dd") and not fence.asked(9, "dd") and not fence.asked(3)  # news only once
    assert fence.asked(9, "ee")  # another map of the same version is news
    fence.save()
    again = DropFence(path)  # the target restarted
    assert again.newest_asked == 9
    with pytest.raises(NewerMap, match="v9"):
        _let_go(again, (8, "x"), (8, "x"))
    with pytest.raises(NewerMap, match="another map v9"):
        _let_go(again, (9, "dd"), (9, "dd"))
    path.write_text("{torn")  # a damaged disk: set aside, started empty (drops then wait for the join)
    assert DropFence(path).newest_asked == 0 and (tmp_path / "fence.json.unreadable").exists()
