"""Render docs/dashboards/glm-cache-server.json's panels from a real run, without Grafana.

Starts a real glm-cache-server (with a one-node Redis L2 where redis-server is installed),
drives multi-turn conversations through our client for ``--seconds`` (lookups with leases,
gets of the hits, puts of each new turn's chunks and its state, a store small enough to
evict, and an L1-only clear half-way so later turns are answered from L2), scrapes /metrics
every ``--scrape-s`` seconds (and an engine's /metrics with ``--engine-metrics URL``), then
evaluates every panel's PromQL over the scraped samples with the small evaluator below
(selectors, rate/increase, sum/max/min by, histogram_quantile, arithmetic: what the
dashboard uses) and plots them with matplotlib::

    python -m validation.render_dashboard --with-engine --out docs/dashboards/glm-cache-server.png

``--with-engine`` also starts one ``vllm serve`` of the tiny checkpoint (``artifacts/glm5next-tiny``,
generated if missing) with GlmCacheConnector on the same server (chunk 128 = its block, a local
KV pool of ``--num-gpu-blocks-override 40`` blocks, ~1.8 documents, so vLLM's own prefix cache
cannot keep them) and, once it is ready, sends it long-document prompts for the same
``--seconds``: ``--docs`` live documents of ``--doc-tokens`` random token ids, asked in turn with
a fresh 16-token question each, each document retired after ``--asks`` questions and replaced by
a new one. The first question of a document is computed and saved; the later ones load it back
from the server (L1, or L2 after the half-way L1 clear). The engine's /metrics is scraped with
the server's (the ``Engine`` row). About 100 s on 2 cores (30 s of it vllm serve starting).

The picture is of scraped samples, not of Grafana; ``$__rate_interval`` is ``--window-s``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cache_server.client import CacheClient
from testing.redis_nodes import RedisNodes, store_binaries
from testing.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

DASHBOARD = ROOT / "docs" / "dashboards" / "glm-cache-server.json"
NS = "render-ns"
Labels = frozenset  # of (name, value) pairs
Vector = dict  # Labels -> float

# --- scraping -------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, dict[Labels, float]]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][frozenset(s.labels.items())] = s.value
    return out


# --- a PromQL subset ------------------------------------------------------------------------

TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:e\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<name>\$?[A-Za-z_:][A-Za-z0-9_:]*)'
                   r'|(?P<op>!=|[(){}\[\],/*+=-]))')


def tokenize(expr: str) -> list[str]:
    pos, out = 0, []
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            if expr[pos:].strip() == "":
                break
            raise ValueError(f"cannot parse {expr[pos:]!r}")
        out.append(m.group().strip())
        pos = m.end()
    return [t for t in out if t]


class Query:
    """One parsed expression, evaluated against a list of scrapes at a given index."""

    def __init__(self, expr: str, window_s: float) -> None:
        self.tokens = tokenize(expr)
        self.i = 0
        self.window_s = window_s
        self.tree = self._expr()
        if self.i != len(self.tokens):
            raise ValueError(f"trailing tokens in {expr!r}: {self.tokens[self.i:]}")

    # parser: nodes are tuples
    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self, want: str | None = None) -> str:
        tok = self.tokens[self.i]
        if want is not None and tok != want:
            raise ValueError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def _expr(self):
        node = self._mul()
        while self._peek() in ("+", "-"):
            node = ("bin", self._take(), node, self._mul())
        return node

    def _mul(self):
        node = self._unary()
        while self._peek() in ("*", "/"):
            node = ("bin", self._take(), node, self._unary())
        return node

    def _labels_list(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek() != ")":
            names.append(self._take())
            if self._peek() == ",":
                self._take()
        self._take(")")
        return names

    def _unary(self):
        tok = self._peek()
        if tok == "(":
            self._take()
            node = self._expr()
            self._take(")")
            return node
        if re.fullmatch(r"\d+(?:\.\d+)?(?:e\d+)?", tok):
            return ("num", float(self._take()))
        name = self._take()
        if name in ("sum", "max", "min", "avg"):
            by = self._labels_list() if self._peek() == "by" and self._take() else None
            self._take("(")
            inner = self._expr()
            self._take(")")
            if by is None and self._peek() == "by":
                self._take()
                by = self._labels_list()
            return ("agg", name, by or [], inner)
        if name in ("rate", "increase"):
            self._take("(")
            sel = self._selector(self._take())
            self._take(")")
            return ("range", name, sel)
        if name == "histogram_quantile":
            self._take("(")
            q = float(self._take())
            self._take(",")
            inner = self._expr()
            self._take(")")
            return ("hq", q, inner)
        return self._selector(name)

    def _selector(self, name: str):
        matchers = []
        if self._peek() == "{":
            self._take()
            while self._peek() != "}":
                label, op, value = self._take(), self._take(), json.loads(self._take())
                matchers.append((label, op, value))
                if self._peek() == ",":
                    self._take()
            self._take("}")
        if self._peek() == "[":
            self._take()
            while self._take() != "]":
                pass  # the range: --window-s stands for $__rate_interval
        return ("sel", name, tuple(matchers))

    # evaluation
    def at(self, scrapes: list[tuple[float, dict]], idx: int) -> Vector | float:
        return self._eval(self.tree, scrapes, idx)

    def _select(self, node, sample: dict) -> Vector:
        _, name, matchers = node
        out = {}
        for labels, v in sample.get(name, {}).items():
            d = dict(labels)
            if all((d.get(k, "") == val) == (op == "=") for k, op, val in matchers):
                out[labels] = v
        return out

    def _eval(self, node, scrapes, idx):
        kind = node[0]
        if kind == "num":
            return node[1]
        if kind == "sel":
            return self._select(node, scrapes[idx][1])
        if kind == "range":
            t_now, now = scrapes[idx]
            j = idx
            while j > 0 and t_now - scrapes[j - 1][0] <= self.window_s + 1e-6:
                j -= 1
            if j == idx:
                return {}
            t_then, then = scrapes[j]
            a, b = self._select(node[2], now), self._select(node[2], then)
            out = {}
            for labels, v in a.items():
                if labels in b:
                    d = max(0.0, v - b[labels])  # a counter reset would make this negative
                    out[labels] = d / (t_now - t_then) if node[1] == "rate" else d
            return out
        if kind == "agg":
            _, fn, by, inner = node
            vec = self._eval(inner, scrapes, idx)
            groups: dict[Labels, list[float]] = defaultdict(list)
            for labels, v in vec.items():
                groups[frozenset((k, val) for k, val in labels if k in by)].append(v)
            red = {"sum": sum, "max": max, "min": min, "avg": lambda xs: sum(xs) / len(xs)}[fn]
            return {labels: red(vs) for labels, vs in groups.items()}
        if kind == "hq":
            _, q, inner = node
            vec = self._eval(inner, scrapes, idx)
            series: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for labels, v in vec.items():
                d = dict(labels)
                le = float(d.pop("le"))
                series[frozenset(d.items())].append((le, v))
            out = {}
            for labels, buckets in series.items():
                buckets.sort()
                total = buckets[-1][1]
                if total <= 0:
                    continue
                rank, prev_le, prev_c = q * total, 0.0, 0.0
                for le, c in buckets:
                    if c >= rank:
                        out[labels] = prev_le if math.isinf(le) else prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
                        break
                    prev_le, prev_c = le, c
            return out
        if kind == "bin":
            _, op, left, right = node
            a, b = self._eval(left, scrapes, idx), self._eval(right, scrapes, idx)
            f = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
                 "/": lambda x, y: x / y if y else math.nan}[op]
            if isinstance(a, float) and isinstance(b, float):
                return f(a, b)
            if isinstance(b, float):
                return {k: f(v, b) for k, v in a.items()}
            if isinstance(a, float):
                return {k: f(a, v) for k, v in b.items()}
            return {k: f(v, b[k]) for k, v in a.items() if k in b}
        raise ValueError(node)


# --- traffic --------------------------------------------------------------------------------


def drive(server: ServerProcess, stop: threading.Event, seconds: float, seed: int = 0) -> dict[str, int]:
    """Multi-turn conversations: each turn looks its prefix up (strict prefix: the last,
    partial chunk is never asked), loads what hit, releases the lease and stores the turn's new
    chunks with the state at its end. New conversations start as old ones end."""
    rng = random.Random(seed)
    attn, state = 96 * 1024, 384 * 1024
    counts = defaultdict(int)
    t0 = time.monotonic()
    cleared = False
    with CacheClient(server.url, timeout_s=10.0) as c:
        c.hello(NS, 128, attn_groups=[0], state_groups=[1], group_names={0: "mla_latent", 1: "kda_state"})
        convs: list[list[bytes]] = []
        next_id = 0
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            if not cleared and time.monotonic() - t0 > seconds / 2:
                req = urllib.request.Request(server.http_url + "/cache/clear", method="POST",
                                             data=b'{"tier": "l1"}', headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=5).close()  # later turns come back from L2, if any
                cleared = True
            if len(convs) < 6 or rng.random() < 0.05:
                convs.append([])
                next_id += 1
            i = rng.randrange(len(convs))
            hashes = convs[i]
            chunks = 0
            if hashes:
                chunks, lease = c.lookup(NS, hashes, [0], [1])
                counts["lookups"] += 1
                if chunks:
                    c.get(NS, [(h, 0, 0) for h in hashes[:chunks]] + [(hashes[chunks - 1], 1, 0)])
                if lease is not None:
                    c.release(lease)
            new = [rng.randbytes(32) for _ in range(rng.randint(1, 4))]  # this turn's whole chunks
            full = hashes + new
            start = chunks  # what the engine recomputed (and saves) starts where the hit ended
            items = [(h, 0, 0, bytes(attn)) for h in full[start:]] + [(full[-1], 1, 0, bytes(state))]
            # each object names the chunk before its own (the server's chunk tree: usable
            # prefixes); the state, the state it follows on its path (then superseded)
            parents = [full[j - 1] if j else None for j in range(start, len(full))] + [
                full[-2] if len(full) > 1 else None]
            c.put(NS, items, prev=[None] * (len(items) - 1) + [hashes[-1] if hashes else None], parent=parents)
            counts["puts"] += 1
            convs[i] = full
            if len(full) > 40:
                convs.pop(i)
            time.sleep(0.02)
    return dict(counts)


def drive_engine(base_url: str, stop: threading.Event, seconds: float, doc_tokens: int, live: int, asks: int,
                 seed: int = 1) -> dict[str, int]:
    """Long-document questions through ``vllm serve``: ``live`` documents of ``doc_tokens`` random
    token ids asked round robin, each question a fresh 16-token suffix and 4 generated tokens;
    a document asked ``asks`` times is replaced by a new one (so saves go on as loads do)."""
    from validation.serving import complete

    rng = random.Random(seed)
    counts: dict[str, int] = defaultdict(int)
    docs = [[[rng.randrange(16, 500) for _ in range(doc_tokens)], 0] for _ in range(live)]
    t0 = time.monotonic()
    i = 0
    while not stop.is_set() and time.monotonic() - t0 < seconds:
        doc = docs[i % live]
        if doc[1] >= asks:
            doc[:] = [[rng.randrange(16, 500) for _ in range(doc_tokens)], 0]
            counts["documents"] += 1
        question = [rng.randrange(16, 500) for _ in range(16)]
        r = complete(base_url, doc[0] + question, max_tokens=4, timeout_s=120)
        doc[1] += 1
        counts["requests"] += 1
        counts["prompt_tokens"] += r.prompt_tokens
        counts["cached_tokens"] += r.cached_tokens
        i += 1
        time.sleep(0.2)
    counts["documents"] += live
    return dict(counts)


# --- plotting -------------------------------------------------------------------------------


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt)


def panels() -> list[dict]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def byte_axis(ax, unit: str) -> None:
    """A byte axis in the binary unit its top calls for (KiB under 2 MiB, ...), ticked at round
    numbers of that unit, as Grafana's ``bytes`` unit is."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

    lo, hi = ax.get_ylim()
    top = max(abs(lo), abs(hi))
    div, name = next(((d, n) for d, n in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if top >= 2 * d), (1, "B"))
    ticks = [t * div for t in MaxNLocator(nbins=6).tick_values(lo / div, hi / div) if lo <= t * div <= hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / div:g} {name}" + ("/s" if unit == "Bps" else "")))
    ax.set_ylim(lo, hi)


