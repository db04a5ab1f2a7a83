"""LMCache's official Grafana dashboard (its panels and PromQL, tests/fixtures/lmcache_dashboard.json)
evaluated by a real Prometheus scraping a real glm-cache-server with a real Redis L2 through real
client traffic (validation/lmcache_dashboard.py): the panel list on docs/migrating-from-lmcache.md is this
run's, every panel that cannot show data says why, and the panels our LMCache-named series
feed do show data. No engine (about 20 s: Prometheus takes 5 s to first scrape a target)."""

from __future__ import annotations

import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testing.l2_fixtures import require_store
from testing.prometheus import Prometheus, PrometheusError, require_prometheus
from validation import lmcache_dashboard as dash

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lmcache.md"


def _page_table() -> str:
    text = PAGE.read_text()
    return text.split("<!-- lmcache-dashboard -->\n", 1)[1].split("<!-- /lmcache-dashboard -->", 1)[0]


class _Target:
    """A /metrics of our own (its text set by the test) for Prometheus to scrape."""

    def __init__(self, text: str) -> None:
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = target.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.text = text
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


def test_query_classification():
    """data / flat / none as Prometheus answers them, on series whose moves the test makes."""
    require_prometheus()
    target = _Target('# TYPE a_total counter\na_total{x="1"} 1\n# TYPE b_total counter\nb_total 5\n'
                     "# TYPE g gauge\ng 0\n")
    t0 = time.time()
    try:
        with Prometheus({"t": target.address}) as prom:
            prom.wait_scrapes("t", 2)
            target.text = target.text.replace('a_total{x="1"} 1', 'a_total{x="1"} 3')
            at = prom.wait_scraped_after("t", time.time())
            w = math.ceil(at - t0) + 1

            def status(expr: str) -> tuple[str, list[str]]:
                return dash.query_status(prom, expr, at, w)
            assert status("rate(a_total[$__rate_interval])") == ("data", [])
            assert status("rate(b_total[$__rate_interval])") == ("flat", [])
            assert status("g") == ("flat", [])
            assert status('rate(a_total{x="2"}[1m])') == ("none", ["a_total"])
            assert status("rate(a_total[1m]) / rate(c_total[1m])") == ("none", ["c_total"])
            assert status("sum(rate(c_total[$__rate_interval])) or vector(0)") == ("none", ["c_total"])
            assert prom.value("sum(a_total)", at) == 3
            assert [float(v) for _, v in prom.query_range("sum(a_total)", at - 1, at, 1)[0]["values"]][-1] == 3
            with pytest.raises(PrometheusError):
                prom.query("rate(")
    finally:
        target.server.shutdown()
    assert dash.metric_names("sum by (service_instance_id) (rate(x_total[1m])) or vector(0)") == {"x_total"}


@pytest.fixture(scope="module")
def result():
    require_store()
    require_prometheus()
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
