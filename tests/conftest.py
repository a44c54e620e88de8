"""Options of the whole suite. Fixtures live with the layer that needs them: tests/server and
tests/mount import theirs from tests.support.fixtures; tests/unit has none that start a process."""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("soak", "tests/server/test_soak.py (run with -m soak)")
    group.addoption("--soak-seconds", type=float, default=120.0,
                    help="seconds of client traffic in the soak test (default: 120)")
    group.addoption("--soak-seed", type=int, default=9, help="seed of the soak test's clients (default: 9)")
