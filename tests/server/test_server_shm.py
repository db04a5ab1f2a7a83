"""Same-host shared memory between CacheClient and a real glm-cache-server process:
negotiation at hello, byte-exact round trips, fallback to TCP, checksums, nothing left
behind (no descriptor, nothing in /dev/shm, no mapping on the server), concurrency,
growth, timeouts and a restarted server. A hostile client's segments:
test_server_shm_hostile.py."""

from __future__ import annotations

import glob
import os
import threading

import numpy as np
import pytest

from cache_server import protocol as p
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.shm import DATA_OFFSET
from testing.server_process import ServerProcess, free_port

NS = "shm-test"


def _key(i: int, tag: int = 0) -> tuple[bytes, int, int]:
    return (bytes([tag]) * 16 + i.to_bytes(16, "big"), 0, 0)


def _mine() -> list[str]:
    """What this test process's segments left behind: files in /dev/shm (the segments are
    memfds, never files there) and descriptors still open (a client closes its segment's
    once the server answered the offer; the mappings hold the memory)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:glmcache-"):
                fds.append(f"fd {fd}")
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return glob.glob(f"/dev/shm/glmcache-{os.getpid()}-*") + fds


def _through_shm(view: memoryview) -> bool:
    """A payload served from a segment is a view of the client's mapping (numpy-backed);
    one that came as a ZMQ frame is backed by the frame."""
    return isinstance(view.obj, np.ndarray)


@pytest.fixture(scope="module")
def shm_server():
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "1", "--debug-fault-hooks") as srv:
        yield srv


@pytest.fixture(scope="module")
def no_shm_server():
    with ServerProcess("--l1-size-gb", "0.25", "--no-shm") as srv:
        yield srv


def test_shm_is_negotiated_and_payloads_round_trip_byte_exact(shm_server):
    payloads = [b"\0", b"x", os.urandom(4097), os.urandom(3 << 20), np.arange(1000, dtype=np.float32)]  # (empty objects are refused)
    keys = [_key(i, 1) for i in range(len(payloads))]
    with CacheClient(shm_server.url, timeout_s=10) as client:
        before = client.stats()["shm"]
        client.hello(NS, 16)
        assert client.transport == "shm" and client.shm_refusal is None
        assert _mine() == []  # unlinked once the server mapped it
        assert client.put(NS, [(*k, v) for k, v in zip(keys, payloads)]) == ["stored"] * len(keys)
        got = client.get(NS, [*keys, _key(99, 1)])
        assert got[-1] is None
        for view, want in zip(got, payloads):
            assert view is not None and _through_shm(view)
            assert bytes(view) == bytes(memoryview(want).cast("B"))
        after = client.stats()["shm"]
        total = sum(memoryview(v).nbytes for v in payloads)
        # the bytes went through the segments both ways, not as frames
        assert after["put_bytes"] - before["put_bytes"] == total
        assert after["get_bytes"] - before["get_bytes"] == total
        assert after["segments"] >= 1


def test_views_of_a_get_stay_intact_while_the_client_keeps_working(shm_server):
    with CacheClient(shm_server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        a, b = os.urandom(2 << 20), os.urandom(2 << 20)
        client.put(NS, [(*_key(1, 2), a), (*_key(2, 2), b)])
        held = client.get(NS, [_key(1, 2)])[0]
        for _ in range(3):  # later gets and puts must not write where ``held`` lies
            assert bytes(client.get(NS, [_key(2, 2)])[0]) == b
            client.put(NS, [(*_key(3, 2), os.urandom(2 << 20))])
        assert _through_shm(held) and bytes(held) == a


def test_tcp_fallback_when_the_server_disables_shm(no_shm_server):
    with CacheClient(no_shm_server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        assert client.transport == "tcp"
        assert "--no-shm" in client.shm_refusal
        assert _mine() == []
        payload = os.urandom(1 << 20)
        assert client.put(NS, [(*_key(1, 3), payload)]) == ["stored"]
        got = client.get(NS, [_key(1, 3)])[0]
        assert bytes(got) == payload and not _through_shm(got)
        shm = client.stats()["shm"]
        del shm["limits"]
        assert shm == {"enabled": False, "segments": 0, "mapped_bytes": 0, "clients": 0, "attached_total": 0,
                       "refused_total": 1, "get_bytes": 0, "put_bytes": 0}


def test_tcp_fallback_when_the_client_opts_out(shm_server):
    with CacheClient(shm_server.url, timeout_s=10, shm=False) as client:
        before = client.stats()["shm"]
        client.hello(NS, 16)
        assert client.transport == "tcp" and client.shm_refusal == "off in this client"
        payload = os.urandom(1 << 20)
        assert client.put(NS, [(*_key(1, 4), payload)]) == ["stored"]
        got = client.get(NS, [_key(1, 4)])[0]
        assert bytes(got) == payload and not _through_shm(got)
        after = client.stats()["shm"]
        assert after["attached_total"] == before["attached_total"]
        assert (after["get_bytes"], after["put_bytes"]) == (before["get_bytes"], before["put_bytes"])


def test_a_corrupt_payload_served_through_shm_is_caught_by_its_checksum(shm_server):
    key = _key(1, 5)
    with CacheClient(shm_server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        payload = os.urandom(1 << 20)
        client.put(NS, [(*key, payload)])
        reply, _ = client.request({"op": "debug_corrupt", "ns": NS, "keys": [list(key)], "offset": 12345})
        assert reply["corrupted"] is True
        before = client.stats()["shm"]["get_bytes"]
        assert client.get(NS, [key]) == [None]  # the flipped byte came through shm and was refused
        assert client.stats()["shm"]["get_bytes"] == before + len(payload)
        assert client.corrupt_objects == 1
        assert client.get(NS, [key]) == [None]  # and deleted on the server


def test_another_keys_object_served_through_shm_is_refused_in_place(shm_server):
    """Verified in the segment, where the bytes land: an object whose checksum is another
    key's is refused and deleted, though every byte is intact."""
    key, other = _key(1, 6), _key(2, 6)
    with CacheClient(shm_server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        assert client.transport == "shm"
        payload = os.urandom(1 << 20)
        reply, _ = client.request({"op": "put", "ns": NS, "keys": [list(key)],
                                   "sums": [p.checksum(payload, NS, other)]}, [payload])
        assert reply["results"] == ["stored"]
        before = client.stats()["shm"]["get_bytes"]
        assert client.get(NS, [key]) == [None]
        assert client.stats()["shm"]["get_bytes"] == before + len(payload)  # it did come through shm
        assert client.corrupt_objects == 1
        reply, _ = client.request({"op": "get", "ns": NS, "keys": [list(key)]})
        assert reply["found"] == [False]


def test_no_segment_is_left_in_dev_shm_or_mapped_after_close(shm_server):
    with CacheClient(shm_server.url, timeout_s=10) as probe:
        base = probe.stats()["shm"]["segments"]
    clients = [CacheClient(shm_server.url, timeout_s=10, shm_bytes=2 << 20) for _ in range(3)]
    for c in clients:
        c.hello(NS, 16)
        c.put(NS, [(*_key(1, 6), os.urandom(3 << 20))])  # larger than the first segment: a second one
        assert c.get(NS, [_key(1, 6)])[0] is not None
    with CacheClient(shm_server.url, timeout_s=10) as probe:
        assert probe.stats()["shm"]["segments"] >= base + 6
        assert _mine() == []
        for c in clients:
            c.close()
        assert probe.stats()["shm"]["segments"] == base  # each close detached its segments
    assert _mine() == []


def test_several_clients_and_threads_at_once_get_their_own_bytes(shm_server):
    shared = CacheClient(shm_server.url, timeout_s=30)
    shared.hello(NS, 16)
    errors: list[str] = []

    def work(client: CacheClient, tag: int) -> None:
        try:
            own = client is not shared
            if own:
                client.hello(NS, 16)
            rng = np.random.default_rng(tag)
            for i in range(6):
                payloads = [rng.bytes(int(rng.integers(1, 3 << 20))) for _ in range(3)]
                keys = [_key(i * 3 + j, 100 + tag) for j in range(3)]
                client.put(NS, [(*k, v) for k, v in zip(keys, payloads)])
                got = client.get(NS, keys)
                if [bytes(g) if g is not None else None for g in got] != payloads:
                    errors.append(f"client {tag} round {i}: wrong bytes")
            if own:
                client.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"client {tag}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(CacheClient(shm_server.url, timeout_s=30), t)) for t in range(6)]
    threads += [threading.Thread(target=work, args=(shared, 6 + t)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert shared.transport == "shm"
    shared.close()
    assert _mine() == []


def test_a_get_larger_than_the_segment_overflows_to_frames_then_the_segment_grows(shm_server):
    payloads = [os.urandom(1 << 20) for _ in range(3)]
    keys = [_key(i, 7) for i in range(3)]
    with CacheClient(shm_server.url, timeout_s=10, shm_bytes=DATA_OFFSET + (3 << 19)) as client:  # 1.5 MiB of room
        client.hello(NS, 16)
        client.put(NS, [(*k, v) for k, v in zip(keys, payloads)])
        got = client.get(NS, keys)
        assert [bytes(g) for g in got] == payloads
        assert [_through_shm(g) for g in got] == [True, False, False]  # what did not fit came as frames
        del got
        got = client.get(NS, keys)
        assert [bytes(g) for g in got] == payloads
        assert all(_through_shm(g) for g in got)  # a segment for all of them was attached


def test_bad_shared_memory_requests_get_clear_answers(shm_server):
    with CacheClient(shm_server.url, timeout_s=10) as client:
        reply, _ = client.request({"op": "shm_attach", "shm": {"boot": "x", "path": "/etc/passwd", "size": 8192,
                                                                "nonce": b"0" * 16}})
        assert reply["shm"]["seg"] is None and "boot ids differ" in reply["shm"]["reason"]
        with pytest.raises(CacheServerError) as e:
            client.request({"op": "get", "ns": NS, "keys": [list(_key(1))], "shm": {"seg": 12345, "off": DATA_OFFSET,
                                                                                  "len": 10}})
        assert e.value.code == "shm_unknown"
        client.hello(NS, 16)
        seg = client._segments[0]
        with pytest.raises(CacheServerError) as e:
            client.request({"op": "put", "ns": NS, "keys": [list(_key(1))], "sums": [b"0" * 16],
                            "shm": {"seg": seg.seg_id, "at": np.asarray([seg.size - 10, 20], dtype="<u8").tobytes()}})
        assert e.value.code == "bad_request" and "within the segment" in e.value.message
        assert client.get(NS, [_key(1)]) == [None]  # nothing was stored


def test_per_call_timeout_and_recovery_after_it(shm_server):
    """``timeout_s`` on get/put overrides the client's; after a timeout the client drops its
    segments (the server may still write into them) and attaches new ones."""
    with CacheClient(shm_server.url, timeout_s=60) as client:
        client.hello(NS, 16)
        payload = os.urandom(1 << 20)
        client.put(NS, [(*_key(1, 8), payload)])
        shm_server.pause()
        try:
            # the call's 0.5 s, not the client's 60 s, ended each (the server is paused: SIGSTOP)
            with pytest.raises(CacheServerUnavailable, match=r"within 0\.5s"):
                client.get(NS, [_key(1, 8)], timeout_s=0.5)
            with pytest.raises(CacheServerUnavailable, match=r"within 0\.5s"):
                client.put(NS, [(*_key(2, 8), payload)], timeout_s=0.5)
            assert client._segments == []
        finally:
            shm_server.resume()
        got = client.get(NS, [_key(1, 8)])[0]
        assert bytes(got) == payload and _through_shm(got)
        assert client.transport == "shm"


def test_a_restarted_server_does_not_know_old_segments_and_the_client_reattaches():
    port = free_port()
    payload = os.urandom(1 << 20)
    with CacheClient(f"tcp://127.0.0.1:{port}", timeout_s=10) as client:
        with ServerProcess("--l1-size-gb", "0.25", port=port):
            client.hello(NS, 16)
            old = client._segments[0].seg_id
            client.put(NS, [(*_key(1, 9), payload)])
        with ServerProcess("--l1-size-gb", "0.25", port=port):
            assert client.put(NS, [(*_key(1, 9), payload)]) == ["stored"]  # shm_unknown, new segment, repeated
            got = client.get(NS, [_key(1, 9)])[0]
            assert bytes(got) == payload and _through_shm(got)
            assert [s.seg_id for s in client._segments] != [old]
    assert _mine() == []


def test_a_client_that_never_says_hello_offers_shm_at_its_first_transfer(shm_server):
    """The connector's worker-side clients only get and put: they still use shared memory."""
    payload = os.urandom(1 << 20)
    with CacheClient(shm_server.url, timeout_s=10) as client:
        before = client.stats()["shm"]
        assert client.transport == "tcp"
        assert client.put(NS, [(*_key(1, 10), payload)]) == ["stored"]
        assert client.transport == "shm"
        got = client.get(NS, [_key(1, 10)])[0]
        assert bytes(got) == payload and _through_shm(got)
        after = client.stats()["shm"]
        assert after["put_bytes"] - before["put_bytes"] == len(payload)
        assert after["attached_total"] == before["attached_total"] + 1
    with CacheClient(shm_server.url, timeout_s=10, shm=False) as client:
        client.put(NS, [(*_key(2, 10), payload)])
        assert client.transport == "tcp"


def test_a_put_of_many_small_objects_through_shm_is_answered(shm_server):
    """A save batch of many small objects (a TP 4 chunk of tiny pages, or a bench filling
    a namespace) must fit the header bound: the offsets travel packed in one bin (one
    [offset, length] array per key would cross the bound at about 100 keys)."""
    keys = [_key(i, 0xA7) for i in range(2048)]
    payloads = [os.urandom(64) for _ in keys]
    with CacheClient(shm_server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        assert client.transport == "shm"
        assert client.put(NS, [(*k, v) for k, v in zip(keys, payloads)]) == ["stored"] * len(keys)
        got = client.get(NS, keys)
        assert all(g is not None and bytes(g) == v for g, v in zip(got, payloads))
