"""LMCache's own tools against a real glm-cache-server: the ``lmcache`` CLI from PyPI
(``lmcache-cli``, a test dependency) run as a subprocess, and LMCache's Prometheus names on
/metrics checked against our own series after real traffic through our client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_server.client import CacheClient
from testing.l2_fixtures import l2_args, require_store, wait_written
from testing.redis_nodes import RedisNodes
from testing.server_process import ServerProcess

GIB = 1 << 30
MIB = 1 << 20
NS = "lmcache-cli-ns"
ALIGNMENT = 128  # the engine's block; the server's minimum (256) is a multiple: chunk 256
TOKEN = "lmcache-cli-test-token-0123456789"
CLI_ENV = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def lmcache_bin() -> str:
    """The ``lmcache`` entry point of this venv (scripts/setup.sh installs lmcache-cli)."""
    here = Path(sys.executable).with_name("lmcache")
    found = str(here) if here.exists() else shutil.which("lmcache")
    assert found, "lmcache-cli is not installed: run scripts/setup.sh (it is in glm5next-cache[test])"
    return found


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([lmcache_bin(), *args], capture_output=True, text=True, env=CLI_ENV, timeout=60)
    if check:
        assert out.returncode == 0, f"lmcache {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def cli_json(*args: str) -> dict:
    """``lmcache ... --format json``: its ``metrics`` object."""
    return json.loads(cli(*args, "--format", "json").stdout)["metrics"]


def http(url: str, method: str = "GET", token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            if s.name.startswith("lmcache_mp_") and s.labels and "l2_name" not in s.labels:
                # LMCache's labels (model_name, cache_salt; l1_tag, backend): the bare name sums them
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def store_prefix(c: CacheClient, n_chunks: int, attn_bytes: int, state_bytes: int, seed: int = 0) -> list[bytes]:
    """A prefix of ``n_chunks`` chunks: an attention object (group 0) each, a state (group 1)
    at the last; returns the chunk hashes."""
    hashes = [(seed << 32 | i).to_bytes(32, "big") for i in range(n_chunks)]
    c.put(NS, [(h, 0, 0, bytes(attn_bytes)) for h in hashes] + [(hashes[-1], 1, 0, bytes(state_bytes))])
    return hashes


SERVER_ARGS = ("--l1-size-gb", "1", "--chunk-size", "256", "--max-object-size-mb", "64")  # the server fixture's (conftest.py)


@pytest.fixture
def client(client):
    assert client.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])["chunk_size"] == 256
    return client


def test_ping_and_describe_show_the_servers_real_figures(server, client):
    assert cli_json("ping", "kvcache", "--url", server.http_url)["status"] == "OK"
    store_prefix(client, 4, 16 * MIB, 8 * MIB)  # 5 objects, 72 MiB
    status = http(server.http_url + "/status")[1]
    assert status["objects"] == 5 and status["used_bytes"] == 72 * MIB
    shown = cli_json("describe", "kvcache", "--url", server.http_url)
    assert shown == {
        "health": "OK", "url": server.http_url, "engine_type": "glm-cache-server", "chunk_size": 256,
        "l1_capacity_gb": 1.0, "l1_used_gb": f"{72 / 1024:.2f} ({72 / 1024 * 100:.1f}%)",  # "0.07 (7.0%)"
        "eviction_policy": "value", "cached_objects": 5,
        "active_sessions": None,  # LMCache's per-request sessions: this server has none (see the report)
    }
    # the terminal rendering an operator reads
    text = cli("describe", "kvcache", "--url", server.http_url).stdout
    assert "Cached objects:" in text and "N/A" in text.split("Active sessions:")[1]
    for label, value in (("Health:", "OK"), ("Chunk size:", "256"), ("L1 capacity (GB):", "1.00"),
                         ("L1 used (GB):", "0.07 (7.0%)"), ("Eviction policy:", "value"), ("Cached objects:", "5")):
        line = next(ln for ln in text.splitlines() if ln.startswith(label))
        assert line.endswith(" " + value), line
    # ours stay beside LMCache's
    assert status["storage_manager"]["l1_manager"]["total_object_count"] == status["objects"]
    assert status["capacity_bytes"] == GIB and "namespaces" in status and "config" in status


def test_kvcache_clear_empties_the_store(server, client):
    store_prefix(client, 3, MIB, MIB)
    assert cli_json("describe", "kvcache", "--url", server.http_url)["cached_objects"] == 4
    out = cli("kvcache", "clear", "--url", server.http_url).stdout  # POST /cache/clear {"tier": "l1"}
    assert any(ln.split() == ["Status:", "OK"] for ln in out.splitlines()), out
    assert client.stats()["objects"] == 0 and client.stats()["used_bytes"] == 0
    assert cli_json("describe", "kvcache", "--url", server.http_url)["cached_objects"] == 0
    # LMCache's older path and its body are served too, with its defaults (L1, not forced);
    # an unknown tier is refused by name
    store_prefix(client, 1, MIB, MIB)
    assert http(server.http_url + "/clear-cache", "POST") == (
        200, {"removed": 2, "status": "ok", "cleared": {"tier": "l1"}, "forced": False})
    code, err = http(server.http_url + "/cache/clear", "POST", body={"tier": "gpu"})
    assert code == 400 and "tier must be one of l1, l2, all" in err["error"]
    code, err = http(server.http_url + "/cache/clear", "POST", body={"tier": "l2"})
    assert code == 400 and "no L2 tier" in err["error"]


def test_quota_is_refused_by_name_and_conf_is_served(server, client):
    out = cli("quota", "list", "--url", server.http_url, check=False)
    assert out.returncode == 1 and "has no per-salt quotas" in out.stderr
    assert http(server.http_url + "/quota/some-salt", "PUT", body={"limit_gb": 1})[0] == 501
    code, conf = http(server.http_url + "/conf")
    assert code == 200 and http(server.http_url + "/config") == (200, conf)
    settings = conf["glm_cache_server"]
    assert settings["min_chunk_size"] == 256 and settings["l1_size_bytes"] == GIB
    assert settings["eviction_policy"] == "value" and settings["separate_object_groups"] is True
    assert settings["auth"] is False and "auth_token" not in settings and "l2_url" not in settings


def test_with_auth_the_cli_is_refused_where_a_token_is_needed():
    """lmcache-cli sends no Authorization header (it has no token option), so on a server
    started with --auth-token-file it can ping (/healthcheck is open) but not describe or
    clear; the same requests with the token succeed."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.1", auth_token=TOKEN) as s, \
            CacheClient(s.url, timeout_s=10.0, auth_token=TOKEN) as c:
        c.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        store_prefix(c, 2, 1000, 100)
        assert cli_json("ping", "kvcache", "--url", s.http_url)["status"] == "OK"
        out = cli("describe", "kvcache", "--url", s.http_url, check=False)
        assert out.returncode == 1 and "HTTP 401" in out.stderr
        out = cli("kvcache", "clear", "--url", s.http_url, check=False)
        assert out.returncode == 1 and "needs Authorization: Bearer" in out.stderr
        assert c.stats()["objects"] == 3  # refused: nothing cleared
        assert http(s.http_url + "/conf")[0] == 401
        code, status = http(s.http_url + "/status", token=TOKEN)
        assert code == 200 and status["storage_manager"]["l1_manager"]["total_object_count"] == 3
        assert http(s.http_url + "/conf", token=TOKEN)[1]["glm_cache_server"]["auth"] is True
        assert TOKEN not in json.dumps(http(s.http_url + "/conf", token=TOKEN)[1])
        assert http(s.http_url + "/cache/clear", "POST", token=TOKEN, body={"tier": "l1"})[1]["removed"] == 3
        assert c.stats()["objects"] == 0


