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
