"""LMCache's official Grafana dashboard against a real glm-cache-server: which panels show data.

The panels and PromQL of LMCache's published dashboard are in
``tests/fixtures/lmcache_dashboard.json`` (written down from LMCache's repository: lmcache-cli
does not install it). This starts a real glm-cache-server (with a Redis L2 tier when
redis-server is installed), drives traffic through our client (puts past the budget, so
evictions and L2 writes; lookups that hit, miss and promote from L2; salted lookups; reads of
present and absent objects; puts refused for room) while a real Prometheus
(:mod:`testing.prometheus`) scrapes its ``/metrics`` every second, and asks Prometheus each
panel's queries at the end of the run, ``$__rate_interval`` standing for the whole run:

- **data**: every series a query reads exists, and its answer is not 0 (a rate's counter grew,
  a gauge is not 0);
- **flat**: the series exist but the answer is 0 (or empty, or NaN) for every query;
- **none**: a series it reads is absent (Prometheus answers an empty vector for it: not exported
  here, ``cache_server.lmcache_compat.LEFT_OUT`` says why); a panel whose queries end in
  ``or vector(0)`` then still draws a flat 0.

``python -m validation.lmcache_dashboard`` prints the Markdown table the migration page carries;
``tests/server/test_lmcache_dashboard.py`` checks that the page's table is this run's."""

from __future__ import annotations

import fnmatch
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from cache_server.client import CacheClient
from cache_server.lmcache_compat import LEFT_OUT
from testing.prometheus import Prometheus
from testing.redis_nodes import RedisNodes, store_binaries
from testing.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

FIXTURE = ROOT / "tests" / "fixtures" / "lmcache_dashboard.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "vector"}
NS = "GLM-5-0123456789abcdef"  # as an engine names its namespace: <model>-<16 hex>
JOB = "glm-cache-server"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, label names or keywords)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", s)  # grouping labels
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        after = s[m.end():].lstrip()
        if m.group() in PROMQL_WORDS or after.startswith("("):
            continue
        if m.start() and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue  # the exponent of a number such as 1e9
        names.add(m.group())
    return names


def selectors(expr: str) -> dict[str, str]:
    """Each metric name ``expr`` reads -> the selector it is read with (``name{phase="staging"}``):
    Prometheus is asked about each alone, so a panel can say which series is absent, and why."""
    out = {}
    for name in metric_names(expr):
        m = re.search(r"(?<![A-Za-z0-9_:])" + re.escape(name) + r"(\{[^}]*\})?", expr)
        out[name] = name + ((m.group(1) or "") if m else "")
    return out


def query_status(prom: Prometheus, expr: str, at: float, window_s: int) -> tuple[str, list[str]]:
    """``data``, ``flat`` or ``none`` for one query as Prometheus answers it at ``at`` with
    ``$__rate_interval`` = ``window_s`` (the whole run), and the names it reads that are absent."""
    window = f"[{window_s}s]"
    missing = sorted(name for name, sel in selectors(expr).items()
                     if not prom.query(f"present_over_time({sel}{window})", at))
    if missing:
        return "none", missing
    answer = prom.query(expr.replace("[$__rate_interval]", window), at)
    values = [float(s["value"][1]) for s in answer]
    return ("data" if any(math.isfinite(v) and v != 0 for v in values) else "flat"), []


def reason(name: str) -> str | None:
    """Why ``name`` is not served here (:data:`LEFT_OUT`, keyed by glob patterns)."""
    for patterns, why in LEFT_OUT.items():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns.split()):
            return why
    return None


@dataclass
class Panel:
    row: str
    title: str
    status: str  # data, flat, none, traces
    why: str


def panels() -> Iterator[dict]:
    yield from json.loads(FIXTURE.read_text())["panels"]


def evaluate(prom: Prometheus, at: float, window_s: int) -> list[Panel]:
    """Every panel, from Prometheus's answers at ``at`` (see :func:`query_status`)."""
    out = []
    for p in panels():
        if not p["exprs"]:
            out.append(Panel(p["row"], p["title"], "none", "Tempo traces (TraceQL): no OpenTelemetry tracing here"))
            continue
        results = [query_status(prom, e, at, window_s) for e in p["exprs"]]
        statuses = {s for s, _ in results}
        status = "data" if "data" in statuses else "flat" if "flat" in statuses else "none"
        missing = sorted({n for _, names in results for n in names})
        whys = []
        for n in missing:
            why = reason(n) or f"{n}: not exported (no reason recorded)"
            if why not in whys:
                whys.append(why)
        why = "; ".join(whys)
        if status == "none" and all(e.rstrip().endswith("or vector(0)") for e in p["exprs"]):
            why += " (its `or vector(0)` draws a flat 0)"
        elif status != "none" and missing:
            why = "some queries: " + why
        out.append(Panel(p["row"], p["title"], status, why))
    return out


