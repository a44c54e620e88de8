"""tests/server: real server processes (no FUSE, except tests marked ``fuse``)."""

from tests.support.fixtures import bucket, server  # noqa: F401 (fixtures)
