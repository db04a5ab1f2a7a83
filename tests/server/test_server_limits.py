"""Limits of glm-cache-server: message and header size, leases per
client and in bytes, namespaces. Against real server processes where a server is involved."""

import subprocess
import sys
import tracemalloc
import urllib.request

import msgpack
import pytest
import zmq

from cache_server import protocol as p
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from testing.server_process import ServerProcess

NS = "limits-ns"
KIB, MIB = 1 << 10, 1 << 20
MAX_OBJECT = 100 * KIB
MAX_MESSAGE = 512 * KIB
MAX_HEADER = 16 * KIB


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


SERVER_ARGS = ("--l1-size-gb", "0.01", "--max-object-size-mb", "0.09765625", "--max-message-mb", "0.5", "--max-header-kb", "16",
               "--max-leases-per-client", "3")  # the server fixture's (conftest.py)


def raw_dealer(server, timeout_ms: int = 5000) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(server.url)
    return sock


def metrics(server) -> str:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


# --- header parsing, in process ----------------------------------------------------------


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / MIB


def _refused(frame: bytes, code: p.ErrorCode, max_bytes: int = p.DEFAULT_MAX_HEADER_BYTES) -> float:
    """Parse ``frame`` as the server would; assert it is refused with ``code``; return the peak MiB."""

    def parse() -> None:
        with pytest.raises(p.ProtocolError) as e:
            p.unpack_header(frame, max_bytes)
        assert e.value.code is code, e.value.message

    return _peak_mib(parse)


def _map_of_arrays(unit: bytes, total: int = p.DEFAULT_MAX_HEADER_BYTES - 4 * KIB, keys: int = 60) -> bytes:
    """A header map with ``keys`` arrays of ``unit`` repeated, about ``total`` bytes."""
    body = b"\xde" + (keys + 1).to_bytes(2, "big") + msgpack.packb("op") + msgpack.packb("ping")
    n = total // keys // len(unit)
    for i in range(keys):
        body += msgpack.packb(f"k{i:02d}") + b"\xdd" + n.to_bytes(4, "big") + unit * n
    return body


def test_the_reviewers_8mib_header_is_refused_before_parsing():
    nested = b"\x81\xa2op\xdd" + (8 * MIB).to_bytes(4, "big") + b"\x90" * (8 * MIB)  # 516 MiB when parsed
    assert _refused(nested, p.ErrorCode.TOO_LARGE) < 0.1


def test_a_header_within_the_cap_cannot_expand_much():
    # Empty containers, one byte each: refused after at most one per 32 bytes is built.
    assert _refused(_map_of_arrays(b"\x90"), p.ErrorCode.BAD_REQUEST) < 4
    assert _refused(_map_of_arrays(b"\x91\xc0"), p.ErrorCode.BAD_REQUEST) < 8
    # A truncated chain of arrays that each declare 32k elements: msgpack would pre-size
    # every level (67 MiB for 1 MiB sent); the skipping pass refuses it first.
    deep = b"\x81\xa2op" + (b"\xdd" + (32 * KIB).to_bytes(4, "big")) * (200 * KIB)
    assert _refused(deep, p.ErrorCode.BAD_REQUEST) < 2
    # The costliest shape that does parse: 2-character strings, 51 bytes each from 3 sent.
    strings = _map_of_arrays(b"\xa2ab")
    peak = _peak_mib(lambda: p.unpack_header(strings, p.DEFAULT_MAX_HEADER_BYTES))
    assert peak < 32  # about 20x the header; parsed, empty containers would cost about 64x


def test_real_headers_up_to_the_default_cap_still_parse():
    n = 27_000  # a get of 27k objects: a 1M-token prompt at chunk 256 with 6 groups
    get = p.pack_header({"op": "get", "id": 1, "ns": NS, "keys": [[h(i), i % 6, 0] for i in range(n)]})
    assert len(get) <= p.DEFAULT_MAX_HEADER_BYTES
    assert len(p.unpack_header(get, p.DEFAULT_MAX_HEADER_BYTES)["keys"]) == n
    put = p.pack_header({"op": "put", "id": 1, "ns": NS, "keys": [[h(i), 0, 0] for i in range(n)], "prev": [None] * n})
    assert p.unpack_header(put, p.DEFAULT_MAX_HEADER_BYTES)["prev"] == [None] * n
    lookup = p.pack_header({"op": "lookup", "id": 1, "ns": NS, "hashes": [h(i) for i in range(30_000)],
                            "attn_groups": [0], "state_groups": [1], "world_size": 1})
    assert len(p.unpack_header(lookup, p.DEFAULT_MAX_HEADER_BYTES)["hashes"]) == 30_000


# --- message and header size, over real sockets -------------------------------------------


