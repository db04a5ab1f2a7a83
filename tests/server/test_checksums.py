"""Object integrity: every object carries a checksum written by its storer and checked by
its loader, against a real glm-cache-server process.

Bit rot cannot be caused on demand, so the server's debug fault hook (``--debug-fault-hooks``,
a testing flag) flips a byte of a stored object while keeping its checksum."""

from __future__ import annotations

import urllib.request

import pytest

from cache_server import protocol as p
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from testing.server_process import ServerProcess

NS = "checksum-test"
KEY = (b"\x07" * 32, 1, 0)


def _metric(server: ServerProcess, line_start: str) -> float:
    text = urllib.request.urlopen(server.http_url + "/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(line_start)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_checksum_is_xxh3_128_of_the_key_then_the_payload():
    import os
    import struct

    import numpy as np
    import xxhash

    key = (b"\x05" * 32, 2, 7)
    prefix = b"glmsum4\0" + struct.pack("<I", 2) + b"ns" + struct.pack("<I", 32) + key[0] + struct.pack("<QQ", 2, 7)
    assert p.key_prefix("ns", key) == prefix
    assert p.checksum(b"abc", "ns", key) == xxhash.xxh3_128_digest(prefix + b"abc")
    assert len(p.checksum(b"abc", "ns", key)) == p.CHECKSUM_BYTES
    assert p.checksum(memoryview(b"abc"), "ns", key) == p.checksum(b"abc", "ns", key)
    assert p.checksum(b"abd", "ns", key) != p.checksum(b"abc", "ns", key)
    big = os.urandom((40 << 20) + 12345)
    assert p.checksum(memoryview(big)[1:], "ns", key) == xxhash.xxh3_128_digest(prefix + big[1:])
    values = np.arange(1000, dtype=np.float32)  # a typed buffer hashes as its bytes
    assert p.checksum(values, "ns", key) == p.checksum(values.tobytes(), "ns", key)
    # Every part of the key changes the sum, and no two keys encode alike.
    others = [("nt", key), ("ns", (b"\x06" * 32, 2, 7)), ("ns", (key[0], 3, 7)), ("ns", (key[0], 2, 8)),
              ("ns" + "\0" * 4, key), ("n", key), ("ns", (key[0], 7, 2))]
    sums = {p.checksum(b"abc", ns, k) for ns, k in [("ns", key), *others]}
    assert len(sums) == 1 + len(others)


def _put_with_sum_of(client: CacheClient, ns: str, key: tuple, payload: bytes, sum_ns: str, sum_key: tuple) -> None:
    """Store ``payload`` under ``key`` with the checksum of ``sum_key``: an object's bytes
    under a key they were not stored for."""
    reply, _ = client.request({"op": "put", "ns": ns, "keys": [list(key)],
                               "sums": [p.checksum(payload, sum_ns, sum_key)]}, [payload])
    assert reply["results"] == ["stored"]


@pytest.mark.parametrize("differs", ["namespace", "chunk", "group", "rank"])
def test_an_object_under_another_key_is_refused_deleted_and_counted(server, differs):
    """Intact bytes of the right size whose checksum is another key's (a save under another
    grid's key, a copy between keys) are refused at load like flipped ones: answered
    absent, deleted on the server, counted on both sides."""
    client = CacheClient(server.url, timeout_s=5)
    key = (bytes([0x30 + ["namespace", "chunk", "group", "rank"].index(differs)]) * 32, 1, 0)
    payload = bytes(range(256)) * 64
    other_ns = NS + "-other" if differs == "namespace" else NS
    other = {"namespace": key, "chunk": (b"\x99" * 32, 1, 0), "group": (key[0], 0, 0),
             "rank": (key[0], 1, 1)}[differs]
    _put_with_sum_of(client, NS, key, payload, other_ns, other)
    before = _metric(server, 'glm_cache_deleted_objects_total{reason="checksum"}')
    assert client.get(NS, [key]) == [None]
    assert client.corrupt_objects == 1
    assert _metric(server, 'glm_cache_deleted_objects_total{reason="checksum"}') == before + 1
    reply, frames = client.request({"op": "get", "ns": NS, "keys": [list(key)]})
    assert reply["found"] == [False] and not frames
    # Stored with its own key's sum, the same bytes load.
    _put_with_sum_of(client, NS, key, payload, NS, key)
    assert bytes(client.get(NS, [key])[0]) == payload and client.corrupt_objects == 1
    client.close()


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
    assert reply["sums"] == [p.checksum(b"payload", NS, key)] and bytes(frames[0]) == b"payload"
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
    from cache_server.client.errors import CacheServerUnavailable

    with ServerProcess("--separate-object-groups", "--debug-fault-hooks") as srv:
        client = CacheClient(srv.url, timeout_s=2)
        assert client.put(NS, [(*KEY, b"x")]) == ["stored"]
        assert client.request({"op": "debug_die_on", "on": "get"})[0]["armed"] == "get"
        with pytest.raises(CacheServerUnavailable):
            client.get(NS, [KEY])
        assert srv.proc.wait(timeout=10) == -9
        client.close()
