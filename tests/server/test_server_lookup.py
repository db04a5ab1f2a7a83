"""Routers' queries (issue 33, item 2) against a real glm-cache-server process with a real
Redis L2: the resumable prefix in tokens per tier (``CPU`` = L1, ``L2``), over HTTP with the
token (``POST /query``, ``POST /query_by_hash``, the Mooncake KV Indexer RFC's shape) and over
the protocol (op ``query``). Objects are stored through the client exactly as the connector
names them: token-chain keys of :func:`cache_server.chunk_keys.chunk_hashes` (salted by the request's
cache salt), or :func:`cache_server.chunk_keys.block_hash_keys` of vLLM's block hashes; one object per
group (MLA latent 0, indexer 1 at every chunk; KDA state 2 at each chunk's end), with the
engine's layout and key scheme declared at hello as the connector declares them. What a real
engine's connector saves, queried the same way: ``test_connector_glm.py``."""

from __future__ import annotations

import http.client
import json
import os
import random
import time

import pytest

from cache_server import protocol as p
from cache_server.chunk_keys import block_hash_keys, chunk_hashes, parent_of
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from testing.l2_fixtures import l2_args, require_store, wait_written
from testing.redis_nodes import RedisNodes
from testing.server_process import ServerProcess

TOKEN = "router-query-token-0123456789"
C = 64  # --chunk-size; the hello's alignment (16) divides it
MODEL = "tiny-glm"
NS = f"{MODEL}-0123456789abcdef"  # a token-chain engine (chunk_keys lmcache)
NS_VLLM = "tiny-vllm-keys-fedcba9876543210"  # an engine keyed by vLLM's block hashes
SPAN = 16  # tokens per vLLM block hash there
ATTN, STATE = [0, 1], [2]
NAMES = {0: "mla_latent", 1: "indexer_cache", 2: "kda_state"}


@pytest.fixture(scope="module")
def redis():
    require_store()
    with RedisNodes(1, cluster=False, maxmemory_mb=64) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def server(redis):
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), *l2_args(redis.url),
                       auth_token=TOKEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = CacheClient(server.url, timeout_s=10.0, auth_token=TOKEN, shm=False)
    for ns, keys in ((NS, {"scheme": "lmcache", "lookahead": 0}),
                     (NS_VLLM, {"scheme": "vllm", "span": SPAN, "lookahead": 0})):
        hello = c.hello(ns, 16, 1, [], attn_groups=ATTN, state_groups=STATE, group_names=NAMES, chunk_keys=keys)
        assert hello["chunk_size"] == C
    yield c
    c.close()


def store(client: CacheClient, ns: str, keys: list[bytes], skip: set[tuple[int, int]] = frozenset()) -> None:
    """Every group's object at every chunk of ``keys``, but ``(chunk, group)`` in ``skip``."""
    items, parents = [], []
    for k, h in enumerate(keys):
        for g in (*ATTN, *STATE):
            if (k, g) not in skip:
                items.append((h, g, 0, os.urandom(256)))
                parents.append(parent_of(keys, k))
    assert set(client.put(ns, items, parent=parents)) == {"stored"}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_000) for _ in range(n)]


