"""One deadline per request, end to end (issue 46): the client says when it sent a request
and how long it waits (``sent``, ``budget``); the server counts and logs an answer that comes
after that, skips work nobody waits for, and releases a lease a late lookup took; the client
counts every request as answered in time, late, or never, and keeps all the waits of one call
within one deadline. Lateness is made deterministic: a server paused with SIGSTOP, a request
sent with its deadline already past, or a handler that returns only once the deadline passed.
"""

from __future__ import annotations

import re
import time
import urllib.request

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_server import protocol as p
from cache_server.client import CacheClient, CacheServerUnavailable
from cache_server.config import ServerConfig
from cache_server.server import CacheServer

NS = "deadlines-ns"
H = [bytes([i]) * p.HASH_BYTES for i in range(1, 4)]


@pytest.fixture
def inproc():
    server = CacheServer(ServerConfig(port=0, http_port=0, l1_size_bytes=1 << 20, max_object_bytes=1 << 12,
                                      separate_object_groups=True))
    yield server
    server.stop()
    server.serve_forever()


def _ask(server: CacheServer, header: dict, payloads=(), client: bytes = b"peer-1") -> dict:
    return msgpack.unpackb(server.handle([msgpack.packb(header), *payloads], client)[0])


def _late(server: CacheServer, op: str, outcome: str) -> float:
    return server.metrics.registry.get_sample_value("glm_cache_late_requests_total", {"op": op, "outcome": outcome}) or 0


def _put_chunk(server: CacheServer) -> None:
    keys = [[H[0], 0, 0], [H[0], 1, 0]]
    sums = [p.checksum(b"x" * 8, NS, tuple(k)) for k in keys]
    reply = _ask(server, {"op": "put", "id": 1, "ns": NS, "keys": keys, "sums": sums}, [b"x" * 8, b"x" * 8])
    assert reply["ok"] and reply["results"] == ["stored", "stored"], reply


def _lookup(**extra) -> dict:
    return {"op": "lookup", "ns": NS, "hashes": H[:1], "attn_groups": [0], "state_groups": [1],
            "world_size": 1, "lease": True, **extra}


def test_a_request_whose_client_gave_up_is_skipped_and_counted(inproc, caplog):
    """A lookup whose deadline passed before a worker took it is not done (no lease is
    taken), answered ``expired``, counted ``dropped`` and logged with its queue time."""
    _put_chunk(inproc)
    with caplog.at_level("WARNING", logger="glm_cache_server"):
        reply = _ask(inproc, _lookup(id=9, sent=time.time() - 5.0, budget=2.0))
    assert reply["ok"] is False and reply["code"] == p.ErrorCode.EXPIRED.value and reply["id"] == 9
    assert _late(inproc, "lookup", "dropped") == 1
    assert inproc.store.snapshot()["active_leases"] == 0
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert line.startswith("'lookup' (request 9) dropped") and "queued 5." in line
    # The same lookup in time is done, and leases its chunk.
    reply = _ask(inproc, _lookup(id=10, sent=time.time(), budget=30.0))
    assert reply["ok"] and reply["chunks"] == 1 and reply["lease_id"]
    assert _late(inproc, "lookup", "dropped") == 1 and _late(inproc, "lookup", "answered") == 0


def test_a_release_is_done_even_after_its_deadline(inproc):
    """Cleanup ops are not skipped: a late release still frees its lease, and is counted
    answered late, not dropped."""
    _put_chunk(inproc)
    lease = _ask(inproc, _lookup(id=1, sent=time.time(), budget=30.0))["lease_id"]
    reply = _ask(inproc, {"op": "release", "id": 2, "lease_id": lease, "sent": time.time() - 10, "budget": 1.0})
    assert reply["ok"] and reply["released"] is True
    assert inproc.store.snapshot()["active_leases"] == 0
    assert _late(inproc, "release", "answered") == 1 and _late(inproc, "release", "dropped") == 0


