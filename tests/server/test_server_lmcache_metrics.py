"""LMCache 0.5.7's labels and failure counters on a real glm-cache-server's /metrics (issue 35,
item 4, server side): lookups by ``model_name`` and ``cache_salt`` (a keyed hash, never the
salt; both capped), L1 series by ``l1_tag`` / ``backend``, ``lmcache_mp_l1_allocation_failure``
and ``lmcache_mp_l1_read_failure`` under LMCache's names, and ``lmcache_mp_l1_usage_ratio``
with LMCache's meaning (at most its 0.8 eviction watermark) beside our own ratio.

Real server process, real sockets, our client; no engine (about 10 s)."""

from __future__ import annotations

import hashlib
import hmac
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_server.client import CacheClient, label_salt
from cache_server.metrics import MAX_MODEL_LABELS, MAX_SALT_LABELS, salt_label
from testing.server_process import ServerProcess

ENGINE_NS = "GLM-5-0123456789abcdef"  # as connector.namespace.engine_fingerprint names one: <model>-<16 hex>
OTHER_NS = "a-hand-made-namespace"
ALIGNMENT = 128
TOKEN = "lmcache-metrics-test-token-0123456789"
LOOKUP_NAMES = ("lmcache_mp_lookups_requests_total", "lmcache_mp_lookup_requested_tokens_total",
                "lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_hit_l1_tokens_total",
                "lmcache_mp_lookup_hit_l2_tokens_total")


