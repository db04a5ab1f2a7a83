"""Process-level tests: a real glm-cache-server over real sockets."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
import pytest
import zmq

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.protocol import PROTOCOL_VERSION
from testing.server_process import ServerProcess, free_port

NS = "test-ns"
MAX_OBJECT = 1 << 20  # 1 MiB, so the oversize test stays cheap


SERVER_ARGS = ("--chunk-size", "256", "--l1-size-gb", "0.01", "--max-object-size-mb", "1")  # the server fixture's (conftest.py)


def raw_dealer(server) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.url)
    return sock


def http_json(url: str, method: str = "GET"):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, json.loads(r.read())


def test_hello_negotiates_chunk_size_and_logs_it(server, client):
    reply = client.hello("ns-1152", alignment=1152)
    assert reply["chunk_size"] == 1152 and reply["min_chunk_size"] == 256 and reply["v"] == PROTOCOL_VERSION
    assert client.hello("ns-16", alignment=16)["chunk_size"] == 256
    assert client.hello("ns-100", alignment=100)["chunk_size"] == 300
    log = server.log()
    assert "Negotiated chunk size to 1152 (configured_min=256, required_alignment=1152)" in log
    assert "Negotiated chunk size to 300 (configured_min=256, required_alignment=100)" in log


def test_hello_rejects_conflicting_alignment_and_wrong_version(client):
    client.hello("ns-conflict", alignment=64)
    with pytest.raises(CacheServerError) as e:
        client.hello("ns-conflict", alignment=128)
    assert e.value.code == "conflict"
    with pytest.raises(CacheServerError) as e:
        client.request({"op": "hello", "v": PROTOCOL_VERSION + 1, "ns": NS, "alignment": 16})
    assert e.value.code == "version_mismatch"


def test_store_strict_prefix_lookup_and_hit_round_trip(client):
    chunk = client.hello(NS, alignment=128)["chunk_size"]
    tokens = list(range(3 * chunk + 5))
    hashes = chunk_hashes(tokens, chunk)
    assert len(hashes) == 3
    attn = {i: os.urandom(4096) for i in range(3)}
    state = os.urandom(8192)
    for i, hsh in enumerate(hashes):
        assert client.put(NS, [(hsh, 0, 0, attn[i])]) == ["stored"]
    assert client.put(NS, [(hashes[2], 1, 0, state)]) == ["stored"]
    assert client.put(NS, [(hashes[2], 1, 0, state)]) == ["exists"]
    # The client asks only about whole chunks of the strict prefix, (N-1)//C chunks.
    n_strict = (len(tokens) - 1) // chunk
    hit, lease = client.lookup(NS, hashes[:n_strict], attn_groups=[0], state_groups=[1])
    assert hit == 3 and lease is not None
    got = client.get(NS, [(hashes[i], 0, 0) for i in range(3)] + [(hashes[2], 1, 0), (hashes[0], 1, 0)])
    assert [bytes(g) for g in got[:3]] == [attn[0], attn[1], attn[2]]
    assert bytes(got[3]) == state and got[4] is None
    assert client.release(lease) is True
    # A different salt hashes differently and misses.
    salted = chunk_hashes(tokens, chunk, cache_salt="other-tenant")
    assert client.lookup(NS, salted[:n_strict], [0], [1]) == (0, None)


def test_lookup_without_state_at_the_last_chunk_resumes_earlier(client):
    hashes = chunk_hashes(list(range(1024)), 256)
    client.put(NS, [(x, 0, 0, b"a") for x in hashes] + [(hashes[1], 1, 0, b"s")])
    hit, lease = client.lookup(NS, hashes, [0], [1])
    assert hit == 2
    client.release(lease)


def test_prev_link_marks_the_older_state_superseded(server, client):
    a, b = b"\xaa" * 32, b"\xbb" * 32
    client.put(NS, [(a, 1, 0, b"s1")])
    assert client.put(NS, [(b, 1, 0, b"s2")], prev=[a]) == ["stored"]
    assert client.stats()["superseded_objects"] == 1
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        assert "glm_cache_superseded_objects 1.0" in r.read().decode()


def test_group_ids_need_separate_object_groups():
    with ServerProcess("--l1-size-gb", "0.01") as s, CacheClient(s.url, timeout_s=5) as c:
        assert c.hello(NS, 16)["separate_object_groups"] is True  # on by default
        assert c.put(NS, [(bytes(32), 1, 0, b"x")]) == ["stored"]
    with ServerProcess("--l1-size-gb", "0.01", "--no-separate-object-groups") as s, \
            CacheClient(s.url, timeout_s=5) as c:
        assert c.hello(NS, 16)["separate_object_groups"] is False
        assert c.put(NS, [(bytes(32), 0, 0, b"x")]) == ["stored"]
        with pytest.raises(CacheServerError) as e:
            c.put(NS, [(bytes(32), 1, 0, b"x")])
        assert e.value.code == "groups_not_separate" and "--separate-object-groups" in e.value.message


MALFORMED = [
    ("random bytes", [os.urandom(64)], "bad_request"),
    ("msgpack list, not a map", [msgpack.packb([1, 2, 3])], "bad_request"),
    ("op of the wrong type", [msgpack.packb({"op": 7, "id": 1})], "bad_request"),
    ("unknown op", [msgpack.packb({"op": "explode", "id": 1})], "unknown_op"),
    ("missing field", [msgpack.packb({"op": "lookup", "id": 1, "ns": NS})], "bad_request"),
    ("hash of the wrong length", [msgpack.packb({"op": "lookup", "id": 1, "ns": NS, "hashes": [b"short"],
                                                 "attn_groups": [0], "state_groups": [], "world_size": 1})],
     "bad_request"),
    ("bool where an int goes", [msgpack.packb({"op": "hello", "id": 1, "v": True, "ns": NS, "alignment": 1})],
     "bad_request"),
    ("negative alignment", [msgpack.packb({"op": "hello", "id": 1, "v": PROTOCOL_VERSION, "ns": NS, "alignment": -5})],
     "bad_request"),
    ("keys and payloads disagree", [msgpack.packb({"op": "put", "id": 1, "ns": NS,
                                                   "keys": [[bytes(32), 0, 0], [bytes(32), 1, 0]]}), b"x"],
     "bad_request"),
    ("oversize payload", [msgpack.packb({"op": "put", "id": 1, "ns": NS, "keys": [[bytes(32), 0, 0]]}),
                          b"\0" * (MAX_OBJECT + 1)], "too_large"),
    ("prev of the wrong length", [msgpack.packb({"op": "put", "id": 1, "ns": NS, "keys": [[bytes(32), 1, 0]],
                                                 "prev": [b"x"]}), b"s"], "bad_request"),
    ("malformed key", [msgpack.packb({"op": "get", "id": 1, "ns": NS, "keys": [["abc", -1]]})], "bad_request"),
    ("put without checksums", [msgpack.packb({"op": "put", "id": 1, "ns": NS, "keys": [[bytes(32), 1, 0]]}), b"s"],
     "bad_request"),
    ("checksum of the wrong length", [msgpack.packb({"op": "put", "id": 1, "ns": NS, "keys": [[bytes(32), 1, 0]],
                                                     "sums": [b"x" * 32]}), b"s"], "bad_request"),
    ("delete with an unknown reason", [msgpack.packb({"op": "delete", "id": 1, "ns": NS, "keys": [[bytes(32), 0, 0]],
                                                      "reason": "because"})], "bad_request"),
]


@pytest.mark.parametrize("name,frames,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_gets_an_error_and_another_client_keeps_working(server, client, name, frames, code):
    bad = raw_dealer(server)
    try:
        bad.send_multipart(frames)
        reply = msgpack.unpackb(bad.recv_multipart()[0])
    finally:
        bad.close()
    assert reply["ok"] is False and reply["code"] == code and reply["message"]
    # The well-behaved client on its own connection is unaffected, and so is the store.
    client.ping()
    assert client.put(NS, [(bytes(32), 0, 0, b"fine")]) == ["stored"]
    assert bytes(client.get(NS, [(bytes(32), 0, 0)])[0]) == b"fine"


def test_interleaved_garbage_and_valid_requests_on_two_connections(server, client):
    bad = raw_dealer(server)
    rng = random.Random(0)
    try:
        for i in range(50):
            bad.send_multipart([rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 3))])
            assert client.put(NS, [(i.to_bytes(32, "big"), 0, 0, b"v")]) == ["stored"]
        replies = [msgpack.unpackb(bad.recv_multipart()[0]) for _ in range(50)]
    finally:
        bad.close()
    assert all(r["ok"] is False for r in replies)
    assert client.stats()["objects"] == 50


def test_http_endpoints(server, client):
    client.put(NS, [(bytes(32), 0, 0, b"x" * 10), (bytes(32), 1, 0, b"y" * 20)])
    client.lookup(NS, [bytes(32)], [0], [1], lease=False)
    assert http_json(server.http_url + "/healthcheck") == (200, {"status": "healthy"})
    code, status = http_json(server.http_url + "/status")
    assert code == 200
    assert status["objects"] == 2 and status["bytes_by_group"] == {"0": 10, "1": 20}
    assert status["hits"] >= 1 and "misses" in status and "evictions" in status and "active_leases" in status
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'glm_cache_group_bytes{group="1"} 20.0' in metrics
    assert "glm_cache_lookup_hits_total" in metrics and "glm_cache_request_seconds_bucket" in metrics
    assert http_json(server.http_url + "/cache/clear", method="POST") == (200, {"removed": 2})
    assert client.stats()["objects"] == 0


def test_status_and_metrics_report_bytes_by_object_group_name(server, client):
    """Engines name their object groups at hello; group ids mean different things in
    different namespaces, so bytes are summed by name across them (a namespace without
    names reports ``group_<id>``)."""
    names = {0: "kda_state", 1: "mla_latent", 2: "indexer_cache"}
    client.hello("ns-named-a", 16, attn_groups=[1, 2], state_groups=[0], group_names=names)
    # another engine whose group 1 is its state: the same id, another name
    client.hello("ns-named-b", 16, attn_groups=[0], state_groups=[1], group_names={0: "mla_latent", 1: "kda_state"})
    h = bytes(32)
    client.put("ns-named-a", [(h, 0, 0, b"s" * 7), (h, 1, 0, b"l" * 30), (h, 2, 0, b"i" * 12)])
    client.put("ns-named-b", [(h, 0, 0, b"l" * 5), (h, 1, 0, b"s" * 3)])
    client.put("ns-unnamed", [(h, 4, 0, b"u" * 2)])
    status = client.stats()
    assert status["bytes_by_group_name"] == {"group_4": 2, "indexer_cache": 12, "kda_state": 10, "mla_latent": 35}
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'glm_cache_object_group_bytes{name="mla_latent"} 35.0' in metrics
    assert 'glm_cache_object_group_bytes{name="indexer_cache"} 12.0' in metrics
    # names become label values: only [a-z0-9_], and only of the groups declared
    for bad in ({0: "KDA state"}, {5: "kda_state"}):
        with pytest.raises(CacheServerError, match="group_names"):
            client.hello("ns-named-c", 16, attn_groups=[1], state_groups=[0], group_names=bad)
    http_json(server.http_url + "/cache/clear", method="POST")


def test_absent_server_raises_within_the_timeout():
    """Unavailable, ended by the client's own 0.5 s deadline (its message says so; a hang is
    pytest-timeout's), not a wall-clock figure a loaded machine can miss."""
    with CacheClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5) as c:
        with pytest.raises(CacheServerUnavailable, match=r"within 0\.5s"):
            c.ping()