def test_a_lookup_answered_after_its_deadline_releases_its_lease(inproc, monkeypatch, caplog):
    """A lookup a worker took in time but answered after the deadline is counted
    ``answered`` late, logged with queue and handling time, and its lease is released (its
    client has given up: nothing else would release it before the TTL)."""
    _put_chunk(inproc)
    real = inproc._handlers["lookup"]
    budget = 0.3

    def slow_lookup(h, frames):
        out = real(h, frames)
        while time.time() <= h["sent"] + budget + 0.01:  # until the client's deadline has passed
            time.sleep(0.01)
        return out

    monkeypatch.setitem(inproc._handlers, "lookup", slow_lookup)
    with caplog.at_level("WARNING", logger="glm_cache_server"):
        reply = _ask(inproc, _lookup(id=4, sent=time.time(), budget=budget))
    assert reply["ok"] and reply["chunks"] == 1 and reply["lease_id"]
    assert inproc.store.snapshot()["active_leases"] == 0
    assert _late(inproc, "lookup", "answered") == 1 and _late(inproc, "lookup", "dropped") == 0
    (line,) = [r.getMessage() for r in caplog.records if "after its client's" in r.getMessage()]
    assert "'lookup' (request 4)" in line and "handled" in line and "its lease released" in line


@pytest.mark.parametrize("fields", [{"sent": time.time()}, {"budget": 2.0}, {"sent": "now", "budget": 2.0},
                                    {"sent": time.time(), "budget": -1.0}, {"sent": time.time(), "budget": 1e9},
                                    {"sent": float("inf"), "budget": 2.0}, {"sent": True, "budget": 2.0}])
def test_malformed_deadline_fields_are_refused(inproc, fields):
    reply = _ask(inproc, {"op": "ping", "id": 3, **fields})
    assert reply["ok"] is False and reply["code"] == p.ErrorCode.BAD_REQUEST.value


def test_a_client_clock_far_ahead_gets_no_deadline(inproc):
    """A ``sent`` in this server's future (clocks not in sync) is no reason to skip the
    work: no deadline is applied, and the skew is counted."""
    reply = _ask(inproc, {"op": "ping", "id": 3, "sent": time.time() + 600, "budget": 1.0})
    assert reply["ok"] is True
    assert inproc.metrics.registry.get_sample_value("glm_cache_clock_skewed_requests_total") == 1


def _server_late(srv, op: str, outcome: str) -> float:
    text = urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=60).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "glm_cache_late_requests_total" and sample.labels == {"op": op, "outcome": outcome}:
                return sample.value
    return 0.0


def test_a_paused_server_makes_a_late_answer_not_a_lost_one(server):
    """A request sent to a paused server (SIGSTOP) times out at its deadline; after SIGCONT
    the server skips it (its client gave up), the client takes that late answer on its
    kept connection and counts it ``late``, not ``unanswered``, and the next request is
    answered in time. The server counts it ``dropped``."""
    with CacheClient(server.url, timeout_s=30.0, shm=False) as c:
        c.ping()
        dropped = _server_late(server, "ping", "dropped")
        server.pause()  # returns once every thread stopped: a raw SIGSTOP can let one more answer out
        try:
            with pytest.raises(CacheServerUnavailable, match="did not answer 'ping'"):
                c.ping(timeout_s=0.5)
        finally:
            server.resume()
        # The late answer is taken by a later call (the server's workers may answer a newer
        # ping first: then the one after takes it).
        deadline = time.monotonic() + 60
        while c.counts("ping")["late"] == 0:
            assert time.monotonic() < deadline, c.counts("ping")
            c.ping()
        counts = c.counts("ping")
        assert counts["late"] == 1 and counts["unanswered"] == 0 and counts["in_time"] == counts["sent"] - 1, counts
        assert _server_late(server, "ping", "dropped") == dropped + 1