def scrape(server: ServerProcess, token: str | None = None) -> list[tuple[str, dict[str, str], float]]:
    req = urllib.request.Request(server.http_url + "/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def samples(m, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted label pairs: value} of one sample name."""
    return {tuple(sorted(labels.items())): v for n, labels, v in m if n == name}


def value(m, name: str, **labels: str) -> float:
    return samples(m, name)[tuple(sorted(labels.items()))]


def hashes(seed: int, n: int) -> list[bytes]:
    return [(seed << 32 | i).to_bytes(32, "big") for i in range(n)]


def store_prefix(c: CacheClient, ns: str, hs: list[bytes], attn: int, state: int) -> None:
    c.put(ns, [(x, 0, 0, bytes(attn)) for x in hs] + [(hs[-1], 1, 0, bytes(state))])


def lookup(c: CacheClient, ns: str, hs: list[bytes], salt: str | None = None) -> int:
    """A lookup as the protocol carries it, with the optional ``cache_salt`` field."""
    header = {"op": "lookup", "ns": ns, "hashes": hs, "attn_groups": [0], "state_groups": [1],
              "world_size": 1, "start_chunk": 0, "lease": False}
    if salt is not None:
        header["cache_salt"] = salt
    return c.request(header)[0]["chunks"]


SERVER_ARGS = ("--l1-size-gb", "0.01", "--chunk-size", "256")  # the server fixture's (conftest.py)


@pytest.fixture
def client(client):
    for ns in (ENGINE_NS, OTHER_NS):
        assert client.hello(ns, ALIGNMENT, attn_groups=[0], state_groups=[1])["chunk_size"] == 256
    return client


def test_lookups_labelled_by_model_name_and_a_hashed_salt(server, client):
    before = scrape(server)
    hs = hashes(1, 4)
    store_prefix(client, ENGINE_NS, hs, 4096, 512)
    store_prefix(client, OTHER_NS, hs[:2], 4096, 512)
    assert lookup(client, ENGINE_NS, hs) == 4
    assert lookup(client, ENGINE_NS, hs, salt="tenant-a") == 4
    assert lookup(client, ENGINE_NS, hs, salt="tenant-a") == 4
    assert lookup(client, ENGINE_NS, hashes(9, 3), salt="tenant-b") == 0  # a miss
    assert lookup(client, OTHER_NS, hs[:2]) == 2
    m = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        return samples(m, name)[key] - samples(before, name).get(key, 0.0)

    a, b = salt_label("tenant-a"), salt_label("tenant-b")
    assert a != b and a.startswith("s") and len(a) == 11
    assert a == "s" + hmac.new(b"", b"cache_salt:tenant-a", hashlib.sha256).hexdigest()[:10]
    model = {"model_name": "GLM-5"}
    assert delta("lmcache_mp_lookups_requests_total", **model, cache_salt="none") == 1
    assert delta("lmcache_mp_lookups_requests_total", **model, cache_salt=a) == 2
    assert delta("lmcache_mp_lookups_requests_total", **model, cache_salt=b) == 1
    assert delta("lmcache_mp_lookups_requests_total", model_name="unknown", cache_salt="none") == 1
    assert delta("lmcache_mp_lookup_requested_tokens_total", **model, cache_salt=a) == 2 * 4 * 256
    assert delta("lmcache_mp_lookup_hit_tokens_total", **model, cache_salt=a) == 2 * 4 * 256
    assert delta("lmcache_mp_lookup_hit_l1_tokens_total", **model, cache_salt=a) == 2 * 4 * 256
    assert delta("lmcache_mp_lookup_hit_l2_tokens_total", **model, cache_salt=a) == 0
    assert delta("lmcache_mp_lookup_requested_tokens_total", **model, cache_salt=b) == 3 * 256
    assert delta("lmcache_mp_lookup_hit_tokens_total", **model, cache_salt=b) == 0
    assert delta("lmcache_mp_lookup_hit_tokens_total", model_name="unknown", cache_salt="none") == 2 * 256
    # the labelled series add up to our unlabelled count; every lookup series has both labels
    for name in LOOKUP_NAMES:
        assert all(dict(k).keys() == {"model_name", "cache_salt"} for k in samples(m, name)), name
    total = sum(samples(m, "lmcache_mp_lookups_requests_total").values())
    assert total == value(m, "glm_cache_lookups_total")
    # no salt in clear anywhere in the exposition
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "tenant-a" not in text and "tenant-b" not in text


def test_salt_and_model_labels_are_capped(server, client):
    hs = hashes(2, 2)
    store_prefix(client, ENGINE_NS, hs, 1024, 128)
    before = scrape(server)
    n_salts = MAX_SALT_LABELS + 8
    for i in range(n_salts):
        assert lookup(client, ENGINE_NS, hs, salt=f"capped-salt-{i}") == 2
    n_models = MAX_MODEL_LABELS + 4
    for i in range(n_models):  # lookups in namespaces never said hello to: counted, not in tokens
        lookup(client, f"model{i}-{i:016x}", hs)
    m = scrape(server)
    lookups = samples(m, "lmcache_mp_lookups_requests_total")
    salts = {dict(k)["cache_salt"] for k in lookups}
    models = {dict(k)["model_name"] for k in lookups}
    assert len(salts - {"other"}) == MAX_SALT_LABELS and "other" in salts
    assert len(models - {"other"}) == MAX_MODEL_LABELS and "other" in models
    assert sum(lookups.values()) - sum(samples(before, "lmcache_mp_lookups_requests_total").values()) \
        == n_salts + n_models
    assert sum(lookups.values()) == value(m, "glm_cache_lookups_total")


def test_l1_series_tagged_and_usage_ratio_with_lmcache_meaning():
    """A store filled past its budget evicts; our ratio then sits near 1.0 and LMCache's at
    0.8 x ours (LMCache evicts at 0.8 of its pool); the L1 series carry l1_tag and backend."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.004", "--max-object-size-mb", "1") as s, \
            CacheClient(s.url, timeout_s=10.0) as c:
        c.hello(ENGINE_NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        for seed in range(12):
            store_prefix(c, ENGINE_NS, hashes(seed, 2), 256 * 1024, 64 * 1024)  # 576 KiB a prefix
        c.get(ENGINE_NS, [(x, 0, 0) for x in hashes(11, 2)])
        m = scrape(s)
        tier = {"l1_tag": "_default", "backend": "dram"}
        ours = value(m, "glm_cache_usage_ratio")
        assert value(m, "glm_cache_evictions_total") > 0 and ours > 0.8
        assert value(m, "lmcache_mp_l1_usage_ratio", **tier) == pytest.approx(0.8 * ours)
        assert value(m, "lmcache_mp_l1_usage_ratio", **tier) <= 0.8
        assert value(m, "lmcache_mp_l1_memory_usage_bytes", **tier) == value(m, "glm_cache_used_bytes")
        tag = {"l1_tag": "_default"}
        assert value(m, "lmcache_mp_l1_evicted_chunks_total", **tag) == value(m, "glm_cache_evictions_total")
        assert value(m, "lmcache_mp_l1_write_chunks_total", **tag) == value(m, "glm_cache_puts_stored_total") == 36
        assert value(m, "lmcache_mp_l1_read_chunks_total", **tag) == value(m, "glm_cache_get_hits_total") == 2


def test_failure_counters_under_lmcache_names():
    """A get of absent objects is LMCache's l1_read_failure (not_found); a put refused because
    leased objects hold the budget is its l1_allocation_failure (l1_store); both by model_name,
    present at 0 from the hello on."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.001", "--max-leased-fraction", "0.95",
                       "--max-object-size-mb", "1") as s, CacheClient(s.url, timeout_s=10.0) as c:
        c.hello(ENGINE_NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        model = {"model_name": "GLM-5"}
        m = scrape(s)
        for name in LOOKUP_NAMES:  # present at 0 from the hello on, as the failure counters
            assert samples(m, name) == {(("cache_salt", "none"), ("model_name", "GLM-5")): 0}, name
        assert value(m, "lmcache_mp_l1_allocation_failure_chunks_total", during="l1_store", **model) == 0
        assert value(m, "lmcache_mp_l1_read_failure_chunks_total", during="l1_retrieve", reason="not_found",
                     **model) == 0
        hs = hashes(3, 4)
        store_prefix(c, ENGINE_NS, hs, 200_000, 50_000)  # 850 kB of a 1.07 MB budget
        assert c.lookup(ENGINE_NS, hs, [0], [1])[0] == 4  # leased: none of it can be evicted
        assert c.get(ENGINE_NS, [(hs[0], 0, 0), (b"\x01" * 32, 0, 0), (b"\x02" * 32, 0, 0)])[1:] == [None, None]
        results = c.put(ENGINE_NS, [(x, 0, 0, bytes(300_000)) for x in hashes(4, 2)])
        assert results.count("no_space") == 2, results
        m = scrape(s)
        assert value(m, "glm_cache_puts_no_space_total") == 2
        assert value(m, "lmcache_mp_l1_allocation_failure_chunks_total", during="l1_store", **model) == 2
        assert value(m, "glm_cache_get_misses_total") == 2
        assert value(m, "lmcache_mp_l1_read_failure_chunks_total", during="l1_retrieve", reason="not_found",
                     **model) == 2


def test_salt_label_is_keyed_by_the_servers_token():
    """With a token the salt's label is keyed by it: a scraper without the token cannot test a
    guessed salt against the label."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.01", auth_token=TOKEN) as s, \
            CacheClient(s.url, timeout_s=10.0, auth_token=TOKEN) as c:
        c.hello(ENGINE_NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        lookup(c, ENGINE_NS, hashes(5, 2), salt="tenant-a")
        lookups = {dict(k)["cache_salt"]: v for k, v in
                   samples(scrape(s, TOKEN), "lmcache_mp_lookups_requests_total").items()}
        keyed = salt_label("tenant-a", TOKEN.encode())
        assert lookups == {keyed: 1, "none": 0} and keyed != salt_label("tenant-a")


def test_clients_send_any_salt_without_failing_the_lookup():
    """Our client puts the request's salt in the lookup for the label; a salt over the
    protocol's limit or not plain UTF-8 (a client's, so hostile) travels as its SHA-256 and
    the lookup still answers. (Its own server: the module's has its salt labels capped.)"""
    long_salt, odd_salt = "x" * 5000, "tenant-\udc80"
    assert label_salt("tenant-c") == "tenant-c"
    assert label_salt(long_salt).startswith("sha256:") and label_salt(odd_salt) != label_salt(long_salt)
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.01") as s, \
            CacheClient(s.url, timeout_s=10.0) as c:
        c.hello(ENGINE_NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        hs = hashes(3, 2)
        store_prefix(c, ENGINE_NS, hs, 1024, 128)
        for salt in ("tenant-c", long_salt, odd_salt):
            assert c.lookup(ENGINE_NS, hs, [0], [1], lease=False, cache_salt=salt) == (2, None)
        lookups = {dict(k)["cache_salt"]: v for k, v in samples(scrape(s), "lmcache_mp_lookups_requests_total").items()}
    assert lookups == {"none": 0, **{salt_label(label_salt(x)): 1 for x in ("tenant-c", long_salt, odd_salt)}}
