"""tests/mount: real FUSE mounts (root, /dev/fuse, fusermount3) over real server processes.
Every test here is marked ``fuse``, so ``pytest -m "not fuse"`` runs the suite without them."""

from pathlib import Path

import pytest

from tests.support.fixtures import bucket, server  # noqa: F401 (fixtures)

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.fuse)