def test_lmcache_metric_names_equal_our_series(server, client):
    """After real stores, lookups (hits, a miss, a start_chunk) and gets, each LMCache-named
    series equals what our own series (or the traffic itself) says."""
    before = scrape(server)
    hashes = store_prefix(client, 6, 4096, 1024)
    other = store_prefix(client, 2, 4096, 1024, seed=7)
    asked = [(hashes, 0), (hashes[:4], 0), (hashes, 2), (other, 0), ([b"\xff" * 32] * 3, 0)]  # the last misses
    answers = [client.lookup(NS, h, [0], [1], start_chunk=s, lease=False)[0] for h, s in asked]
    assert answers == [6, 0, 6, 2, 0]  # hashes[:4] has no state at chunk 3: no resume point
    client.get(NS, [(h, 0, 0) for h in hashes] + [(hashes[-1], 1, 0)])
    m = scrape(server)

    def delta(name: str) -> float:
        return m[name] - before.get(name, 0.0)

    chunk = 256
    assert delta("lmcache_mp_lookups_requests_total") == delta("glm_cache_lookups_total") == 5
    assert delta("lmcache_mp_lookup_requested_tokens_total") == sum(len(h) - s for h, s in asked) * chunk
    assert delta("lmcache_mp_lookup_hit_tokens_total") == delta("glm_cache_lookup_hit_chunks_total") * chunk \
        == (6 + 4 + 2) * chunk
    assert delta("lmcache_mp_lookup_hit_l1_tokens_total") == delta("lmcache_mp_lookup_hit_tokens_total")
    assert delta("lmcache_mp_lookup_hit_l2_tokens_total") == 0  # no L2 tier
    assert delta("lmcache_mp_l1_read_chunks_total") == delta("glm_cache_get_hits_total") == 7
    assert delta("lmcache_mp_l1_write_chunks_total") == delta("glm_cache_puts_stored_total") == 10
    assert m["lmcache_mp_l1_memory_usage_bytes"] == m["glm_cache_used_bytes"] == 8 * 4096 + 2 * 1024
    # LMCache's meaning: it evicts at 0.8 of its pool, we when the budget is full
    assert m["lmcache_mp_l1_usage_ratio"] == pytest.approx(0.8 * m["glm_cache_usage_ratio"])
    assert m["lmcache_mp_l1_evicted_chunks_total"] == m["glm_cache_evictions_total"]