def test_a_closed_connection_counts_its_pending_requests_unanswered(server):
    with CacheClient(server.url, timeout_s=30.0, shm=False) as c:
        c.ping()
        server.pause()  # returns once every thread stopped: a raw SIGSTOP can let one more answer out
        try:
            with pytest.raises(CacheServerUnavailable):
                c.ping(timeout_s=0.5)
            c.close()  # its answer can never arrive now
        finally:
            server.resume()
        assert c.counts("ping") == {"sent": 2, "in_time": 1, "late": 0, "unanswered": 1}


def test_a_late_reply_read_after_the_horizon_counts_late_not_unanswered(server, monkeypatch):
    """A late reply that reached the client's socket is an answer, however long nobody read
    it: the next request takes it before counting what is still pending past the horizon
    (the soak at f1f6f95: a lookup's reply came 31 s after it gave up, the engine's next
    lookup came 120 s after, a CPU having stood still, and counted it lost)."""
    import zmq

    from cache_server.client import connection

    with CacheClient(server.url, timeout_s=30.0, shm=False) as c:
        c.ping()
        server.pause()
        try:
            with pytest.raises(CacheServerUnavailable):
                c.ping(timeout_s=0.5)
        finally:
            server.resume()
        deadline = time.monotonic() + 120
        while not c._sock.poll(100, zmq.POLLIN):  # the late reply is in the socket, unread
            assert time.monotonic() < deadline, "the resumed server never answered the late ping"
        monkeypatch.setattr(connection, "PENDING_HORIZON_S", 0.0)  # as if read long after the horizon
        c.ping()
        assert c.counts("ping") == {"sent": 3, "in_time": 2, "late": 1, "unanswered": 0}


def test_a_request_pending_on_a_dropped_connection_counts_unanswered():
    """A request that timed out on a paused server that then dies can never be answered:
    once the connection drops it counts as unanswered, without waiting for the horizon."""
    from testing.server_process import ServerProcess

    with ServerProcess("--separate-object-groups") as srv, CacheClient(srv.url, timeout_s=30.0, shm=False) as c:
        c.ping()
        srv.pause()
        with pytest.raises(CacheServerUnavailable):
            c.ping(timeout_s=0.5)
        srv.kill()
        deadline = time.monotonic() + 60
        while c.counts("ping")["unanswered"] == 0:
            assert time.monotonic() < deadline, c.counts("ping")
            time.sleep(0.05)
        assert c.counts("ping") == {"sent": 2, "in_time": 1, "late": 0, "unanswered": 1}


def test_a_server_that_dies_ends_the_requests_it_had_and_the_next_ones_wait_only_to_reconnect():
    """ZeroMQ does not resend what was in flight on a connection that dropped: a request
    waiting on a server that dies ends when the connection drops (counted unanswered), not
    at its 60 s deadline, and the next request waits for a connection only
    ``RECONNECT_WAIT_S``, not its deadline. A server started again on the port is used."""
    import threading

    from cache_server.client.connection import RECONNECT_WAIT_S
    from testing.server_process import ServerProcess

    srv = ServerProcess("--separate-object-groups").start()
    try:
        with CacheClient(srv.url, timeout_s=60.0, shm=False) as c:
            c.ping()
            srv.pause()  # the ping below is in flight, unanswered, when the server dies
            raised: list[BaseException] = []

            def ping() -> None:
                try:
                    c.ping()
                except BaseException as e:  # noqa: BLE001 - asserted below
                    raised.append(e)

            t = threading.Thread(target=ping)
            t.start()
            deadline = time.monotonic() + 60
            while c.counts("ping")["sent"] < 2:
                assert time.monotonic() < deadline, c.counts("ping")
                time.sleep(0.01)
            srv.kill()
            t.join(120)
            assert not t.is_alive()
            (error,) = raised
            assert isinstance(error, CacheServerUnavailable)
            assert re.search(r"did not answer 'ping' \(request 2\) within 60\.0s \(the connection dropped "
                             r"[0-9.]+s after it was sent\)", str(error)), error
            assert c.counts("ping") == {"sent": 2, "in_time": 1, "late": 0, "unanswered": 1}
            with pytest.raises(CacheServerUnavailable, match=rf"no connection within {RECONNECT_WAIT_S:.1f}s since "
                                                             "the last one dropped"):
                c.ping()
            srv = ServerProcess("--separate-object-groups", port=srv.port, http_port=srv.http_port).start()
            deadline = time.monotonic() + 120
            while True:  # ZeroMQ connects again on its own (every 100 ms)
                try:
                    c.ping()
                    break
                except CacheServerUnavailable:
                    assert time.monotonic() < deadline, "the server started again was never reached"
    finally:
        srv.stop()