def test_oversize_header_gets_too_large_and_the_server_keeps_serving(server, client):
    before = metric(metrics(server), 'glm_cache_limit_refusals_total{limit="header_bytes"}')
    bad = raw_dealer(server)
    try:
        bad.send_multipart([p.pack_header({"op": "ping", "id": 7, "pad": b"x" * MAX_HEADER})])
        reply = msgpack.unpackb(bad.recv_multipart()[0])
    finally:
        bad.close()
    assert reply["ok"] is False and reply["code"] == "too_large" and "--max-header-kb" in reply["message"]
    assert reply["id"] == 7  # the id is echoed though nothing else in the header was parsed
    with pytest.raises(CacheServerError) as e:  # so a client gets the error, not a timeout
        client.request({"op": "ping", "pad": b"x" * MAX_HEADER})
    assert e.value.code == "too_large"
    client.ping()
    assert metric(metrics(server), 'glm_cache_limit_refusals_total{limit="header_bytes"}') == before + 2


def test_frame_over_max_message_disconnects_only_that_peer(server, client):
    bad = raw_dealer(server, timeout_ms=1000)
    try:
        bad.send_multipart([p.pack_header({"op": "put", "id": 1, "ns": NS, "keys": [[h(1), 0, 0]]}),
                            b"\0" * (MAX_MESSAGE + 1)])
        with pytest.raises(zmq.Again):  # ZMQ dropped it and the peer: no reply, ever
            bad.recv_multipart()
        assert server.proc.poll() is None
        # Another client is unaffected, and the store never saw the object.
        assert client.put(NS, [(h(2), 0, 0, b"fine")]) == ["stored"]
        assert client.get(NS, [(h(1), 0, 0)]) == [None]
        # The dropped peer reconnects on its own and is served again.
        bad.setsockopt(zmq.RCVTIMEO, 5000)
        bad.send_multipart([p.pack_header({"op": "ping", "id": 2})])
        assert msgpack.unpackb(bad.recv_multipart()[0]) == {"ok": True, "id": 2}
    finally:
        bad.close()


def test_request_over_max_message_in_total_is_refused_whole(server, client):
    n = MAX_MESSAGE // MAX_OBJECT + 1  # each frame is allowed, their sum is not
    with pytest.raises(CacheServerError) as e:
        client.put(NS, [(h(i), 0, 0, b"\0" * MAX_OBJECT) for i in range(n)])
    assert e.value.code == "too_large" and "--max-message-mb" in e.value.message
    assert client.stats()["objects"] == 0
    assert client.put(NS, [(h(i), 0, 0, b"\0" * MAX_OBJECT) for i in range(n - 1)]) == ["stored"] * (n - 1)


def test_status_reports_the_limits(client):
    config = client.stats()["config"]
    assert config["max_message_bytes"] == MAX_MESSAGE and config["max_header_bytes"] == MAX_HEADER
    assert config["max_leases_per_client"] == 3 and config["max_namespaces"] == 64
    assert config["max_leased_bytes"] == int(0.01 * (1 << 30) * 0.5)