# what a panel that stays at 0 means (said under its title rather than left to look broken)
FLAT = {
    "Engine failures": "0 throughout: no load or save failed in this run (no fault was injected)",
    "L2 trouble": "0 throughout: no L2 write was dropped and L2 never erred in this run",
}


def render(scrapes: list[tuple[float, dict]], out: Path, window_s: float, note: str,
           subtitles: dict[str, str] | None = None) -> None:
    """``subtitles``: a line to print under a panel's title, by title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    sections: list[tuple[str, list[dict]]] = []
    for p in panels():
        if p["type"] == "row":
            sections.append((p["title"], []))
        else:
            if not sections:
                sections.append(("", []))
            sections[-1][1].append(p)
    slots: list[tuple[str, object]] = []
    for title, ps in sections:
        slots.append(("head", title))
        slots.extend(("panels", ps[k:k + 2]) for k in range(0, len(ps), 2))
    heights = [0.22 if kind == "head" else 1.0 for kind, _ in slots]
    fig = plt.figure(figsize=(15, 3.3 * sum(heights)))
    grid = fig.add_gridspec(len(slots), 2, height_ratios=heights, hspace=0.8, wspace=0.18,
                            top=1 - (0.45 + 0.2 * (note.count("\n") + 2)) / (3.3 * sum(heights)), bottom=0.01)
    t0 = scrapes[0][0]
    times = [t - t0 for t, _ in scrapes]
    placed = []
    for r, (kind, payload) in enumerate(slots):
        if kind == "head":
            ax = fig.add_subplot(grid[r, :])
            ax.axis("off")
            ax.text(0, 0.0, payload, fontsize=13, weight="bold", transform=ax.transAxes)
        else:
            placed.extend((fig.add_subplot(grid[r, c]), p) for c, p in enumerate(payload))
    for ax, p in placed:
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        drawn = 0
        peak = 0.0
        for target in p["targets"]:
            q = Query(target["expr"], window_s)
            series: dict[Labels, list[float]] = defaultdict(lambda: [math.nan] * len(scrapes))
            for i in range(len(scrapes)):
                v = q.at(scrapes, i)
                if isinstance(v, float):
                    v = {frozenset(): v}
                for labels, x in v.items():
                    series[labels][i] = x
            for labels, ys in sorted(series.items(), key=lambda kv: sorted(kv[0])):
                if all(math.isnan(y) for y in ys):
                    continue
                ax.plot(times, ys, label=legend(target.get("legendFormat", ""), labels), linewidth=1.4)
                drawn += 1
                peak = max([peak] + [abs(y) for y in ys if not math.isnan(y)])
        sub = (subtitles or {}).get(p["title"])
        if drawn and peak == 0:
            sub = FLAT.get(p["title"], "0 throughout: the event never happened in this run")
        if sub:
            ax.set_title(p["title"] + "\n", fontsize=10)
            ax.text(0.5, 1.02, sub, ha="center", va="bottom", fontsize=7.5, color="dimgray", style="italic",
                    transform=ax.transAxes)
        else:
            ax.set_title(p["title"], fontsize=10)
        ax.tick_params(labelsize=8)
        ax.set_xlabel("s", fontsize=8)
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit in ("bytes", "Bps"):
            byte_axis(ax, unit)
        elif unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:.2g} ms"))
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no samples in this run" + (" (needs vllm serve: --with-engine or --engine-metrics)"
                                                          if any("vllm:" in t["expr"] for t in p["targets"]) else ""),
                    ha="center", va="center", fontsize=9, color="gray", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    fig.suptitle("glm-cache-server dashboard, rendered from scraped /metrics samples (not Grafana)\n" + note,
                 fontsize=12, y=1.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboards" / "glm-cache-server.png"))
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=10.0, help="what $__rate_interval stands for")
    ap.add_argument("--l1-size-gb", default="0.03")
    ap.add_argument("--engine-metrics", default=None, help="an engine's /metrics URL to scrape too")
    ap.add_argument("--no-l2", action="store_true")
    ap.add_argument("--with-engine", action="store_true",
                    help="also run vllm serve (tiny checkpoint, GlmCacheConnector on this server) and send it traffic")
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--blocks", type=int, default=40, help="the engine's local KV pool (--num-gpu-blocks-override)")
    ap.add_argument("--doc-tokens", type=int, default=2500, help="the engine's documents' length in tokens")
    ap.add_argument("--docs", type=int, default=4, help="documents the engine is asked about at a time")
    ap.add_argument("--asks", type=int, default=3, help="questions per document before a new one replaces it")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="the server's --chunk-size (default 128 with --with-engine, the engine's block; else 256)")
    ap.add_argument("--dump", default=None, help="also write the scraped samples (JSON) here")
    ap.add_argument("--load", default=None, help="render samples written by --dump instead of running")
    args = ap.parse_args()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        scrapes = [(t, {n: {frozenset(map(tuple, labels)): v for labels, v in series} for n, series in sample.items()})
                   for t, sample in saved["scrapes"]]
        render(scrapes, Path(args.out), args.window_s, saved["note"], saved.get("subtitles"))
        print(f"wrote {args.out} from {args.load}")
        return
    redis = None
    engine = None
    extra = []
    scrapes: list[tuple[float, dict]] = []
    result: dict[str, int] = {}
    engine_result: dict[str, int] = {}
    chunk = args.chunk_size or (128 if args.with_engine else 256)
    t_start = time.monotonic()
    try:
        if not args.no_l2 and store_binaries() is not None:
            redis = RedisNodes(1, cluster=False, maxmemory_mb=128).start()
            secret = Path(ServerProcess().log_path.parent) / "l2-secret"
            secret.write_text("render-dashboard-l2-secret-0123456789abcdef\n")
            secret.chmod(0o600)
            extra = ["--l2", redis.url, "--l2-secret-file", str(secret)]
        with ServerProcess("--separate-object-groups", "--chunk-size", str(chunk), "--l1-size-gb", args.l1_size_gb,
                           *extra) as server:
            if args.with_engine:
                from glm5next_tiny import ensure_checkpoint
                from validation.serving import VllmServer, connector_config

                ckpt = ensure_checkpoint(Path(args.checkpoint))
                engine = VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", "2048",
                                    "--num-gpu-blocks-override", str(args.blocks),
                                    kv_transfer_config=connector_config(server.url), max_model_len=4096,
                                    env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
                engine.start()
                print(f"  vllm serve log: {engine.log_path}", flush=True)
                args.engine_metrics = engine.base_url + "/metrics"
            stop = threading.Event()
            workers = [threading.Thread(target=lambda: result.update(drive(server, stop, args.seconds)), daemon=True)]
            if engine is not None:
                workers.append(threading.Thread(target=lambda: engine_result.update(drive_engine(
                    engine.base_url, stop, args.seconds, args.doc_tokens, args.docs, args.asks)), daemon=True))
            for w in workers:
                w.start()
            t_end = time.monotonic() + args.seconds + args.scrape_s
            while time.monotonic() < t_end:
                sample = scrape(server.http_url + "/metrics")
                if args.engine_metrics:
                    for name, series in scrape(args.engine_metrics).items():
                        sample.setdefault(name, {}).update(series)
                scrapes.append((time.monotonic(), sample))
                time.sleep(args.scrape_s)
            stop.set()
            for w in workers:
                w.join(130)
    finally:
        if engine is not None:
            engine.stop()
        if redis is not None:
            redis.stop()
    note = (f"{args.seconds:.0f} s scraped every {args.scrape_s:g} s, rate window {args.window_s:g} s; "
            f"glm-cache-server: L1 {args.l1_size_gb} GB{', L2: one Redis node' if extra else ', no L2'}, "
            f"L1-only clear half-way\nCacheClient multi-turn conversations: {result.get('lookups', 0)} lookups, "
            f"{result.get('puts', 0)} puts")
    subtitles = {}
    if engine is not None:
        r = engine_result
        last = scrapes[-1][1] if scrapes else {}

        def total(name: str) -> float:
            return sum(last.get(name, {}).values())
        note += (f"\nvllm serve (tiny checkpoint, GlmCacheConnector, local pool {args.blocks} blocks of 128): "
                 f"{r.get('requests', 0)} questions on {r.get('documents', 0)} documents of {args.doc_tokens} tokens "
                 f"({args.docs} at a time, {args.asks} each)\nof its {total('vllm:prompt_tokens_total'):.0f} "
                 f"prompt tokens {total('vllm:external_prefix_cache_hits_total'):.0f} loaded from glm-cache-server, "
                 f"{total('vllm:prefix_cache_hits_total'):.0f} from its own prefix cache; "
                 f"{total('vllm:glm_cache_loaded_bytes_total') / 2**20:.1f} MiB loaded, "
                 f"{total('vllm:glm_cache_saved_bytes_total') / 2**20:.1f} MiB saved")
        subtitles["Objects: server served vs engine loaded"] = (
            "server served includes the CacheClient traffic's gets; the engine's loads are its own")
    if args.dump:
        Path(args.dump).write_text(json.dumps({"note": note, "subtitles": subtitles, "scrapes": [
            (t, {n: [(sorted(labels), v) for labels, v in series.items()] for n, series in sample.items()})
            for t, sample in scrapes]}))
    render(scrapes, Path(args.out), args.window_s, note, subtitles)
    print(f"{time.monotonic() - t_start:.0f} s in all; engine: {engine_result}")
    print(f"wrote {args.out}: {len(scrapes)} scrapes; {note}")


if __name__ == "__main__":
    main()