def drive(c: CacheClient, server: ServerProcess, l2: bool) -> None:
    """Traffic every panel we can serve has something to show from (after ``hello``)."""

    def prefix(seed: int, n: int) -> list[bytes]:
        return [(seed << 32 | i).to_bytes(32, "big") for i in range(n)]

    def store(hs: list[bytes], attn: int = 200_000, state: int = 50_000) -> list[str]:
        return c.put(NS, [(x, 0, 0, bytes(attn)) for x in hs] + [(hs[-1], 1, 0, bytes(state))])

    first = prefix(1, 3)
    store(first)
    for seed in range(2, 8):  # past the budget: evictions, and (with L2) writes there
        store(prefix(seed, 3))
    if l2:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not server.status()["l2"]["written_objects"]:
            time.sleep(0.05)
    c.lookup(NS, first, [0], [1], lease=False)  # evicted from L1: promoted from L2 when there is one
    last = prefix(7, 3)
    c.lookup(NS, last, [0], [1], lease=False, cache_salt="tenant-a")  # an L1 hit
    c.lookup(NS, prefix(99, 2), [0], [1], lease=False)  # a miss
    c.get(NS, [(last[0], 0, 0), (b"\x01" * 32, 0, 0)])  # a read and a read of an absent object
    hs = prefix(8, 4)
    store(hs)
    c.lookup(NS, hs, [0], [1])  # leased: held while the next put needs room
    c.put(NS, [(x, 0, 0, bytes(600_000)) for x in prefix(9, 2)])  # no room: allocation failures


def run() -> tuple[list[Panel], bool]:
    """Start a server (and Redis where it is installed) scraped by Prometheus, drive it, and
    evaluate every panel at the first scrape after the traffic, over a window back to before
    Prometheus started (so each rate sees the whole run)."""
    l2 = store_binaries() is not None
    with ExitStack() as stack:
        args = ["--separate-object-groups", "--l1-size-gb", "0.002", "--max-leased-fraction", "0.95",
                "--max-object-size-mb", "1"]
        if l2:
            redis = stack.enter_context(RedisNodes(1, cluster=False, maxmemory_mb=32))
            secret = stack.enter_context(_secret_file())
            args += ["--l2", redis.url, "--l2-secret-file", secret]
        server = stack.enter_context(ServerProcess(*args))
        t0 = time.time()
        prom = stack.enter_context(Prometheus({JOB: server.http_url}))
        c = stack.enter_context(CacheClient(server.url, timeout_s=10.0))
        # an engine's hello comes long before its traffic: the series it labels are scraped at 0 first
        c.hello(NS, 128, attn_groups=[0], state_groups=[1])
        prom.wait_scraped_after(JOB, time.time())
        drive(c, server, l2)
        at = prom.wait_scraped_after(JOB, time.time())
        return evaluate(prom, at, math.ceil(at - t0) + 1), l2


class _secret_file:
    def __enter__(self) -> str:
        import os
        import tempfile

        fd, self.path = tempfile.mkstemp(prefix="glm-l2-secret-")
        with os.fdopen(fd, "w") as f:
            f.write("lmcache-dashboard-run-l2-secret-0123456789\n")
        return self.path

    def __exit__(self, *exc: object) -> None:
        Path(self.path).unlink(missing_ok=True)


def markdown(result: list[Panel]) -> str:
    counts = {s: sum(p.status == s for p in result) for s in ("data", "flat", "none")}
    lines = [f"{counts['data']} of {len(result)} panels show data, {counts['flat']} are flat, "
             f"{counts['none']} cannot show data here.", "",
             "| row | panel | here | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {p.row} | {p.title} | {p.status} | {p.why} |" for p in result]
    return "\n".join(lines) + "\n"


def main() -> None:
    result, l2 = run()
    if not l2:
        print("(no redis-server on PATH: the L2 panels ran without an L2 tier)", file=sys.stderr)
    sys.stdout.write(markdown(result))


if __name__ == "__main__":
    main()