def test_default_max_message_is_sixteen_objects_capped_by_the_budget_plus_the_header():
    from cache_server.config import default_max_message_bytes

    assert default_max_message_bytes(256 * MIB, 1 << 30, MIB) == (1 << 30) + MIB  # the CLI defaults
    assert default_max_message_bytes(256 * MIB, 100 << 30, MIB) == 16 * 256 * MIB + MIB
    assert default_max_message_bytes(MIB, MIB // 2, 0) == MIB  # never below one maximum object


# --- leases ------------------------------------------------------------------------------


def test_lease_cap_per_client_drops_that_clients_oldest_lease(server, client):
    client.put(NS, [(h(0), 0, 0, b"a" * 100)])
    with CacheClient(server.url, timeout_s=5.0) as other:
        theirs = other.lookup(NS, [h(0)], [0], [])[1]
        mine = [client.lookup(NS, [h(0)], [0], [])[1] for _ in range(5)]
        assert [client.release(x) for x in mine] == [False, False, True, True, True]
        assert other.release(theirs) is True  # another connection's lease is its own business
    assert client.stats()["leases_dropped_client_cap"] == 2
    assert metric(metrics(server), 'glm_cache_leases_dropped_total{cap="per_client"}') >= 2


def test_an_empty_object_is_refused_with_its_chunk(server, client):
    """Every object holds at least one row: a put with an empty one is refused whole (as an
    oversize one is), and nothing of it is stored."""
    client.hello(NS, 16)
    with pytest.raises(CacheServerError) as e:
        client.put(NS, [(h(7), 0, 0, b"x" * 64), (h(7), 1, 0, b"")])
    assert e.value.code == "bad_request" and "empty" in e.value.message
    assert client.get(NS, [(h(7), 0, 0)]) == [None]


def test_a_thousand_lookups_cannot_make_every_put_no_space():
    obj = 10_000
    with ServerProcess("--l1-size-gb", "0.001", "--max-object-size-mb", "0.5",
                       "--max-leases-per-client", "100000") as s, CacheClient(s.url, timeout_s=5.0) as c:
        capacity = c.stats()["capacity_bytes"]
        n = capacity // (obj + c.stats()["object_overhead_bytes"])  # each object is charged its index too
        for i in range(n):
            assert c.put(NS, [(h(i), 0, 0, b"a" * obj)]) == ["stored"]
        leases = [c.lookup(NS, [h(i % n)], [0], [])[1] for i in range(1000)]
        assert all(x is not None for x in leases)
        stats = c.stats()
        assert stats["leased_bytes"] <= capacity // 2 and stats["leased_objects"] < n
        assert stats["leases_dropped_leased_bytes"] > 0
        # Every put still finds room, although no lease was released.
        assert [c.put(NS, [(h(n + i), 0, 0, b"b" * obj)])[0] for i in range(n // 2)] == ["stored"] * (n // 2)
        assert metric(metrics(s), 'glm_cache_leases_dropped_total{cap="leased_bytes"}') > 0


# --- namespaces --------------------------------------------------------------------------


def test_namespace_cap_forgets_an_empty_namespace_else_refuses():
    with ServerProcess("--max-namespaces", "2") as s, CacheClient(s.url, timeout_s=5.0) as c:
        c.hello("a", 16)
        c.hello("b", 16)
        c.put("a", [(h(1), 0, 0, b"x")])
        c.hello("c", 16)  # b holds nothing: forgotten to make room
        assert set(c.stats()["namespaces"]) == {"a", "c"}
        c.put("c", [(h(1), 0, 0, b"y")])
        for attempt in (lambda: c.hello("d", 16), lambda: c.put("d", [(h(1), 0, 0, b"z")])):
            with pytest.raises(CacheServerError) as e:
                attempt()
            assert e.value.code == "too_many_namespaces" and "--max-namespaces" in e.value.message
        assert c.get("a", [(h(1), 0, 0)])[0] is not None  # nothing of the known ones was touched
        assert metric(metrics(s), 'glm_cache_limit_refusals_total{limit="namespaces"}') == 2
        c.clear("c")
        assert c.hello("d", 16)["chunk_size"] == 256
        assert set(c.stats()["namespaces"]) == {"a", "d"}


def test_a_forgotten_namespace_is_gone_and_metrics_stay_small():
    """5,000 hellos of fresh namespaces, each with a declared layout, through a table of 4:
    what the server keeps of them (status, layouts, chunk trees and their /metrics series)
    stays at the table's size, while a namespace holding objects is kept."""
    with ServerProcess("--max-namespaces", "4") as s, CacheClient(s.url, timeout_s=30.0) as c:
        c.hello("kept", 16, attn_groups=[0], state_groups=[1])
        c.put("kept", [(h(1), 0, 0, b"x"), (h(1), 1, 0, b"s")], parent=[None, None])
        small = len(metrics(s))
        for i in range(5000):
            c.hello(f"peer-{i}", 16, attn_groups=[0], state_groups=[1])
        text = metrics(s)
        series = [ln for ln in text.splitlines() if ln.startswith("glm_cache_resumable_tokens{")]
        assert len(series) <= 4 and len(c.stats()["namespaces"]) == 4 and "kept" in c.stats()["namespaces"]
        assert len(text) < small + 4 * 1024  # 5,000 namespaces' series would be megabytes
        assert c.lookup("kept", [h(1)], [0], [1], lease=False)[0] == 1


# --- flags -------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--max-message-mb", "0"], ["--max-header-kb", "-1"],
                                  ["--max-leases-per-client", "0"], ["--max-namespaces", "abc"],
                                  ["--max-leased-fraction", "1.5"],
                                  ["--max-object-size-mb", "10", "--max-message-mb", "5"]])
def test_invalid_limit_values_exit_2_with_a_message(args):
    r = subprocess.run([sys.executable, "-m", "cache_server.cli", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "error:" in r.stderr


def test_client_timeout_after_a_dropped_message_is_unavailable_not_a_hang(server):
    with CacheClient(server.url, timeout_s=0.5) as c:
        with pytest.raises(CacheServerUnavailable, match=r"within 0\.5s"):  # the client's deadline, not a hang
            c.request({"op": "put", "ns": NS, "keys": [[h(3), 0, 0]]}, [b"\0" * (MAX_MESSAGE + 1)])
        c.ping()  # the same client is served after its reconnect


def test_a_header_refused_unparsed_for_its_shape_answers_the_clients_id(server, client):
    """A header the bound refuses while parsing (too many containers for its size) is an
    error reply the client receives, not a silence it waits out as a dead server (which
    would put the connector in back-off)."""
    crowded = {"op": "ping", "pad": [[i] for i in range(4096)]}  # one array per ~3 bytes
    with pytest.raises(CacheServerError) as e:
        client.request(crowded)
    assert e.value.code == "bad_request" and "not valid msgpack" in e.value.message
    client.ping()