def test_every_request_of_one_call_shares_its_deadline(server, monkeypatch):
    """A put bigger than the client's segment is two requests (a new segment's attach, then
    the put): both are sent with the call's one deadline (``sent + budget``, the same wall
    time), not each with a fresh timeout. The attach is held 50 ms after it is packed, so a
    fresh timeout would put the put's deadline 50 ms later."""
    sent: list[dict] = []
    pack = p.pack_header

    def spy(h):
        sent.append(dict(h))
        if h.get("op") == "shm_attach":
            time.sleep(0.5)
        return pack(h)

    with CacheClient(server.url, timeout_s=30.0, shm_bytes=1 << 20) as c:
        c.hello(NS, 16, attn_groups=[0], state_groups=[1])
        monkeypatch.setattr(p, "pack_header", spy)
        c.put(NS, [(H[2], 0, 0, b"y" * (2 << 20))], timeout_s=20.0)  # over the 1 MiB segment: a new one
        monkeypatch.setattr(p, "pack_header", pack)
        assert c.transport == "shm"
    ops = [h["op"] for h in sent]
    assert ops == ["shm_attach", "put"], ops
    attach, put = sent
    assert put["sent"] - attach["sent"] >= 0.5
    assert abs((put["sent"] + put["budget"]) - (attach["sent"] + attach["budget"])) < 0.25
    assert attach["budget"] <= 20.0


def test_a_worker_stuck_on_one_request_is_reported_with_its_stack(monkeypatch, caplog):
    """A worker busy with one request past STUCK_S is logged once with its stack and
    counted (the requests the proxy deals it meanwhile wait behind it: to its clients they
    look lost, and nothing was slow to handle yet)."""
    import threading

    from cache_server import workers

    monkeypatch.setattr(workers, "STUCK_S", 0.2)
    server = CacheServer(ServerConfig(port=0, http_port=0, l1_size_bytes=1 << 20, max_object_bytes=1 << 12,
                                      workers=1))
    release = threading.Event()
    real = server._handlers["stats"]

    def stuck_stats(h, frames):
        release.wait(60)
        return real(h, frames)

    monkeypatch.setitem(server._handlers, "stats", stuck_stats)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    with caplog.at_level("WARNING", logger="glm_cache_server"):
        loop.start()
        try:
            with CacheClient(f"tcp://127.0.0.1:{server.port}", timeout_s=60.0, shm=False) as c:
                asked = threading.Thread(target=c.stats, daemon=True)
                asked.start()
                deadline = time.monotonic() + 60
                while not server.metrics.registry.get_sample_value("glm_cache_stuck_requests_total"):
                    assert time.monotonic() < deadline, "the stuck worker was never reported"
                    time.sleep(0.05)
                release.set()
                asked.join(60)
        finally:
            release.set()
            server.stop()
            loop.join(30)
    assert server.metrics.registry.get_sample_value("glm_cache_stuck_requests_total") == 1
    (line,) = [r.getMessage() for r in caplog.records if "busy with one request" in r.getMessage()]
    assert "stuck_stats" in line and "release.wait" in line
