"""``--rebalance-rate``: the walk's copies paced to a byte rate on average (server.api.rebalance.Pace),
and the option as a flag and in a TOML file."""

from __future__ import annotations

import asyncio

import pytest

from server.api.rebalance import Pace
from server.cli import build_parser, config_from_args
from server.config import ServerConfig


def test_copies_wait_their_turn_at_the_rate():
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        pace, start, done = Pace(1 << 20), loop.time(), []
        for size in (256 << 10, 256 << 10, 0, 256 << 10):  # 1 MiB/s: 0.25 s each, a 0-byte copy free
            await pace.take(size)
            done.append(loop.time() - start)
        return done

    done = asyncio.run(run())
    assert done[0] < 0.05  # the first goes at once
    assert 0.2 < done[1] < 0.4 and done[2] - done[1] < 0.05 and 0.45 < done[3] < 0.7


def test_no_limit_never_waits():
    async def run() -> float:
        loop = asyncio.get_running_loop()
        pace, start = Pace(0), loop.time()
        for _ in range(100):
            await pace.take(1 << 30)
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