def test_killed_server_raises_then_a_restarted_one_is_used_again():
    port = free_port()
    s = ServerProcess(port=port).start()
    c = CacheClient(s.url, timeout_s=0.5)
    c.ping()
    s.kill()
    # the call's deadline ended it: the message gives what was left of its 0.5 s when the wait began
    with pytest.raises(CacheServerUnavailable, match=r"within 0\.[0-5]s"):
        c.put(NS, [(bytes(32), 0, 0, b"x" * 1000)])
    with ServerProcess(port=port):
        c.ping()  # same client, reconnected
    c.close()


def test_sigterm_and_sigint_shut_down_cleanly():
    for sig in (signal.SIGTERM, signal.SIGINT):
        s = ServerProcess().start()
        s.proc.send_signal(sig)
        assert s.proc.wait(30) == 0  # a hang fails; a loaded machine (engines in the other lane) may take >10 s
        s.stop()
        assert "shutting down" in s.log() and "stopped" in s.log()


@pytest.mark.parametrize("args", [["--l1-size-gb", "0"], ["--chunk-size", "-3"], ["--port", "70000"],
                                  ["--eviction-policy", "FIFO"], ["--l1-size-gb", "abc"],
                                  ["--l1-size-gb", "0.001", "--max-object-size-mb", "100"]])
