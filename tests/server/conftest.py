"""tests/server: tests that start real processes but never a vLLM engine: glm-cache-server
(the shared ``server`` fixture, or ``testing.ServerProcess``), Redis, Prometheus, LMCache's CLI,
other subprocesses; and the full-size GLM-5.3-Flash KV layouts, which start nothing but take
minutes. Minutes in all (docs/testing.md, "Folders by cost").

Fixtures every folder uses are in tests/conftest.py; here, what only these modules use."""

from __future__ import annotations

import pytest


@pytest.fixture
def client(server):
    """A client of the module's server, the server emptied first; a module that needs its
    namespaces said hello to overrides this with a ``client(client)`` fixture."""
    from cache_server.client import CacheClient

    with CacheClient(server.url, timeout_s=10.0) as c:
        c.clear()
        yield c
