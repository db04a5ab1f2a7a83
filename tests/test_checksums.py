"""Object integrity: every object carries a checksum written by its storer and checked by
its loader, against a real glm-cache-server process.

Bit rot cannot be caused on demand, so the server's debug fault hook (``--debug-fault-hooks``,
a testing flag) flips a byte of a stored object while keeping its checksum."""

from __future__ import annotations

import urllib.request

import pytest

from cache_server import protocol as p
from testing.server_process import ServerProcess
from cache_server.client import CacheClient, CacheServerError

NS = "checksum-test"
KEY = (b"\x07" * 32, 1, 0)


def _metric(server: ServerProcess, line_start: str) -> float:
    text = urllib.request.urlopen(server.http_url + "/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(line_start)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_checksum_is_xxh3_128_of_the_payload_bytes():
    import os

    import numpy as np
    import xxhash

    assert p.checksum(b"abc") == xxhash.xxh3_128_digest(b"abc") and len(p.checksum(b"abc")) == p.CHECKSUM_BYTES
    assert p.checksum(memoryview(b"abc")) == p.checksum(b"abc")
    assert p.checksum(b"abd") != p.checksum(b"abc")
    big = os.urandom((40 << 20) + 12345)
    assert p.checksum(memoryview(big)[1:]) == xxhash.xxh3_128_digest(big[1:])
    values = np.arange(1000, dtype=np.float32)  # a typed buffer hashes as its bytes
    assert p.checksum(values) == p.checksum(values.tobytes())


def test_a_flipped_byte_is_caught_deleted_and_counted(server):
    client = CacheClient(server.url, timeout_s=5)
    payload = bytes(range(256)) * 64
    assert client.put(NS, [(*KEY, payload)]) == ["stored"]
    assert bytes(client.get(NS, [KEY])[0]) == payload  # intact: served
    reply, _ = client.request({"op": "debug_corrupt", "ns": NS, "keys": [list(KEY)], "offset": 1000})
    assert reply["corrupted"] is True
    before = _metric(server, 'glm_cache_deleted_objects_total{reason="checksum"}')
    assert client.get(NS, [KEY]) == [None]  # corrupt: never handed out
    assert client.corrupt_objects == 1
    assert _metric(server, 'glm_cache_deleted_objects_total{reason="checksum"}') == before + 1
    # deleted on the server: a plain get finds nothing, a lookup cannot hit it
    reply, frames = client.request({"op": "get", "ns": NS, "keys": [list(KEY)]})
    assert reply["found"] == [False] and not frames
    client.close()


def test_the_stored_checksum_comes_back_unchanged_with_the_object(server):
    client = CacheClient(server.url, timeout_s=5)
    key = (b"\x08" * 32, 0, 3)
    assert client.put(NS, [(*key, b"payload")]) == ["stored"]
    reply, frames = client.request({"op": "get", "ns": NS, "keys": [list(key)]})
    assert reply["sums"] == [p.checksum(b"payload")] and bytes(frames[0]) == b"payload"
    client.close()


def test_debug_hook_is_off_unless_the_server_enables_it():
    with ServerProcess("--separate-object-groups") as srv:
        client = CacheClient(srv.url, timeout_s=5)
        with pytest.raises(CacheServerError) as e:
            client.request({"op": "debug_corrupt", "ns": NS, "keys": [list(KEY)]})
        assert e.value.code == "unknown_op"
        client.close()


def test_debug_die_on_get_kills_the_server_mid_request():
    """The crash hook reliability tests use: the armed op never gets an answer."""
    from cache_server.client import CacheServerUnavailable

    with ServerProcess("--separate-object-groups", "--debug-fault-hooks") as srv:
        client = CacheClient(srv.url, timeout_s=2)
        assert client.put(NS, [(*KEY, b"x")]) == ["stored"]
        assert client.request({"op": "debug_die_on", "on": "get"})[0]["armed"] == "get"
        with pytest.raises(CacheServerUnavailable):
            client.get(NS, [KEY])
        assert srv.proc.wait(timeout=10) == -9
        client.close()
