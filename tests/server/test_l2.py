"""The L2 tier (``glm-cache-server --l2``) against a real three-node Redis cluster and real
server processes: two servers are two hosts with separate L1s sharing one L2."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.request

import pytest
from redis.cluster import ClusterNode, RedisCluster

from cache_server import protocol as p
from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.client import CacheClient
from cache_server.l2 import L2Tier, redis_key
from cache_server.l2_config import L2Config, L2ConfigError
from cache_server.l2_values import HEADER_BYTES, MAGIC, decode_value, encode_value, mac_key, namespace_tag
from testing.l2_fixtures import L2_SECRET, l2_args, start_cluster, wait_written
from testing.server_process import ServerProcess

KEY_BYTES = mac_key(L2_SECRET.encode())

NS = "model-a"
ATTN, STATE = 0, 1


def _hashes(n: int, seed: int) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(n)]


def _objects(hashes: list[bytes], size: int = 50_000) -> list[tuple[bytes, int, int, bytes]]:
    """Attention for every chunk, a state at the last (one rank)."""
    items = [(h, ATTN, 0, os.urandom(size)) for h in hashes]
    return items + [(hashes[-1], STATE, 0, os.urandom(size))]


def _server(cluster, *extra: str, port: int | None = None, query: str = "?timeout_s=30") -> ServerProcess:
    """A server on the cluster. Its tier's deadline is 30 s unless ``query`` says otherwise:
    these tests check what L2 holds and promotes, not the deadline (seen in a loaded run: a
    promotion past the 1 s default answered a lookup L1-only, 0 chunks)."""
    return ServerProcess("--separate-object-groups", "--chunk-size", "16", *l2_args(cluster.url + query), *extra,
                         port=port).start()


def _client(server: ServerProcess) -> CacheClient:
    c = CacheClient(server.url, timeout_s=30)  # correctness, not a deadline: a loaded machine waits
    c.hello(NS, 16)
    return c


def _store_through(server: ServerProcess, items, ns: str = NS) -> None:
    c = _client(server)
    assert set(c.put(ns, items)) == {"stored"}
    wait_written(c.stats, len(items))
    c.close()


def _poll(condition, what: str, timeout_s: float = 60.0):
    """Poll ``condition()`` until it returns something true (returned), failing after a
    generous ``timeout_s`` with ``what``."""
    deadline = time.monotonic() + timeout_s
    while not (got := condition()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f}s"
        time.sleep(0.02)
    return got


@contextlib.contextmanager
def _stopped(cluster):
    """Every node SIGSTOPped (connections are accepted, nothing is answered) until the block
    ends: an L2 round trip under way stays under way, for as long as the test needs."""
    procs = [proc for proc in cluster.procs if proc is not None and proc.poll() is None]
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)


def _redis(cluster) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in cluster.ports])


def _redis_key(cluster, key) -> str:
    return redis_key("glmkv", key)


def _value(key, payload: bytes, key_bytes: bytes = KEY_BYTES, prev=None, parent=UNKNOWN_PARENT) -> bytes:
    """An L2 value of ``key`` as a server holding ``key_bytes`` writes it."""
    ns, h, g, r = key
    return encode_value(key, payload, p.checksum(payload, ns, (h, g, r)), prev, parent, key_bytes=key_bytes)


@pytest.fixture(autouse=True)
def _empty_l2(request):
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if all(proc is not None and proc.poll() is None for proc in c.procs):
            _redis(c).flushall(target_nodes=RedisCluster.PRIMARIES)


def test_url_parsing_and_value_format():
    cfg = L2Config.from_url("redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7001?timeout_s=0.5&prefix=kv&ttl_s=60",
                            secret=b"x" * 32)
    assert cfg.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001)) and cfg.cluster
    assert (cfg.password, cfg.timeout_s, cfg.prefix, cfg.ttl_s) == ("s3cret", 0.5, "kv", 60)
    assert "s3cret" not in cfg.redacted() and "s3cret" not in repr(cfg) and "xxxx" not in repr(cfg)
    assert not L2Config.from_url("valkey://h:1").cluster
    for bad in ("http://h:1", "redis://h:1,h:2", "redis://h", "redis://h:1?timeout=1", "redis://h:1?timeout_s=0",
                "redis://h:1?debug_promote_delay_s=1"):
        with pytest.raises(L2ConfigError):
            L2Config.from_url(bad)
    with pytest.raises(L2ConfigError, match="--l2-secret-file"):
        L2Tier(L2Config.from_url("redis://127.0.0.1:1"))  # no secret: no tier
    key = (NS, b"\1" * 32, 0, 3)
    payload = os.urandom(1000)
    value = _value(key, payload, prev=b"\2" * 32)
    assert len(value) == HEADER_BYTES + 1000 and value.startswith(MAGIC)
    got = decode_value(key, value, key_bytes=KEY_BYTES)
    assert bytes(got[0]) == payload and got[1] == p.checksum(payload, NS, key[1:]) and got[2] == b"\2" * 32
    assert got[3] == UNKNOWN_PARENT  # not said
    for parent in (None, b"\3" * 32):
        assert decode_value(key, _value(key, payload, parent=parent), key_bytes=KEY_BYTES)[3] == parent
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode_value(key, bytes(flipped), key_bytes=KEY_BYTES) == "auth"
    # The same bytes under another key (rank, namespace) are not that key's.
    assert decode_value((NS, b"\1" * 32, 0, 2), value, key_bytes=KEY_BYTES) == "auth"
    assert decode_value(("model-b", b"\1" * 32, 0, 3), value, key_bytes=KEY_BYTES) == "auth"
    # Built by whoever knows the format but not the secret: refused.
    assert decode_value(key, _value(key, payload, mac_key(b"guess" * 8)), key_bytes=KEY_BYTES) == "auth"
    # Authentic, but its storing client's checksum does not match the payload.
    wrong_sum = encode_value(key, payload, bytes(16), None, key_bytes=KEY_BYTES)
    assert decode_value(key, wrong_sum, key_bytes=KEY_BYTES) == "checksum"
    # The metadata is authenticated too: a prev link flipped in place.
    relinked = bytearray(value)
    relinked[len(MAGIC) + p.CHECKSUM_BYTES + 5] ^= 1
    assert decode_value(key, bytes(relinked), key_bytes=KEY_BYTES) == "auth"
    old = b"GL2\x03" + value[len(MAGIC):]
    assert decode_value(key, old, key_bytes=KEY_BYTES) == "format"
    assert decode_value(key, value[:HEADER_BYTES - 1], key_bytes=KEY_BYTES) == "format"
    assert namespace_tag(NS) != namespace_tag("model-b")


def test_url_errors_never_show_the_password():
    """A configuration error names the URL with its user and password hidden, however
    malformed the URL is."""
    password = "hunter2-Pa55word"
    for url in (f"redis://:{password}@h:1?timeout=1", f"redis://user:{password}@h", f"http://:{password}@h:1",
                f"redis://:{password}@h:1,h:2", f"redis://:{password}@h:1?timeout_s=x",
                f"redis://:{password}@[::1:1", f"redis://:pa/ss{password}@h:1?timeout_s=0"):
        with pytest.raises(L2ConfigError) as e:
            L2Config.from_url(url)
        assert password not in str(e.value) and "***@" in str(e.value), str(e.value)


def test_server_refuses_l2_without_a_secret_and_never_prints_the_password(tmp_path):
    import subprocess
    import sys

    from testing.server_process import free_port

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cache_server.cli", "--port", str(free_port()),
                               "--http-port", str(free_port()), *args], capture_output=True, text=True, timeout=30)

    password = "hunter2-Pa55word"
    r = cli("--l2", f"redis://:{password}@127.0.0.1:1")
    assert r.returncode == 2 and "--l2 needs --l2-secret-file" in r.stderr and password not in r.stderr
    r = cli(*l2_args(f"redis://:{password}@127.0.0.1:1?nope=1"))
    assert r.returncode == 2 and "unknown parameter" in r.stderr and password not in r.stderr + r.stdout
    short = tmp_path / "short"
    short.write_text("too-short-a-secret\n")
    r = cli("--l2", "redis://127.0.0.1:1", "--l2-secret-file", str(short))
    assert r.returncode == 2 and "at least 32" in r.stderr and "too-short-a-secret" not in r.stderr
    r = cli("--l2-secret-file", str(short))
    assert r.returncode == 2 and "without --l2" in r.stderr


def test_conversation_stored_through_a_resumes_through_b(cluster):
    """Two hosts: A's stores reach L2 in the background; B, with its own empty L1, answers a
    lookup with the whole prefix by promoting it, and serves the same bytes."""
    hashes = _hashes(4, seed=1)
    items = _objects(hashes)
    with _server(cluster) as a, _server(cluster) as b:
        _store_through(a, items)
        cb = _client(b)
        assert cb.stats()["objects"] == 0
        chunks, lease = cb.lookup(NS, hashes, [ATTN], [STATE])
        assert chunks == 4 and lease is not None
        got = cb.get(NS, [(h, g, r) for h, g, r, _ in items])
        assert [bytes(x) for x in got] == [x[3] for x in items]
        l2 = cb.stats()["l2"]
        assert (l2["lookups"], l2["hits"], l2["promoted_objects"]) == (1, 1, 5)
        assert l2["promoted_bytes"] == sum(len(x[3]) for x in items)
        metrics = urllib.request.urlopen(b.http_url + "/metrics", timeout=30).read().decode()
        assert "glm_cache_l2_hits_total 1.0" in metrics and "glm_cache_l2_promoted_objects_total 5.0" in metrics
        assert 'glm_cache_l2_request_seconds_count{op="get"}' in metrics
        # A second lookup is answered by B's L1 alone.
        assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 4
        assert cb.stats()["l2"]["lookups"] == 1


def test_promoted_prefix_is_resumable_at_once(cluster):
    """L2 values carry the chunk-tree ``parent``, so B's tree places a promoted prefix at
    once (resumable tokens, retention as resumable, not pending)."""
    hashes = _hashes(4, seed=20)
    items = _objects(hashes)
    parents = [None, *hashes[:-1], hashes[-2]]  # attention chunks in order, then the state at the last

    def hello(server: ServerProcess) -> CacheClient:
        c = CacheClient(server.url, timeout_s=30)
        c.hello(NS, 16, 1, attn_groups=[ATTN], state_groups=[STATE])
        return c

    with _server(cluster) as a, _server(cluster) as b:
        ca = hello(a)
        assert set(ca.put(NS, items, parent=parents)) == {"stored"}
        wait_written(ca.stats, len(items))
        chunk = ca.stats()["namespaces"][NS]["chunk_size"]
        assert ca.stats()["namespaces"][NS]["usable_prefixes"]["resumable_tokens"] == 4 * chunk
        cb = hello(b)
        assert cb.lookup(NS, hashes, [ATTN], [STATE], lease=False)[0] == 4  # promoted from L2
        u = cb.stats()["namespaces"][NS]["usable_prefixes"]
        assert (u["resumable_tokens"], u["resumable_states"], u["states_held"]) == (4 * chunk, 1, 1)
        assert cb.stats()["l2"]["errors"] == {}


def _l2_errors_metric(server: ServerProcess, kind: str) -> float:
    text = urllib.request.urlopen(server.http_url + "/metrics", timeout=30).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(f'glm_cache_l2_errors_total{{kind="{kind}"}}'))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("attack", ["forged", "replayed", "old_format", "other_secret"])
def test_values_written_straight_into_the_store_are_refused_deleted_and_counted(cluster, attack):
    """Whoever can write to Redis but lacks ``--l2-secret-file`` plants a value for a
    prefix's state: built from the namespace and the public chunk hash with a guessed
    secret (forged), a valid value of another key copied under this one (replayed), a
    value of the unauthenticated format 3, or one of servers with another secret. The
    lookup through B never promotes it (the prefix is not resumable without that state),
    the value is deleted from L2, the refusal is counted in /status and /metrics, and L2
    stays up."""
    hashes = _hashes(3, seed=30)
    items = _objects(hashes)
    target = (NS, hashes[-1], STATE, 0)
    with _server(cluster) as a, _server(cluster) as b:
        _store_through(a, items[:-1])  # attention for every chunk, through a real server
        r = _redis(cluster)
        payload = os.urandom(50_000)
        if attack == "forged":
            planted = _value(target, payload, mac_key(b"a-guess-at-the-secret-0123456789"))
        elif attack == "replayed":
            planted = r.get(_redis_key(cluster, (NS, hashes[-1], ATTN, 0)))  # genuine, but another key's
            assert decode_value((NS, hashes[-1], ATTN, 0), planted, key_bytes=KEY_BYTES) != "auth"
        elif attack == "old_format":
            ns, h, g, rank = target
            planted = b"GL2\x03" + bytes(8) + p.checksum(payload, ns, (h, g, rank)) + bytes(66) + payload
        else:
            planted = _value(target, payload, mac_key(b"the-secret-of-another-deployment-0123"))
        r.set(_redis_key(cluster, target), planted)
        cb = _client(b)
        assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 0
        l2 = cb.stats()["l2"]
        kind = "format" if attack == "old_format" else "auth"
        assert l2["errors"] == {kind: 1} and l2["misses"] == 1 and l2["up"] is True
        assert _l2_errors_metric(b, kind) == 1.0
        assert r.get(_redis_key(cluster, target)) is None  # deleted
        assert cb.get(NS, [target[1:]]) == [None]  # never reached L1
        # The genuine objects still promote once the real state is there.
        assert set(_client(a).put(NS, items[-1:])) == {"stored"}
        wait_written(_client(a).stats, len(items))
        assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 3
        assert [bytes(x) for x in cb.get(NS, [i[:3] for i in items])] == [i[3] for i in items]


def test_keys_carry_the_namespace(cluster):
    """The same chunk hash under two namespaces: two keys in L2, each promoted to its own."""
    hashes = _hashes(2, seed=2)
    a_items, b_items = _objects(hashes), _objects(hashes)
    with _server(cluster) as a, _server(cluster) as b:
        c = _client(a)
        c.hello("model-b", 16)
        assert set(c.put(NS, a_items)) == {"stored"} and set(c.put("model-b", b_items)) == {"stored"}
        wait_written(c.stats, 2 * len(a_items))
        keys = sorted(k.decode() for k in _redis(cluster).keys("glmkv:*", target_nodes=RedisCluster.PRIMARIES))
        assert len(keys) == 6
        assert {k.split(":")[1] for k in keys} == {namespace_tag(NS), namespace_tag("model-b")}
        cb = _client(b)
        cb.hello("model-b", 16)
        for ns, items in ((NS, a_items), ("model-b", b_items)):
            assert cb.lookup(ns, hashes, [ATTN], [STATE])[0] == 2
            assert [bytes(x) for x in cb.get(ns, [i[:3] for i in items])] == [i[3] for i in items]
        # Clearing one namespace removes its keys from L2, not the other's.
        cb.clear("model-b")
        assert cb.stats()["l2"]  # the clear is queued behind the writes
        deadline = time.monotonic() + 60
        while len(_redis(cluster).keys("glmkv:*", target_nodes=RedisCluster.PRIMARIES)) != 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert all(namespace_tag(NS) in k.decode()
                   for k in _redis(cluster).keys("glmkv:*", target_nodes=RedisCluster.PRIMARIES))


def test_killed_server_loses_nothing_that_reached_l2_and_restarted_serves_from_it(cluster):
    hashes = _hashes(3, seed=3)
    items = _objects(hashes)
    a = _server(cluster)
    _store_through(a, items)
    a.kill()  # SIGKILL: L1 is gone
    restarted = _server(cluster, port=a.port)
    try:
        c = _client(restarted)
        assert c.stats()["objects"] == 0
        assert c.lookup(NS, hashes, [ATTN], [STATE])[0] == 3
        assert [bytes(x) for x in c.get(NS, [i[:3] for i in items])] == [i[3] for i in items]
    finally:
        restarted.stop()


def test_l1_evictions_are_served_again_from_l2(cluster):
    """An L1 of 1 MiB holds 2 prefixes of 5 x 100 kB; storing 6 evicts the first ones,
    which a lookup then gets back from L2 (written through when they were stored)."""
    prefixes = [_hashes(4, seed=10 + k) for k in range(6)]
    with _server(cluster, "--l1-size-gb", str(1 / 1024)) as a:
        c = _client(a)
        stored = {}
        for hashes in prefixes:
            items = _objects(hashes, size=100_000)
            stored[hashes[0]] = items
            assert set(c.put(NS, items)) == {"stored"}
        wait_written(c.stats, 30)
        stats = c.stats()
        assert stats["evictions"] >= 15
        first = prefixes[0]
        assert c.get(NS, [(first[0], ATTN, 0)]) == [None]  # gone from L1
        assert c.lookup(NS, first, [ATTN], [STATE])[0] == 4
        assert [bytes(x) for x in c.get(NS, [i[:3] for i in stored[first[0]]])] == [i[3] for i in stored[first[0]]]
        assert c.stats()["l2"]["hits"] == 1


def test_promotion_keeps_the_l1_objects_its_resume_goes_through(cluster):
    """A prefix whose state left L1 keeps its attention there as worthless leftovers (the
    first eviction candidates). Promoting the state from L2 into a full L1 must not evict
    those very objects to make room: the lookup resumes the whole prefix, and the
    room comes from another namespace's objects."""
    hashes = _hashes(4, seed=30)
    items = _objects(hashes, size=100_000)
    parents = [None, *hashes[:-1], hashes[-2]]
    # 600 KiB: six 100 kB objects fit, a seventh makes an eviction
    with _server(cluster, "--l1-size-gb", str(600 / 1024 / 1024)) as a:
        c = CacheClient(a.url, timeout_s=30)
        c.hello(NS, 16, 1, attn_groups=[ATTN], state_groups=[STATE])
        assert set(c.put(NS, items, parent=parents)) == {"stored"}
        wait_written(c.stats, len(items))
        assert c.request({"op": "delete", "ns": NS, "keys": [[hashes[-1], STATE, 0]]})[0]["removed"] == 1
        assert c.stats()["namespaces"][NS]["usable_prefixes"]["worthless_objects"] == 4
        # A delete reaches L2 too (queued after the answer: wait for it, or it could land after
        # the state is put back): then the state goes back there alone, as if L1 had evicted it.
        deadline = time.monotonic() + 60
        while wait_written(c.stats, len(items))["deleted_objects"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["l2"]["deleted_objects"] == 1
        state_key = (NS, hashes[-1], STATE, 0)
        _redis(cluster).set(_redis_key(cluster, state_key), _value(state_key, items[-1][3], parent=hashes[-2]))
        other = [(h, ATTN, 0, os.urandom(100_000)) for h in _hashes(2, seed=31)]
        assert set(c.put("model-b", other)) == {"stored"}
        wait_written(c.stats, len(items) + len(other))  # no L2 write in flight while the lookup evicts
        assert c.stats()["used_bytes"] == 600_000
        assert c.lookup(NS, hashes, [ATTN], [STATE], lease=False)[0] == 4
        stats = c.stats()
        assert stats["l2"]["promoted_objects"] == 1 and stats["evictions"] == 1
        assert [x is None for x in c.get("model-b", [o[:3] for o in other])].count(True) == 1
        c.close()


def test_corrupt_value_in_l2_is_refused_at_promotion(cluster):
    """A flipped byte in L2: promotion finds the MAC does not match, refuses the object
    (the lookup gets what the rest allows: here nothing, as the state is the flipped one),
    deletes the value and counts it."""
    hashes = _hashes(3, seed=4)
    items = _objects(hashes)
    with _server(cluster) as a, _server(cluster) as b:
        _store_through(a, items)
        r = _redis(cluster)
        state_key = _redis_key(cluster, (NS, hashes[-1], STATE, 0))
        value = bytearray(r.get(state_key))
        value[-7] ^= 0x10
        r.set(state_key, bytes(value))
        cb = _client(b)
        assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 0
        l2 = cb.stats()["l2"]
        assert l2["errors"] == {"auth": 1} and l2["misses"] == 1
        assert r.get(state_key) is None
        assert cb.get(NS, [(hashes[-1], STATE, 0)]) == [None]  # the corrupt bytes never reached L1


def test_store_killed_mid_promotion_is_a_miss_within_the_deadline():
    """SIGKILL every L2 node while B's promotion is under way (held there: the nodes are
    SIGSTOPped from before the lookup until the kill): the lookup answers a miss before its
    deadline (the store's error ends it, not the timeout), B keeps serving, and later
    lookups skip L2 (no new wait) until retry_after_s has passed."""
    hashes = _hashes(4, seed=5)
    items = _objects(hashes)
    cluster = start_cluster()  # its own: this test kills it
    try:
        with _server(cluster) as a:
            _store_through(a, items)
        with _server(cluster, query="?timeout_s=30&retry_after_s=300") as b:
            cb, watcher = _client(b), _client(b)
            answers: list[int] = []
            with _stopped(cluster):
                lookup = threading.Thread(target=lambda: answers.append(cb.lookup(NS, hashes, [ATTN], [STATE])[0]))
                lookup.start()
                # the promotion has begun; it cannot end while the store answers nothing
                _poll(lambda: watcher.stats()["l2"]["lookups"] == 1, "the promotion never began")
                assert lookup.is_alive() and not answers
                cluster.kill()
            lookup.join(60)
            assert answers == [0], answers
            l2 = watcher.stats()["l2"]
            assert l2["timeouts"] == 0 and sum(l2["errors"].values()) >= 1, l2  # the error, not the deadline
            assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 0
            l2 = cb.stats()["l2"]
            assert l2["lookups"] == 1 and l2["skipped"] == 1, l2  # skipped: L2 is marked down, no second wait
            assert l2["promoted_objects"] == 0 and l2["misses"] == 1 and not l2["up"]
            cb.ping()
    finally:
        cluster.stop()


def test_stalled_store_costs_at_most_the_timeout(cluster):
    """SIGSTOPped nodes accept connections but never answer: the lookup waits the deadline
    and not longer (it is answered from L1 while the store is still stopped)."""
    hashes = _hashes(2, seed=6)
    items = _objects(hashes)
    with _server(cluster, query="?timeout_s=0.5&retry_after_s=30") as a:
        _store_through(a, items)
        c = _client(a)
        longer = [*hashes, *_hashes(2, seed=7)]
        with _stopped(cluster):
            t0 = time.monotonic()
            assert c.lookup(NS, longer, [ATTN], [STATE])[0] == 2  # L1's answer, the store still stopped
            waited = time.monotonic() - t0
            assert set(c.put(NS, _objects(_hashes(2, seed=8)))) == {"stored"}  # stores never wait on L2
            l2 = c.stats()["l2"]
        assert l2["timeouts"] == 1 and l2["lookups"] == 1 and l2["promoted_objects"] == 0, l2
        assert waited >= 0.4, waited  # it did wait for L2 (a lower bound: a slow machine only adds)


def test_cluster_nodes_get_ports_whose_bus_port_exists(monkeypatch):
    """Redis puts a cluster node's bus on its port + 10000 and refuses ports above 55535 at
    start-up; the kernel hands out ephemeral ports up to 60999. Ports that high (here the
    first ones offered) are passed over for cluster nodes, kept for plain ones."""
    from testing import redis_nodes as l2_process

    offered = iter([60001, 58000, 41000, 60002, 42000, 43000, 44000])
    monkeypatch.setattr(l2_process, "free_port", lambda: next(offered))
    # Whether 51000.. are free on this machine is not this test's business.
    monkeypatch.setattr(l2_process, "bus_port_free", lambda port: True)
    nodes = l2_process.RedisNodes(3, cluster=True)
    try:
        assert nodes.ports == [41000, 42000, 43000]
    finally:
        nodes.stop()
    offered = iter([60001, 58000])
    plain = l2_process.RedisNodes(2, cluster=False)
    try:
        assert plain.ports == [60001, 58000]
    finally:
        plain.stop()


def test_a_cluster_node_whose_bus_port_is_taken_is_passed_over(monkeypatch):
    """A port whose bus port (port + 10000) another process holds is skipped: Redis would
    fail to start on it."""
    import socket

    from testing import redis_nodes as l2_process

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken_bus = held.getsockname()[1]
        if taken_bus - 10000 < 1024:
            pytest.skip("the kernel gave a bus port too low to pair with a node port")
        assert not l2_process.bus_port_free(taken_bus - 10000)
        offered = iter([taken_bus - 10000, 41001, 41002, 41003])
        monkeypatch.setattr(l2_process, "free_port", lambda: next(offered))
        real = l2_process.bus_port_free
        monkeypatch.setattr(l2_process, "bus_port_free",
                            lambda port: real(port) if port + 10000 == taken_bus else True)
        nodes = l2_process.RedisNodes(1, cluster=True)
        try:
            assert nodes.ports == [41001]
        finally:
            nodes.stop()


def test_the_store_password_and_the_l2_secret_never_reach_the_log_or_status(cluster):
    """A user and password the store refuses: the server logs the L2 errors it causes and
    shows L2 in /status, never the password nor the L2 secret."""
    password = "hunter2-Pa55word"
    url = cluster.url.replace("://", f"://glm:{password}@", 1)
    with ServerProcess("--separate-object-groups", "--chunk-size", "16", *l2_args(url + "?retry_after_s=0")) as a:
        c = _client(a)
        hashes = _hashes(2, seed=40)
        assert set(c.put(NS, _objects(hashes))) == {"stored"}
        assert c.lookup(NS, [*hashes, *_hashes(1, seed=41)], [ATTN], [STATE])[0] == 2
        deadline = time.monotonic() + 60
        while sum(c.stats()["l2"]["errors"].values()) < 1:  # the store refused the password: logged
            assert time.monotonic() < deadline, c.stats()["l2"]
            time.sleep(0.05)
        status = urllib.request.urlopen(a.http_url + "/status", timeout=30).read().decode()
        log = a.log()
    assert "L2 on redis+cluster://glm:***@" in log and re.search(r"L2 \w+ error", log), log
    assert password not in log and password not in status and ":***@" in status
    assert L2_SECRET not in log and L2_SECRET not in status


def test_an_l1_complete_lookup_never_waits_for_another_lookups_promotion(cluster):
    """B promotes one prefix from L2, held there for as long as the test needs (the store is
    SIGSTOPped: the promotion's round trip stays under way); meanwhile lookups of a prefix
    B's L1 holds in full, from another client, are answered, every one of them before the
    promotion ends: they wait neither for a lock nor behind the promotion on the worker it
    arrived at (the proxy deals requests round-robin). Without that they would wait out the
    promotion, which ends only when the store runs again."""
    slow, resident = _hashes(3, seed=50), _hashes(3, seed=51)
    slow_items, resident_items = _objects(slow), _objects(resident)
    with _server(cluster) as a, _server(cluster, query="?timeout_s=60") as b:
        _store_through(a, slow_items)
        cb, other = _client(b), _client(b)
        assert set(other.put(NS, resident_items)) == {"stored"}
        wait_written(other.stats, len(resident_items))  # no write in flight to the stopped store
        assert other.lookup(NS, resident, [ATTN], [STATE], lease=False)[0] == 3  # warm
        promoted: list[int] = []
        answered = 0
        with _stopped(cluster):
            thread = threading.Thread(target=lambda: promoted.append(
                cb.lookup(NS, slow, [ATTN], [STATE], lease=False)[0]))
            thread.start()
            _poll(lambda: other.stats()["l2"]["lookups"] == 1, "the promotion never began")
            for _ in range(20):  # several, so that they land on every worker of B's
                assert other.lookup(NS, resident, [ATTN], [STATE], lease=False)[0] == 3
                answered += 1
            still_held = thread.is_alive() and not promoted
            l2_meanwhile = other.stats()["l2"]
        thread.join(60)
        l2 = cb.stats()["l2"]
    assert answered == 20 and still_held, "the L1-complete lookups were answered only after the promotion"
    assert l2_meanwhile["timeouts"] == 0 and l2_meanwhile["promoted_objects"] == 0, l2_meanwhile
    assert promoted == [3] and l2["promoted_objects"] == len(slow_items) and l2["hits"] == 1, (promoted, l2)
    assert l2["lookups"] == 1 and l2["timeouts"] == 0, l2  # the L1-complete lookups never consulted L2


def test_concurrent_promotions_queue_each_within_its_deadline(cluster):
    """Two lookups that both need L2 at once (two clients, two prefixes, both promotions
    under way together: the store is SIGSTOPped until both have begun): the second queues
    behind the first on the reader instead of skipping L2, and both are answered in full
    within their own deadline."""
    prefixes = [_hashes(3, seed=60), _hashes(3, seed=61)]
    with _server(cluster) as a, _server(cluster, query="?timeout_s=60") as b:
        for hashes in prefixes:
            _store_through(a, _objects(hashes))
        clients = [_client(b), _client(b)]
        watcher = _client(b)
        answers: dict[int, int] = {}

        def lookup(i: int) -> None:
            answers[i] = clients[i].lookup(NS, prefixes[i], [ATTN], [STATE], lease=False)[0]

        threads = [threading.Thread(target=lookup, args=(i,)) for i in range(2)]
        with _stopped(cluster):
            for i, t in enumerate(threads):
                t.start()
                # begun, or skipped (the fault this test is for): counted either way
                l2 = _poll(lambda: (lambda l2: l2 if l2["lookups"] + l2["skipped"] == i + 1 else None)(
                    watcher.stats()["l2"]), f"lookup {i} never reached B")
                assert l2["skipped"] == 0, f"lookup {i} skipped L2 while another promotion was under way: {l2}"
            assert all(t.is_alive() for t in threads) and not answers, answers  # both under way at once
        for t in threads:
            t.join(60)
        l2 = watcher.stats()["l2"]
    assert answers == {0: 3, 1: 3}, answers
    assert (l2["lookups"], l2["hits"], l2["skipped"], l2["timeouts"]) == (2, 2, 0, 0), l2


def test_an_object_a_loader_deletes_is_deleted_from_l2_and_not_promoted_back(cluster):
    """A loader that finds an object's bytes do not match their checksum deletes it (the
    client's get does); the delete reaches L2, so neither this host's next lookup nor
    another host's promotes it back: it used to come back from L2 on every lookup."""
    hashes = _hashes(3, seed=40)
    items = _objects(hashes)
    state = (hashes[-1], STATE, 0)
    with _server(cluster, "--debug-fault-hooks") as a, _server(cluster) as b:
        _store_through(a, items)
        c = _client(a)
        assert c.request({"op": "debug_corrupt", "ns": NS, "keys": [list(state)]})[0]["corrupted"] is True
        assert c.get(NS, [state]) == [None] and c.corrupt_objects == 1  # found corrupt: deleted by the client
        assert c.lookup(NS, hashes, [ATTN], [STATE])[0] == 0  # at once: before the L2 delete is made, too
        l2 = wait_written(c.stats, len(items))
        assert l2["deleted_objects"] == 1 and l2["dropped_deletes"] == 0 and l2["promoted_objects"] == 0
        assert _redis(cluster).exists(_redis_key(cluster, (NS, *state))) == 0
        assert _redis(cluster).exists(_redis_key(cluster, (NS, hashes[0], ATTN, 0))) == 1  # only that one
        cb = _client(b)
        assert cb.lookup(NS, hashes, [ATTN], [STATE])[0] == 0
        assert cb.lookup(NS, hashes[:2], [ATTN], [])[0] == 2  # the rest still resumes through L2
        assert c.lookup(NS, hashes, [ATTN], [STATE])[0] == 0
        cb.close()
        c.close()


def test_a_delete_still_queued_or_made_during_a_promotion_is_not_promoted(cluster, monkeypatch):
    """In process, on the real store: a delete the writer has not made yet (held back here)
    keeps promotions from asking L2 for the key, and a promotion already fetching the key
    when the delete arrives does not put it into L1."""
    from cache_server import l2 as l2_module
    from cache_server.store import ObjectStore

    # The promotion's debug delay (between its EXISTS and GET) holds until the test lets it go.
    in_window, leave_window = threading.Event(), threading.Event()
    real_time = l2_module.time

    class HeldTime:
        def __getattr__(self, name):
            return getattr(real_time, name)

        @staticmethod
        def sleep(_seconds: float) -> None:
            in_window.set()
            leave_window.wait(60)

    monkeypatch.setattr(l2_module, "time", HeldTime())
    key = (NS, _hashes(1, seed=41)[0], ATTN, 0)
    payload = os.urandom(1000)
    config = L2Config.from_url(cluster.url + "?timeout_s=30&debug_promote_delay_s=0.5", allow_debug=True,
                               secret=L2_SECRET.encode())
    tier = L2Tier(config)
    try:
        tier.write(key, payload, p.checksum(payload, NS, key[1:]), None)
        assert tier.flush(60)
        release_writer = threading.Event()
        make_delete = tier.writer._delete_now
        tier.writer._delete_now = lambda client, keys: (release_writer.wait(60), make_delete(client, keys))

        # a promotion under way (between its EXISTS and GET) when the delete arrives
        store = ObjectStore(1 << 20, 1 << 20)
        promotion = tier.begin_promote(store, NS, [key[1]], [ATTN], [], 1, 0, [])
        assert promotion.future is not None
        assert in_window.wait(60), "the promotion never reached its GET"
        tier.delete([key])
        leave_window.set()
        promotion.future.result(timeout=60)
        assert len(promotion.results) == 1  # it fetched the value: the delete is not made yet
        assert tier.finish_promote(promotion) == (0, True) and key not in store

        # a lookup while the delete is still queued: L2 is not asked for it
        assert tier.promote(store, NS, [key[1]], [ATTN], [], 1, 0, []) == (0, True)
        assert key not in store
        release_writer.set()
        assert tier.flush(60)
        assert tier.snapshot()["deleted_objects"] == 1
        assert _redis(cluster).exists(redis_key(config.prefix, key)) == 0
    finally:
        leave_window.set()
        tier.close()


def test_the_writers_queue_is_bounded_in_items_not_only_bytes(cluster, monkeypatch):
    """While the store does not answer (SIGSTOPped), 5,000 one-byte writes arrive: far under
    the queue's bytes, but over its item cap (lowered to 1,000 here, 65,536 in the server).
    The queue stops at the cap and the rest are dropped ``queue_full``, as a flood of large
    objects would be; each write also counts its own bookkeeping against the bytes."""
    from cache_server import l2_writer

    monkeypatch.setattr(l2_writer, "MAX_QUEUE_ITEMS", 1000)
    config = L2Config.from_url(cluster.url + "?timeout_s=30", secret=L2_SECRET.encode())
    tier = L2Tier(config)
    try:
        with _stopped(cluster):
            keys = [(NS, (43 << 32 | i).to_bytes(32, "big"), ATTN, 0) for i in range(5000)]
            for key in keys:
                tier.write(key, b"x", p.checksum(b"x", NS, key[1:]), None)
            snap = tier.snapshot()
        dropped, queued = snap["dropped"].get("queue_full", 0), snap["queue_items"]
        assert queued <= 1000 and dropped >= 3000  # whenever the writer took its one batch, 1,000 at most
        in_flight = 5000 - queued - dropped  # that batch: its bytes count until it is written or dropped
        assert 0 <= in_flight <= 1000 and snap["queue_bytes"] == (queued + in_flight) * (1 + l2_writer.WRITE_ITEM_BYTES)
        assert snap["queue_bytes"] < config.queue_bytes // 100  # the bytes alone would have queued all
    finally:
        tier.close(flush_s=60)