def test_invalid_cli_values_exit_2_with_a_message(args):
    r = subprocess.run([sys.executable, "-m", "cache_server.cli", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "error:" in r.stderr


def test_server_does_not_import_vllm_or_torch():
    code = ("import sys, cache_server.cli, cache_server.server, cache_server.http, testing.server_process; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_stalled_server_times_out_and_its_late_reply_is_never_taken_for_a_later_one():
    with ServerProcess() as s:
        c = CacheClient(s.url, timeout_s=0.5)
        c.put(NS, [(bytes(32), 0, 0, b"first")])
        s.pause()  # a slow server: alive, but not answering
        try:
            with pytest.raises(CacheServerUnavailable, match=r"within 0\.[0-5]s"):  # what was left of 0.5 s
                c.get(NS, [(bytes(32), 0, 0)])
        finally:
            s.resume()
        # The next request must get its own answer, not the stalled get's.
        assert c.get(NS, [(b"\1" * 32, 0, 0)]) == [None]
        assert c.stats()["objects"] == 1
        c.close()


def test_many_clients_concurrently_each_get_their_own_objects(server):
    import threading

    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with CacheClient(server.url, timeout_s=10) as c:
                for i in range(20):
                    key = (n * 1000 + i).to_bytes(32, "big")
                    payload = os.urandom(1000 + n)
                    assert c.put(NS, [(key, 0, n, payload)]) == ["stored"]
                    assert bytes(c.get(NS, [(key, 0, n)])[0]) == payload
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_client_and_keys_do_not_import_vllm_or_torch():
    code = ("import sys, connector, cache_server.client, connector.keys; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_replicated_groups_are_stored_once_and_status_shows_the_saving(server, client):
    """A TP-4 engine: the latent group (2) is one object per chunk, the state group (1) one
    per rank; a lookup needs one latent copy, and /status reports the bytes a per-rank
    layout would have stored in addition."""
    ns = "tp4-replicated"
    client.hello(ns, 16, world_size=4, replicated_groups=[2])
    hashes = [bytes([7, i]) * 16 for i in range(3)]
    latent = [(hsh, 2, 0, b"L" * 1000) for hsh in hashes]
    states = [(hashes[-1], 1, r, b"S" * 100) for r in range(4)]
    assert set(client.put(ns, latent + states)) == {"stored"}
    assert client.lookup(ns, hashes, [2], [1], world_size=4, replicated_groups=[2], lease=False)[0] == 3
    assert client.lookup(ns, hashes, [2], [1], world_size=4, lease=False)[0] == 0
    _, status = http_json(server.http_url + "/status")
    entry = status["namespaces"][ns]
    assert entry["world_size"] == 4 and entry["replicated_groups"] == [2]
    assert entry["replicated_bytes"] == 3000
    assert entry["bytes_saved_by_storing_once"] == 9000
    assert status["bytes_saved_by_storing_replicated_groups_once"] >= 9000


def test_status_and_metrics_report_usable_prefixes(server, client):
    """/status and /metrics say how much the cache can resume, not only what it holds:
    resumable tokens (chunks on a path with attention throughout and a state at its end,
    times the chunk size), states held, and newest states lost (whether the latest turns
    can still resume)."""
    ns = "usable-prefixes"
    chunk = client.hello(ns, 256, world_size=2, replicated_groups=[2], attn_groups=[2],
                         state_groups=[1])["chunk_size"]
    hashes = chunk_hashes(list(range(3 * chunk)), chunk)
    parents = [None, hashes[0], hashes[1]]
    attn = [(hsh, 2, 0, b"L" * 100) for hsh in hashes]
    states = [(hashes[1], 1, r, b"S" * 100) for r in range(2)]  # resumable after chunk 2 of 3
    assert set(client.put(ns, attn + states, parent=parents + [hashes[0]] * 2)) == {"stored"}
    client.put(ns, [(bytes(32), 1, 0, b"T" * 100)], parent=[None])  # one rank's state: held by nobody
    _, status = http_json(server.http_url + "/status")
    usable = status["namespaces"][ns]["usable_prefixes"]
    assert usable["resumable_tokens"] == 2 * chunk and usable["resumable_states"] == 1
    assert usable["states_held"] == 1 and usable["states_evicted_newest"] == 0
    client.delete(ns, [(hashes[0], 2, 0)])  # a hole at the first chunk: nothing resumes
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    label = status["namespaces"][ns]["metrics_id"]  # /metrics names no namespace, only its id
    assert len(label) == 12 and ns not in text
    assert f'glm_cache_resumable_tokens{{namespace="{label}"}} 0.0' in text
    assert f'glm_cache_states_held{{namespace="{label}"}} 1.0' in text
    # chunk 2's attention and state shards; chunk 3 was never on a resumable path (pending)
    assert f'glm_cache_worthless_objects{{namespace="{label}"}} 3.0' in text
    assert f'glm_cache_states_evicted_newest_total{{namespace="{label}"}} 0.0' in text
    client.hello("undeclared", 256)  # an engine that did not declare its groups: not tracked
    assert http_json(server.http_url + "/status")[1]["namespaces"]["undeclared"]["usable_prefixes"] is None


def test_entering_a_started_server_process_does_not_start_a_second_one():
    """``with ServerProcess(...).start() as s``: one process, stopped on exit (a second start
    on the same ports would leave the first running after the test)."""
    srv = ServerProcess("--separate-object-groups").start()
    first = srv.proc
    with srv as same:
        assert same is srv and srv.proc is first
    assert first.poll() is not None


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_server_binds_an_ipv6_host_and_clients_reach_it():
    """``--host ::1`` binds both sockets on IPv6 (ZMQ needs the address bracketed and IPv6
    switched on); a client reaches ``tcp://[::1]:port``."""
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cache_server.cli", "--host", "::1", "--port", str(port),
                             "--http-port", str(http_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://[::1]:{http_port}/healthcheck", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "no health check answer on [::1]"
                time.sleep(0.1)
        with CacheClient(f"tcp://[::1]:{port}", timeout_s=5) as client:
            client.hello(NS, 16)
            key = (chunk_hashes(list(range(16)), 16)[0], 0, 0)
            assert client.put(NS, [(*key, b"over IPv6")]) == ["stored"]
            assert bytes(client.get(NS, [key])[0]) == b"over IPv6"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again():
    """free_port's port can be taken by another process before the server binds it (CI saw
    a module's fixture fail so): the harness picks new ports and starts again; a port the
    caller named is not changed."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        srv = ServerProcess()
        srv.http_port = busy  # as if the picked port had been taken meanwhile
        with srv:
            assert srv.http_port != busy
            with urllib.request.urlopen(srv.http_url + "/healthcheck", timeout=5) as r:
                assert r.status == 200
        assert "Address already in use" in srv.log()
        named = ServerProcess(http_port=busy)
        with pytest.raises(RuntimeError, match="Address already in use"):
            named.start()
        assert named.http_port == busy
