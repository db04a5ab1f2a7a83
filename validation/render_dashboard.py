"""Render docs/dashboards/glm-cache-server.json's panels from a real run, without Grafana.

Starts a real glm-cache-server (with a one-node Redis L2 where redis-server is installed),
drives multi-turn conversations through our client for ``--seconds`` (lookups with leases,
gets of the hits, puts of each new turn's chunks and its state, a store small enough to
evict, and an L1-only clear half-way so later turns are answered from L2) while a real
Prometheus (:mod:`testing.prometheus`) scrapes its /metrics every ``--scrape-s`` seconds (and
an engine's /metrics with ``--engine-metrics URL``), then asks Prometheus every panel's PromQL
over the run (``query_range``, a point per scrape interval) and plots its answers with
matplotlib::

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

The picture is of Prometheus's answers, not of Grafana; ``$__rate_interval`` is ``--window-s``.
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

from cache_server.client import CacheClient
from testing.prometheus import Prometheus
from testing.redis_nodes import RedisNodes, store_binaries
from testing.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

DASHBOARD = ROOT / "docs" / "dashboards" / "glm-cache-server.json"
NS = "render-ns"
SERVER_JOB, ENGINE_JOB = "glm-cache-server", "engine"
# a query's answer: [(labels, [(t, value), ...]), ...], one entry per series
Answer = list[tuple[dict[str, str], list[tuple[float, float]]]]

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


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


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


def ask(prom: Prometheus, start: float, end: float, step_s: float, window_s: float) -> dict[str, list[Answer]]:
    """Every panel's queries as Prometheus answers them over the run (``query_range`` at the
    scrape interval, ``$__rate_interval`` = ``window_s``): by panel title, one answer per target."""
    out = {}
    for p in panels():
        if p["type"] == "row":
            continue
        out[p["title"]] = [
            [(r["metric"], [(float(t), float(v)) for t, v in r["values"]])
             for r in prom.query_range(t["expr"].replace("$__rate_interval", f"{window_s:g}s"), start, end, step_s)]
            for t in p["targets"]]
    return out


def render(answers: dict[str, list[Answer]], start: float, out: Path, note: str,
           subtitles: dict[str, str] | None = None) -> None:
    """Plot :func:`ask`'s answers (times from ``start``); ``subtitles``: a line to print
    under a panel's title, by title."""
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
        for target, answer in zip(p["targets"], answers.get(p["title"], [])):
            for labels, points in sorted(answer, key=lambda s: sorted(s[0].items())):
                ys = [v for _, v in points]
                if all(math.isnan(y) for y in ys):
                    continue
                ax.plot([t - start for t, _ in points], ys, label=legend(target.get("legendFormat", ""), labels),
                        linewidth=1.4)
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
    fig.suptitle("glm-cache-server dashboard, drawn from Prometheus's answers to its queries (not Grafana)\n" + note,
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
    ap.add_argument("--dump", default=None, help="also write Prometheus's answers (JSON) here")
    ap.add_argument("--load", default=None, help="render answers written by --dump instead of running")
    args = ap.parse_args()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        render(saved["answers"], saved["start"], Path(args.out), saved["note"], saved.get("subtitles"))
        print(f"wrote {args.out} from {args.load}")
        return
    redis = None
    engine = None
    prom = None
    extra = []
    answers: dict[str, list[Answer]] = {}
    totals: dict[str, float] = {}
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
            targets = {SERVER_JOB: server.http_url, **({ENGINE_JOB: args.engine_metrics} if args.engine_metrics else {})}
            prom = Prometheus(targets, scrape_interval_s=args.scrape_s).start()
            for job in targets:
                prom.wait_scrapes(job, 1)
            start = time.time()
            stop = threading.Event()
            workers = [threading.Thread(target=lambda: result.update(drive(server, stop, args.seconds)), daemon=True)]
            if engine is not None:
                workers.append(threading.Thread(target=lambda: engine_result.update(drive_engine(
                    engine.base_url, stop, args.seconds, args.doc_tokens, args.docs, args.asks)), daemon=True))
            for w in workers:
                w.start()
            for w in workers:  # each stops after --seconds (an engine request in flight: up to 120 s more)
                w.join(args.seconds + 130)
            stop.set()
            t_end = time.time()
            end = max(prom.wait_scraped_after(job, t_end) for job in targets)
            answers = ask(prom, start, end, args.scrape_s, args.window_s)
            for name in ("vllm:prompt_tokens_total", "vllm:external_prefix_cache_hits_total",
                         "vllm:prefix_cache_hits_total", "vllm:glm_cache_loaded_bytes_total",
                         "vllm:glm_cache_saved_bytes_total"):
                totals[name] = prom.value(f"sum({name})", end) or 0.0
    finally:
        if prom is not None:
            prom.stop()
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
        total = totals.__getitem__
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
        Path(args.dump).write_text(json.dumps({"note": note, "subtitles": subtitles, "start": start,
                                               "answers": answers}))
    render(answers, start, Path(args.out), note, subtitles)
    print(f"{time.monotonic() - t_start:.0f} s in all; engine: {engine_result}")
    print(f"wrote {args.out}; {note}")


if __name__ == "__main__":
    main()
