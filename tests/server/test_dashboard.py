"""docs/dashboards/glm-cache-server.json names only metrics that are really exported: the
server's, scraped from a real glm-cache-server (with an L2 tier, so its series exist), and the
engine's, built from connector/stats.py's definitions (``vllm:glm_cache_<name>`` counters)."""

from __future__ import annotations

import ast
import json
import re
import urllib.request
from pathlib import Path

import pytest

from cache_server.client import CacheClient
from testing.l2_fixtures import l2_args, require_store
from testing.redis_nodes import RedisNodes
from testing.server_process import ServerProcess
from validation.lmcache_dashboard import metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "dashboards" / "glm-cache-server.json"
STATS = ROOT / "connector" / "stats.py"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in the dashboard, rows' nested panels included."""
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in walk(doc["panels"]) for t in p.get("targets", [])]


def exported_names(text: str) -> set[str]:
    """Every sample name an exposition can carry: the samples present, and for each declared
    family the names of its type (a labelled family with no child yet has no sample)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                        "summary": ["_sum", "_count", "_created"]}.get(kind, [""])
            names.update(name + suf for suf in suffixes)
            if kind == "counter" and name.endswith("_total"):
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group())
    return names


def engine_names() -> set[str]:
    """What the connector makes vLLM export: one counter per ``COUNTERS`` entry of
    connector/stats.py, named as ``GlmCachePromMetrics`` names it (a Prometheus counter's
    samples end in _total). Read from the module's source (importing it imports vLLM: 25 s)."""
    tree = ast.parse(STATS.read_text())
    counters = next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name) and node.target.id == "COUNTERS")
    prom = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "GlmCachePromMetrics")
    template = re.search(r'name=f"([^"]+)"', ast.get_source_segment(STATS.read_text(), prom)).group(1)
    return {template.replace("{name}", name) + "_total" for name in counters}


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (le, op) (rate(glm_cache_request_seconds_bucket'
                        '{op="get"}[$__rate_interval])))') == {"glm_cache_request_seconds_bucket"}
    assert metric_names("sum(rate(vllm:glm_cache_saved_bytes_total[5m])) / 1e9 / glm_cache_used_bytes") == {
        "vllm:glm_cache_saved_bytes_total", "glm_cache_used_bytes"}


@pytest.fixture(scope="module")
def scraped() -> str:
    """The /metrics text of a real glm-cache-server with an L2 tier (so its series exist) after
    one namespace's hello, a stored chunk (an attention object and its state) and a lookup
    that hits it."""
    require_store()
    with RedisNodes(1, cluster=False, maxmemory_mb=32) as redis, \
            ServerProcess("--separate-object-groups", "--l1-size-gb", "0.05", *l2_args(redis.url)) as s, \
            CacheClient(s.url, timeout_s=10.0) as c:
        c.hello("dash-ns", 128, attn_groups=[0], state_groups=[1])  # usable-prefix series per namespace
        h = bytes(32)
        c.put("dash-ns", [(h, 0, 0, b"a" * 100), (h, 1, 0, b"s" * 10)], parent=[None, None])  # a first chunk: resumable
        c.lookup("dash-ns", [h], [0], [1], lease=False)
        with urllib.request.urlopen(s.http_url + "/metrics", timeout=5) as r:
            return r.read().decode()


def sample_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in an exposition."""
    return sum(float(line.rsplit(maxsplit=1)[1]) for line in text.splitlines()
               if re.match(rf"{re.escape(name)}(\{{| )", line))


def test_every_dashboard_query_names_an_exported_metric(scraped):
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    server = exported_names(scraped)
    engine = engine_names()
    assert "vllm:glm_cache_loaded_bytes_total" in engine and "glm_cache_resumable_states" in server
    unknown = {(title, name) for title, expr in exprs for name in metric_names(expr)
               if name not in server and name not in engine}
    assert not unknown, f"dashboard queries name metrics nobody exports: {sorted(unknown)}"
    # every series family it uses is one of ours or LMCache's name for one of ours
    used = {n for _, e in exprs for n in metric_names(e)}
    assert {n for n in used if n.startswith("lmcache_mp_")} and {n for n in used if n.startswith("vllm:")}
    assert all(n.startswith(("glm_cache_", "lmcache_mp_", "vllm:glm_cache_")) for n in used), used


# The usable-prefix row's panels and the series each plots (asked vs hit; held vs resumable).
USABLE_PREFIX_PANELS = {
    "Strict-prefix hit tokens vs tokens asked": ("lmcache_mp_lookup_requested_tokens_total",
                                                 "lmcache_mp_lookup_hit_tokens_total"),
    "Resumable vs held (chunks)": ("glm_cache_states_held", "glm_cache_resumable_states"),
}


def row_of(title: str) -> str:
    """The title of the row a panel sits under (Grafana lists a row, then its panels)."""
    row = ""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p.get("type") == "row":
            row = p["title"]
        if p.get("title") == title:
            return row
    raise KeyError(title)


@pytest.mark.parametrize("panel", list(USABLE_PREFIX_PANELS))
def test_usable_prefix_panels_plot_the_servers_series(panel, scraped):
    """Each usable-prefix panel sits in that row, plots exactly its two series, one query each,
    and the server exports both with data after a stored chunk was looked up and hit."""
    assert row_of(panel).startswith("Usable prefix")
    queries = [e for t, e in dashboard_exprs() if t == panel]
    assert [metric_names(e) for e in queries] == [{n} for n in USABLE_PREFIX_PANELS[panel]]
    for name in USABLE_PREFIX_PANELS[panel]:
        assert name in exported_names(scraped)
        assert sample_sum(scraped, name) > 0, f"{name} is exported but has no data after a hit"
