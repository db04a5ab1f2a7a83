"""LMCache's official Grafana dashboard (its panels and PromQL, tests/fixtures/lmcache_dashboard.json)
evaluated against a real glm-cache-server with a real Redis L2 after real client traffic
(validation/lmcache_dashboard.py): the panel list on docs/migrating-from-lmcache.md is this
run's, every panel that cannot show data says why, and the panels our LMCache-named series
feed do show data. No engine (about 5 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.l2_fixtures import require_store
from validation import lmcache_dashboard as dash

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-lmcache.md"


def _page_table() -> str:
    text = PAGE.read_text()
    return text.split("<!-- lmcache-dashboard -->\n", 1)[1].split("<!-- /lmcache-dashboard -->", 1)[0]


def test_query_classification():
    before = dash.parse('# TYPE a_total counter\na_total{x="1"} 1\n# TYPE g gauge\ng 0\n')
    after = dash.parse('# TYPE a_total counter\na_total{x="1"} 3\n# TYPE g gauge\ng 0\n')
    assert dash.query_status("rate(a_total[$__rate_interval])", before, after) == ("data", [])
    assert dash.query_status("rate(a_total[5m])", after, after) == ("flat", [])
    assert dash.query_status("g", before, after) == ("flat", [])
    assert dash.query_status('rate(a_total{x="2"}[1m])', before, after) == ("none", ["a_total"])
    assert dash.query_status("rate(a_total[1m]) / rate(b_total[1m])", before, after) == ("none", ["b_total"])
    assert dash.metric_names("sum by (service_instance_id) (rate(x_total[1m])) or vector(0)") == {"x_total"}


@pytest.fixture(scope="module")
def result():
    require_store()
    panels, l2 = dash.run()
    assert l2
    return panels


def test_the_pages_panel_list_is_this_runs(result):
    assert len(result) == len(list(dash.panels())) == 28
    assert _page_table() == dash.markdown(result), (
        "regenerate the page's table: python -m validation.lmcache_dashboard")


def test_every_panel_without_data_says_why(result):
    for p in result:
        assert "no reason recorded" not in p.why, (p.title, p.why)
        if p.status != "data":
            assert p.why, p.title


def test_our_lmcache_named_series_feed_their_panels(result):
    status = {p.title: p.status for p in result}
    for title in ("Failure Rates", "L1 Memory Usage", "L1 Cache Operations", "L1 IOPS", "Cache Hit Rate",
                  "Lookup & Engine Activity", "L2 Store Pipeline", "L2 Prefetch Pipeline", "L2 IOPS",
                  "L1 \u2194 L2 Throughput (GB/s)"):
        assert status[title] == "data", title