def test_evictions_under_lmcache_name():
    """A store too small for what is put evicts: l1_evicted counts the same objects."""
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "0.004", "--max-object-size-mb", "1") as s, \
            CacheClient(s.url, timeout_s=10.0) as c:  # 4.3 MB
        c.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        for seed in range(12):
            store_prefix(c, 2, 256 * 1024, 64 * 1024, seed=seed)  # 576 KiB a prefix
        m = scrape(s)
        assert m["glm_cache_evictions_total"] > 0
        assert m["lmcache_mp_l1_evicted_chunks_total"] == m["glm_cache_evictions_total"]


def test_lookup_hits_split_by_tier_with_l2():
    """With an L2 tier, ``lmcache kvcache clear`` (tier l1, as LMCache's) empties L1 only; the
    next lookup is answered from L2, and the LMCache series put those tokens under _l2."""
    require_store()
    with RedisNodes(1, cluster=False, maxmemory_mb=64) as redis, \
            ServerProcess("--separate-object-groups", "--l1-size-gb", "0.1", *l2_args(redis.url)) as s, \
            CacheClient(s.url, timeout_s=10.0) as c:
        c.hello(NS, ALIGNMENT, attn_groups=[0], state_groups=[1])
        hashes = store_prefix(c, 3, 4096, 1024)
        wait_written(lambda: http(s.http_url + "/status")[1], 4)
        assert cli_json("describe", "kvcache", "--url", s.http_url)["cached_objects"] == 4
        cli("kvcache", "clear", "--url", s.http_url)
        assert c.stats()["objects"] == 0
        before = scrape(s)
        assert c.lookup(NS, hashes, [0], [1], lease=False)[0] == 3  # promoted from L2
        m = scrape(s)
        hit = m["lmcache_mp_lookup_hit_tokens_total"] - before["lmcache_mp_lookup_hit_tokens_total"]
        assert hit == 3 * 256
        assert m["lmcache_mp_lookup_hit_l2_tokens_total"] - before["lmcache_mp_lookup_hit_l2_tokens_total"] == hit
        assert m["lmcache_mp_lookup_hit_l1_tokens_total"] == before["lmcache_mp_lookup_hit_l1_tokens_total"]
        for ours, theirs in (("glm_cache_l2_written_objects_total", "lmcache_mp_l2_store_completed_objects_chunks_total"),
                             ("glm_cache_l2_lookups_total", "lmcache_mp_l2_prefetch_lookup_requests_total"),
                             ("glm_cache_l2_promoted_objects_total", "lmcache_mp_l2_prefetch_load_completed_chunks_total")):
            assert m[f'{theirs}{{l2_name="resp"}}'] == m[ours] > 0, (ours, theirs)
        # L2 throughput under LMCache's histogram names: one observation per write batch
        # and per promotion read batch, GB/s = bytes / the round trip's time
        for kind, op in (("store", "set"), ("load", "get")):
            name = f"lmcache_mp_l2_{kind}_throughput_GB_per_second"
            count = m[f'{name}_count{{l2_name="resp"}}']
            assert count == m[f'glm_cache_l2_request_seconds_count{{op="{op}"}}'] > 0, kind
            assert m[f'{name}_sum{{l2_name="resp"}}'] > 0
        l2 = http(s.http_url + "/status")[1]["storage_manager"]["l2_adapters"]
        assert l2 == [{"type": "resp", "is_healthy": True}]
