"""Shared fixtures: a real glm-cache-server process for the module."""

from __future__ import annotations

import pytest

from testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def server():
    """glm-cache-server on free loopback ports, minimum chunk 256, for one test module (with
    the debug fault hook, so tests can flip a stored byte)."""
    srv = ServerProcess("--separate-object-groups", "--chunk-size", "256", "--l1-size-gb", "1", "--debug-fault-hooks")
    srv.start()
    yield srv
    srv.stop()


SERVER_CHUNK = 256  # the server fixture's minimum chunk


@pytest.fixture()
def sides(server):
    """``sides(**kw)`` makes a real scheduler side (``validation.sched_harness``) on the module's
    server, with a block of the server's minimum chunk unless ``block`` is given; all are
    shut down after the test."""
    from validation.sched_harness import scheduler_side

    made = []

    def make(**kw):
        s = scheduler_side(server.url, **{"block": SERVER_CHUNK, **kw})
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()
