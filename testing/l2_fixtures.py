"""A real Redis cluster for the L2 tests (three primaries on free loopback ports)."""

from __future__ import annotations

import os
import tempfile
import time
from functools import cache
from typing import Any

import pytest

from testing.redis_nodes import RedisNodes, store_binaries

NO_STORE_REASON = ("L2 tests need redis-server and redis-cli (or valkey-*): scripts/setup.sh installs "
                   "redis-server with apt as root; this machine has neither apt access nor the binaries")


L2_SECRET = "l2-secret-for-the-tests-0123456789abcdef"  # every test server shares it, as hosts of one store must


@cache
def l2_secret_file() -> str:
    """A 0600 file holding :data:`L2_SECRET` (``--l2-secret-file``)."""
    fd, path = tempfile.mkstemp(prefix="glm-l2-secret-")
    with os.fdopen(fd, "w") as f:
        f.write(L2_SECRET + "\n")
    return path


def l2_args(url: str) -> list[str]:
    """The server flags of an L2 tier on ``url``."""
    return ["--l2", url, "--l2-secret-file", l2_secret_file()]


def require_store() -> None:
    """Skip, saying why, where no Redis/Valkey server can be run."""
    if store_binaries() is None:
        pytest.skip(NO_STORE_REASON)


def start_cluster() -> RedisNodes:
    require_store()
    return RedisNodes(3, cluster=True, maxmemory_mb=256).start()


def wait_written(status: Any, objects: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll ``status()`` (a server's /status document) until its L2 writer has written at
    least ``objects`` objects and its queue is empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        l2 = status()["l2"]
        if l2["written_objects"] >= objects and l2["queue_items"] == 0:
            return l2
        if time.monotonic() > deadline:
            raise AssertionError(f"L2 writes did not complete within {timeout_s}s "
                                 f"(wanted {objects} written, queue empty): {l2}")
        time.sleep(0.05)