def post(server: ServerProcess, path: str, body: object, token: str | None = TOKEN,
         raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", path, body=data, headers=hdrs)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    except (ConnectionError, http.client.HTTPException):  # the server closed an oversized request
        return -1, {}
    finally:
        conn.close()


def entry(server: ServerProcess, body: dict, path: str = "/query", ns: str = NS) -> dict:
    status, doc = post(server, path, {"model": MODEL, **body})
    assert status == 200, doc
    return doc["default"][ns]


def status_doc(server: ServerProcess) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        conn.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def prompts(client, server):
    """A: 4 whole chunks + 10 tokens, all stored. B: the indexer object missing at chunk 2.
    S: stored under cache salt "tenant-a". V: vLLM-keyed, 3 chunks."""
    a, b, s = prompt(4 * C + 10, 1), prompt(4 * C, 2), prompt(3 * C, 3)
    store(client, NS, chunk_hashes(a, C))
    store(client, NS, chunk_hashes(b, C), skip={(2, 1)})
    store(client, NS, chunk_hashes(s, C, "tenant-a"))
    vllm_hashes = [os.urandom(32) for _ in range(3 * C // SPAN)]  # vLLM's sha256 block hashes
    store(client, NS_VLLM, block_hash_keys(vllm_hashes, C, SPAN, 0, 3))
    wait_written(lambda: status_doc(server), 4 * 3 + 4 * 3 - 1 + 3 * 3 + 3 * 3)
    return {"a": a, "b": b, "s": s, "v": vllm_hashes}


def test_full_hit_and_partial_last_chunk(server, prompts):
    """4 whole chunks resumable: 256 tokens in L1 and with L2; the 10 tokens of the partial
    last chunk never count, nor a chunk the query stops inside."""
    a = prompts["a"]
    assert entry(server, {"token_ids": a, "block_size": 16}) == {"longest_matched": 4 * C, "CPU": 4 * C,
                                                                 "STORAGE": 4 * C}
    assert entry(server, {"token_ids": a[:4 * C - 1]})["CPU"] == 3 * C
    assert entry(server, {"token_ids": a[:C - 1]}) == {"longest_matched": 0, "CPU": 0, "STORAGE": 0}


def test_group_missing_at_chunk_2_stops_at_chunk_1(server, prompts):
    """The indexer object of chunk 2 is missing: resumable through chunks 0 and 1 only (128
    tokens), though the latent and KDA state of chunks 2 and 3 are there."""
    assert entry(server, {"token_ids": prompts["b"]}) == {"longest_matched": 2 * C, "CPU": 2 * C, "STORAGE": 2 * C}


def test_salt(server, prompts):
    """A salt names another chain: the stored prompt under another salt, or without its own, is 0."""
    a, s = prompts["a"], prompts["s"]
    assert entry(server, {"token_ids": a, "cache_salt": "tenant-b"}) == {"longest_matched": 0, "CPU": 0, "STORAGE": 0}
    assert entry(server, {"token_ids": s})["longest_matched"] == 0
    assert entry(server, {"token_ids": s, "cache_salt": "tenant-a"})["CPU"] == 3 * C
    assert entry(server, {"token_ids": a, "lora_name": "sql-adapter"})["longest_matched"] == 0  # never cached


def test_protocol_op_answers_as_http(client, server, prompts):
    a = prompts["a"]
    got = client.query(MODEL, a)
    assert got == {"default": {NS: {"longest_matched": 4 * C, "CPU": 4 * C, "STORAGE": 4 * C}}}
    assert client.query(NS, a, tenant_id="t1")["t1"][NS]["CPU"] == 4 * C  # a whole namespace as the model
    assert client.query(MODEL, prompts["s"], cache_salt="tenant-a", instance_id=NS)["default"][NS]["CPU"] == 3 * C


def test_vllm_block_hashes(client, server, prompts):
    """A namespace keyed by vLLM's block hashes is asked with those hashes (hex in JSON);
    token ids cannot name its chunks, and the error says what to send."""
    v = prompts["v"]
    body = {"model": "tiny-vllm-keys", "seq_hashes": [h.hex() for h in v], "block_size": SPAN}
    status, doc = post(server, "/query_by_hash", body)
    assert status == 200 and doc == {"default": {NS_VLLM: {"longest_matched": 3 * C, "CPU": 3 * C, "STORAGE": 3 * C}}}
    assert post(server, "/query_by_hash", {**body, "seq_hashes": body["seq_hashes"][:-1]})[1]["default"][NS_VLLM][
        "CPU"] == 2 * C  # the last chunk's last block hash is not sent: that chunk has no key
    assert client.query("tiny-vllm-keys", block_hashes=v)["default"][NS_VLLM]["CPU"] == 3 * C
    status, doc = post(server, "/query", {"model": "tiny-vllm-keys", "token_ids": prompts["a"]})
    assert status == 400 and "seq_hashes" in doc["error"]
    status, doc = post(server, "/query_by_hash", {**body, "block_size": 32})
    assert status == 400 and "span" in doc["error"]
    status, doc = post(server, "/query_by_hash", {**body, "seq_hashes": [123456789]})
    assert status == 400 and "64-bit" in doc["error"]


def test_queries_lease_and_touch_nothing(server, prompts):
    before = status_doc(server)
    for _ in range(3):
        entry(server, {"token_ids": prompts["a"]})
    after = status_doc(server)
    assert after["active_leases"] == 0
    assert (after["lookups"], after["get_hits"]) == (before["lookups"], before["get_hits"])
    assert after["namespaces"][NS]["chunk_keys"] == {"scheme": "lmcache", "span": None, "lookahead": 0}
    assert after["namespaces"][NS_VLLM]["chunk_keys"] == {"scheme": "vllm", "span": SPAN, "lookahead": 0}


HOSTILE = [
    ({"token_ids": "abc"}, 400, "list"),
    ({"token_ids": [1, 2.5]}, 400, "token_ids[1]"),
    ({"token_ids": [1, True]}, 400, "token_ids[1]"),
    ({"token_ids": ["7"]}, 400, "token_ids[0]"),
    ({"token_ids": [5, -1]}, 400, "token_ids[1]"),
    ({"token_ids": [1 << 32]}, 400, "token_ids[0]"),
    ({"token_ids": [None]}, 400, "token_ids[0]"),
    ({"token_ids": list(range(p.MAX_QUERY_TOKENS + 1))}, 413, "maximum"),
    ({"token_ids": [1], "model": 5}, 400, "model"),
    ({"token_ids": [1], "model": ""}, 400, "model"),
    ({"token_ids": [1], "model": "no-such-model"}, 404, "no-such-model"),
    ({"token_ids": [1], "instance_id": "no-such-ns"}, 404, "no-such-ns"),
    ({"token_ids": [1], "cache_salt": {"x": 1}}, 400, "cache_salt"),
    ({"token_ids": [1], "block_size": -3}, 400, "block_size"),
    ({"token_ids": [1], "model": "m" * 10_000}, 400, "model"),
    ({}, 400, "token_ids"),
]


@pytest.mark.parametrize("body,code,says", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_http(server, prompts, body, code, says):
    status, doc = post(server, "/query", {"model": MODEL, **body})
    assert status == code and says in doc["error"], doc
    assert entry(server, {"token_ids": prompts["a"]})["CPU"] == 4 * C  # the server still answers


def test_hostile_http_bodies(server, prompts):
    assert post(server, "/query", {"model": MODEL, "token_ids": [1]}, token=None)[0] == 401
    assert post(server, "/query", {"model": MODEL, "token_ids": [1]}, token="wrong")[0] == 401
    assert post(server, "/query", None, raw=b"[1, 2, 3]")[0] == 400
    assert post(server, "/query", None, raw=b"{not json")[0] == 400
    assert post(server, "/query", None, raw=b'{"model": "x"}', headers={"Content-Type": "text/plain"})[0] == 415
    status, _ = post(server, "/query", None, raw=b" " * (6 << 20))  # over the 5 MiB body bound: refused unread
    assert status in (413, -1)
    assert entry(server, {"token_ids": prompts["a"]})["CPU"] == 4 * C


def test_hostile_protocol(client, prompts):
    def refused(header: dict) -> str:
        with pytest.raises(CacheServerError) as e:
            client.request({"op": "query", "model": MODEL, **header})
        return e.value.code

    assert refused({"token_ids": b"\x01\x02\x03"}) == "bad_request"  # not 4 bytes per id
    assert refused({"token_ids": b"\0" * 4 * (p.MAX_QUERY_TOKENS + 1)}) == "too_large"
    assert refused({"token_ids": [1, -2]}) == "bad_request"
    assert refused({"seq_hashes": [b"short"]}) == "bad_request"
    assert refused({"token_ids": [1], "model": "nope"}) == "unknown_model"
    assert refused({"model": MODEL}) == "bad_request"
    assert client.query(MODEL, prompts["a"])["default"][NS]["CPU"] == 4 * C


def test_100k_token_query(client, server, prompts):
    """A 100k-token prompt whose first 266 tokens are A's: A's 4 chunks, over both transports
    (its latency: validation/bench_lookup.py)."""
    tokens = prompts["a"] + prompt(100_000 - len(prompts["a"]), 9)
    assert client.query(MODEL, tokens)["default"][NS]["CPU"] == 4 * C
    assert entry(server, {"token_ids": tokens})["CPU"] == 4 * C


def test_l2_only(client, server, prompts):
    """L1 cleared (this namespace): CPU 0, yet L2 resumes the whole prefix; the query moves
    no byte (L1 still holds nothing afterwards), and the figures match what a lookup by an
    engine then resumes after promotion."""
    status, doc = post(server, f"/cache/clear?ns={NS}", {"tier": "l1", "force": True})
    assert status == 200 and doc["removed"] > 0
    a = prompts["a"]
    assert entry(server, {"token_ids": a}) == {"longest_matched": 4 * C, "CPU": 0, "STORAGE": 4 * C}
    assert entry(server, {"token_ids": prompts["b"]}) == {"longest_matched": 2 * C, "CPU": 0, "STORAGE": 2 * C}
    assert entry(server, {"token_ids": a, "cache_salt": "x"}) == {"longest_matched": 0, "CPU": 0, "STORAGE": 0}
    assert status_doc(server)["namespaces"][NS]["objects"] == 0  # nothing promoted by the queries
    chunks, lease = client.lookup(NS, chunk_hashes(a, C), ATTN, STATE, 1)
    assert chunks == 4
    client.release(lease)
    assert entry(server, {"token_ids": a})["CPU"] == 4 * C  # promoted by the engine's lookup, not by ours


def test_l2_hung_is_unknown_not_zero(server, redis, prompts, client):
    """A stopped Redis (SIGSTOP: connected, never answering): the query still answers L1,
    while the store is still stopped (the tier's 1 s timeout ends its wait: one L2 error),
    and leaves STORAGE out (unknown, not 0); the next query skips L2 at once (the tier is
    marked down for its retry_after_s: no second error from the stopped store)."""
    import signal

    proc = redis.procs[0]
    proc.send_signal(signal.SIGSTOP)
    try:
        before = client.stats()["l2"]
        got = entry(server, {"token_ids": prompts["b"]})  # L1 lacks chunk 2's indexer: L2 is asked
        first = client.stats()["l2"]
        again = entry(server, {"token_ids": prompts["b"]})
        second = client.stats()["l2"]
    finally:
        proc.send_signal(signal.SIGCONT)
    assert got == again == {"longest_matched": 0, "CPU": 0}  # B left L1 with test_l2_only's clear
    assert sum(first["errors"].values()) == sum(before["errors"].values()) + 1 and not first["up"], (before, first)
    assert second["errors"] == first["errors"], (first, second)  # skipped: the stopped store was not asked again


def test_a_query_held_by_a_stopped_store_holds_no_worker(redis, prompts):
    """A query waiting on L2 (the store SIGSTOPped, the tier's timeout 30 s) runs on the
    server's query thread: meanwhile every worker still answers an engine's gets (two for
    each of the four workers, which the proxy deals round-robin; one held by the query would
    wait 30 s), and the query is answered once the store answers again."""
    import signal
    import threading

    with ServerProcess("--separate-object-groups", "--chunk-size", str(C),
                       *l2_args(redis.url + "?timeout_s=30"), auth_token=TOKEN) as s, \
            CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN, shm=False) as router, \
            CacheClient(s.url, timeout_s=60.0, auth_token=TOKEN, shm=False) as engine:
        engine.hello(NS, 16, 1, [], attn_groups=ATTN, state_groups=STATE, group_names=NAMES,
                     chunk_keys={"scheme": "lmcache", "lookahead": 0})
        keys = chunk_hashes(prompts["b"], C)
        store(engine, NS, keys, skip={(2, 1)})  # L1 lacks chunk 2's indexer: a query asks L2
        answered: list = []
        redis.procs[0].send_signal(signal.SIGSTOP)
        try:
            t = threading.Thread(target=lambda: answered.append(router.query(MODEL, prompts["b"])), daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while status_doc(s)["queries"]["waiting"] == 0:  # on the query thread, blocked on the store
                assert time.monotonic() < deadline and t.is_alive(), "the query never reached the query thread"
                time.sleep(0.01)
            for _ in range(2 * status_doc(s)["config"]["workers"]):
                assert engine.get(NS, [(keys[0], 0, 0)])[0] is not None
            assert not answered and status_doc(s)["queries"]["waiting"] == 1  # all that while, still waiting
        finally:
            redis.procs[0].send_signal(signal.SIGCONT)
        t.join(60)
        assert answered and answered[0]["default"][NS]["CPU"] == 2 * C
