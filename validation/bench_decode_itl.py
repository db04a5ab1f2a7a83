"""Decode under other requests' loads: does a decoding request's inter-token latency (ITL)
pay for reloads running for other requests?

    python -m validation.bench_decode_itl [--sizes 1024 4096 8000] [--reps 3] [--json]

One ``vllm serve`` of a small GLM-5.3-Flash checkpoint (random weights; ``--layers``, by
default 2 KDA + 8 sparse-MLA layers so a reload moves kilobytes per token, not hundreds of
bytes) with ``GlmCacheConnector`` and a real ``glm-cache-server`` (chunk = block = 128
tokens). The decode batch is held fixed: ``--decoders`` streamed completions of fresh
64-token prompts, ``--decode-tokens`` tokens each (``ignore_eos``). Once every decoder has
streamed a few tokens, ``--arrivals`` other requests of ``S`` prompt tokens are sent,
``--inflight`` at a time, one output token each; the decoders' token gaps that end between
the first arrival's send and the last arrival's answer are the window's ITL. Three
conditions per size, in a rotated order each repetition:

- ``none``: the decode batch alone (no arrivals): the floor;
- ``local``: the arrivals' prompts are in vLLM's own prefix cache (primed just before, no
  decoder running), so they prefill only their tail: what arrivals cost without any load;
- ``loads``: vLLM's prefix cache reset, the same arrivals resume from glm-cache-server: the
  same tail prefill (chunk = block, the same strict prefix), plus the loads.

``loads / local`` is what the loads cost the decode batch (goal: within 3%); ``loads /
none`` is what arrivals cost at all. The arrivals' prompts are stored once beforehand (a cold
run each, then the server's saves waited for). Loaded bytes, computed tokens and the CPU
time of the connector's load threads (``vllm:glm_cache_load_cpu_seconds_total``) and of its
hooks on the step's path (``..._step_cpu_seconds_total`` in the worker,
``..._scheduler_cpu_seconds_total`` in vLLM's scheduler), printed per arrival, are vLLM's
``/metrics`` deltas per condition, with ``glm-cache-server``'s process CPU time, so the loads,
the equal tail compute and what the loads took from the cores and from each step are shown,
not assumed.

ITL comes from the client's clock on the SSE stream (one event per token,
``--stream-interval`` 1), so it includes HTTP framing, the same in every condition. On 2
CPU cores the model's compute threads hold one core and everything else (vLLM's front end,
the connector's transfer threads, this client) shares the other; so does ``glm-cache-server``,
which is kept there (``--server-cpus transfer``, the connector's transfer CPUs from its
start-up line), as an operator keeps it off the model's cores: left where the kernel puts
it, it serves a load on the model's core part of the time. The last line is JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from testing.server_process import ServerProcess
from validation.serving import VllmServer, complete, connector_config, metric_sum, scrape_metrics

C = 128  # the checkpoint's block and the server's chunk
DECODER_PROMPT = 64
WARM_TOKENS = 4  # tokens every decoder streams before the arrivals start
COUNTERS = {
    "loaded_bytes": ("vllm:glm_cache_loaded_bytes_total", {}),
    "load_cpu_s": ("vllm:glm_cache_load_cpu_seconds_total", {}),
    "step_cpu_s": ("vllm:glm_cache_step_cpu_seconds_total", {}),
    "sched_cpu_s": ("vllm:glm_cache_scheduler_cpu_seconds_total", {}),
    "ext_hit": ("vllm:external_prefix_cache_hits_total", {}),
    "local_hit": ("vllm:prefix_cache_hits_total", {}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
}


def counters(base_url: str) -> dict[str, float]:
    samples = scrape_metrics(base_url)
    return {k: metric_sum(samples, name, **labels) for k, (name, labels) in COUNTERS.items()}


def stream_times(base_url: str, prompt: list[int], max_tokens: int, started: threading.Event | None = None,
                 times: list[float] | None = None) -> list[float]:
    """Stream a greedy completion; the client's time of each token's arrival."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    out = times if times is not None else []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[5:]).get("choices", []):
                out.extend([now] * max(1, len(choice.get("token_ids") or [])))
            if started is not None and len(out) >= WARM_TOKENS:
                started.set()
    return out


def transfer_cpus(vllm_log: Path) -> set[int] | None:
    """The CPUs of the connector's transfer threads, from its start-up line in vLLM's log
    (None: it did not place them)."""
    m = re.search(r"transfer threads on CPUs \[([\d, ]+)\]", vllm_log.read_text(errors="replace"))
    return {int(c) for c in m.group(1).split(",")} if m else None


def window_gaps(streams: list[list[float]], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive tokens of each stream whose later token came in [t0, t1]."""
    return [b - a for s in streams for a, b in zip(s, s[1:]) if t0 <= b <= t1]


def span_itl_ms(streams: list[list[float]], span: float) -> float:
    """The decoders' mean ITL over a fixed span from the arrivals' start: the span over the
    tokens each decoder streamed in it (times relative to that start). One span for every
    condition of a size (the longest arrivals window of any), so each counts the same
    arrivals' work and only what else slowed the steps differs; a longer window of the
    loads' would otherwise dilute the arrivals' prefills over more plain decode steps."""
    if any(st[-1] <= span for st in streams):
        raise RuntimeError("a decoder stopped inside the span: raise --decode-tokens")
    tokens = sum(1 for st in streams for t in st if 0 < t <= span)
    return 1e3 * span * len(streams) / tokens


def bootstrap_ci(values: list[float], level: float = 0.95, draws: int = 4000) -> list[float]:
    """A percentile bootstrap interval of the mean of ``values`` (fixed seed)."""
    rng = random.Random(1)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(draws))
    lo = int((1 - level) / 2 * draws)
    return [means[lo], means[draws - 1 - lo]]


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process, all its threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_condition(base_url: str, rng: random.Random, decoders: int, decode_tokens: int,
                  arrivals: list[list[int]], inflight: int, idle_window_s: float, server_pid: int) -> dict:
    """One decode batch, with ``arrivals`` sent once it streams (none: a window of
    ``idle_window_s``, measured from the same point)."""
    streams: list[list[float]] = [[] for _ in range(decoders)]
    warm = [threading.Event() for _ in range(decoders)]
    prompts = [[rng.randrange(8, 500) for _ in range(DECODER_PROMPT)] for _ in range(decoders)]
    before = counters(base_url)
    server_before = process_cpu_s(server_pid)
    with ThreadPoolExecutor(decoders + inflight) as pool:
        decs = [pool.submit(stream_times, base_url, p, decode_tokens, e, s) for p, e, s in zip(prompts, warm, streams)]
        for e in warm:
            if not e.wait(300):
                raise RuntimeError("a decoder never started streaming")
        t0 = time.perf_counter()
        ttfts: list[float] = []
        if arrivals:
            def one(prompt: list[int]) -> None:
                t = time.perf_counter()
                complete(base_url, prompt, max_tokens=1, top_logprobs=0)
                ttfts.append(time.perf_counter() - t)

            with ThreadPoolExecutor(inflight) as senders:
                list(senders.map(one, arrivals))
        else:
            time.sleep(idle_window_s)
        t1 = time.perf_counter()
        for d in decs:
            d.result()
    after = counters(base_url)
    server_cpu_s = process_cpu_s(server_pid) - server_before
    if min(len(s) for s in streams) < decode_tokens or any(s[-1] < t1 for s in streams):
        raise RuntimeError(f"the decode batch ended before the arrivals did: raise --decode-tokens "
                           f"(window {t1 - t0:.1f} s)")
    gaps = window_gaps(streams, t0, t1)
    run = [b - a for st in streams for a, b in zip(st[WARM_TOKENS:], st[WARM_TOKENS + 1:])]
    return {"window_s": t1 - t0, "gaps": len(gaps), "streams": [[t - t0 for t in st] for st in streams],
            # the whole decode run from the arrivals' start on: the same tokens in every condition
            "itl_mean_ms": 1e3 * statistics.fmean(run), "itl_p90_ms": 1e3 * statistics.quantiles(run, n=10)[-1],
            # the gaps that ended while arrivals were in flight
            "window_itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
            "arrival_ttft_ms": 1e3 * statistics.fmean(ttfts) if ttfts else 0.0, "server_cpu_s": server_cpu_s,
            **{k: after[k] - before[k] for k in after}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8000],
                    help="prompt tokens of each arrival (one table row per size)")
    ap.add_argument("--arrivals", type=int, default=32,
                    help="arriving requests per condition (32: a window of about 4-7 s, a third of the decode run)")
    ap.add_argument("--inflight", type=int, default=2, help="arrivals in flight at once")
    ap.add_argument("--decoders", type=int, default=4, help="requests in the fixed decode batch")
    ap.add_argument("--decode-tokens", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", default="LLIIIIIIII", help="layer types of the checkpoint (L: KDA, I: sparse MLA)")
    ap.add_argument("--server-cpus", choices=["transfer", "any"], default="transfer",
                    help="transfer: keep glm-cache-server on the CPUs of the connector's transfer threads (the "
                         "cores vLLM leaves to its front end), as an operator keeps it off the model's; any: "
                         "leave it where the kernel puts it")
    ap.add_argument("--checkpoint", help="use this checkpoint instead of writing one")
    ap.add_argument("--keep", type=Path, help="keep logs and the checkpoint in this directory")
    ap.add_argument("--json", action="store_true", help="last line: the results as JSON")
    args = ap.parse_args(argv)
    max_len = max(args.sizes) + 64
    if max_len > 8192:
        ap.error("--sizes: at most 8128 tokens (the checkpoint's 8192 positions)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-decode-itl-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        from glm5next_tiny import write_checkpoint

        ckpt = work / f"ckpt-{args.layers}"
        if not (ckpt / "model.safetensors").exists():
            print(f"writing a checkpoint with layers {args.layers} into {ckpt}", flush=True)
            write_checkpoint(ckpt, layer_types=args.layers, trained_mtp=False)
    rng = random.Random(0)
    started = time.perf_counter()
    rows: list[dict] = []
    with ExitStack() as stack:
        srv = stack.enter_context(ServerProcess("--separate-object-groups", "--l1-size-gb", "4",
                                                "--chunk-size", str(C), log_path=work / "server.log"))
        engine = VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", "2048", "--stream-interval", "1",
                            kv_transfer_config=connector_config(srv.url), max_model_len=max_len,
                            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, log_path=work / "vllm.log")
        stack.enter_context(engine)
        url = engine.base_url
        placed = transfer_cpus(work / "vllm.log") if args.server_cpus == "transfer" else None
        if placed:
            placed = srv.pin(placed)
        print(f"glm-cache-server on CPUs {sorted(placed) if placed else 'any'}", flush=True)
        for size in args.sizes:
            # distinct prompts (their first block differs), stored once: a cold run each
            arrivals = [[rng.randrange(8, 500) for _ in range(size)] for _ in range(args.arrivals)]
            for p in arrivals:
                complete(url, p, max_tokens=1, top_logprobs=0)
            time.sleep(2.0)  # the last saves land (asynchronous)
            per: dict[str, list[dict]] = {"none": [], "local": [], "loads": []}
            idle_window_s = 3.0  # the "none" window: the last local window once there is one
            order = ["local", "loads", "none"]
            for rep in range(args.reps):
                for cond in order[rep % 3:] + order[:rep % 3]:
                    if not engine.reset_prefix_cache():
                        raise RuntimeError("reset_prefix_cache refused (requests still running?)")
                    if cond == "local":
                        for p in arrivals:  # primed from the server, no decoder running
                            complete(url, p, max_tokens=1, top_logprobs=0)
                    res = run_condition(url, rng, args.decoders, args.decode_tokens,
                                        [] if cond == "none" else arrivals, args.inflight, idle_window_s,
                                        srv.proc.pid)
                    if cond == "local":
                        idle_window_s = res["window_s"]
                    per[cond].append(res)
                    print(f"  S={size} rep {rep} {cond:5s}: ITL mean {res['itl_mean_ms']:.2f} ms "
                          f"p90 {res['itl_p90_ms']:.2f}; in the window {res['window_itl_mean_ms']:.2f} over "
                          f"{res['gaps']} gaps, {res['window_s']:.2f} s; loaded {res['loaded_bytes'] / 2**20:.1f} MiB "
                          f"(connector CPU: load threads {1e3 * res['load_cpu_s']:.0f} ms, step hooks "
                          f"{1e3 * res['step_cpu_s']:.0f} ms, scheduler hooks {1e3 * res['sched_cpu_s']:.0f} ms; "
                          f"server {1e3 * res['server_cpu_s']:.0f} ms), "
                          f"external hits {res['ext_hit']:.0f}, local hits {res['local_hit']:.0f}, "
                          f"computed {res['computed']:.0f}", flush=True)
            span = max(r["window_s"] for c in ("local", "loads") for r in per[c])
            for runs in per.values():
                for r in runs:
                    r["span_itl_ms"] = span_itl_ms(r.pop("streams"), span)
            med = {c: {k: statistics.median(r[k] for r in v) for k in v[0]} for c, v in per.items()}
            paired = [a["span_itl_ms"] / b["span_itl_ms"] for a, b in zip(per["loads"], per["local"])]
            rows.append({"size": size, "median": med, "runs": per, "span_s": span,
                         "loads_vs_local": med["loads"]["itl_mean_ms"] / med["local"]["itl_mean_ms"],
                         "loads_vs_none": med["loads"]["itl_mean_ms"] / med["none"]["itl_mean_ms"],
                         "span_loads_vs_local_paired": paired,
                         "span_loads_vs_local_mean": statistics.fmean(paired),
                         "span_loads_vs_local_ci95": bootstrap_ci(paired)})
    elapsed = time.perf_counter() - started
    print()
    print(f"Decode ITL with other requests' loads in flight: {args.decoders} decoders x {args.decode_tokens} tokens, "
          f"{args.arrivals} arrivals per condition ({args.inflight} in flight), layers {args.layers}, chunk {C}; "
          f"glm-cache-server on CPUs {sorted(placed) if placed else 'any'}; medians of {args.reps} repetitions")
    print()
    print("| arrival prompt tokens | loaded per condition | CPU ms per arrival, loads: connector's load threads / "
          "step hooks / scheduler hooks / server (local: step / scheduler / server) | ITL mean ms: none / local / loads "
          "| ITL p90 ms: none / local / loads | loads / local | loads / none | arrival TTFT ms: local / loads |")
    print("|---|---|---|---|---|---|---|---|")
    def per_arrival(m: dict, key: str) -> float:
        return 1e3 * m[key] / args.arrivals

    for r in rows:
        m = r["median"]
        print(f"| {r['size']} | {m['loads']['loaded_bytes'] / 2**20:.1f} MiB | "
              f"{per_arrival(m['loads'], 'load_cpu_s'):.2f} / {per_arrival(m['loads'], 'step_cpu_s'):.2f} / "
              f"{per_arrival(m['loads'], 'sched_cpu_s'):.2f} / {per_arrival(m['loads'], 'server_cpu_s'):.2f} "
              f"({per_arrival(m['local'], 'step_cpu_s'):.2f} / {per_arrival(m['local'], 'sched_cpu_s'):.2f} / "
              f"{per_arrival(m['local'], 'server_cpu_s'):.2f}) | "
              f"{m['none']['itl_mean_ms']:.2f} / {m['local']['itl_mean_ms']:.2f} / {m['loads']['itl_mean_ms']:.2f} | "
              f"{m['none']['itl_p90_ms']:.2f} / {m['local']['itl_p90_ms']:.2f} / {m['loads']['itl_p90_ms']:.2f} | "
              f"{r['loads_vs_local']:.3f} | {r['loads_vs_none']:.3f} | "
              f"{m['local']['arrival_ttft_ms']:.0f} / {m['loads']['arrival_ttft_ms']:.0f} |")
    print()
    print("Over one span per size from the arrivals' start (the longest arrivals window of any condition), "
          "each loads run against the local run of its repetition:")
    print()
    print("| arrival prompt tokens | span s | span ITL ms: none / local / loads (medians) | loads / local per "
          "repetition | mean | 95% CI of the mean (bootstrap) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m, ci = r["median"], r["span_loads_vs_local_ci95"]
        print(f"| {r['size']} | {r['span_s']:.2f} | {m['none']['span_itl_ms']:.2f} / {m['local']['span_itl_ms']:.2f} / "
              f"{m['loads']['span_itl_ms']:.2f} | {', '.join(f'{x:.3f}' for x in r['span_loads_vs_local_paired'])} | "
              f"{r['span_loads_vs_local_mean']:.3f} | {ci[0]:.3f}-{ci[1]:.3f} |")
    print(f"\n{elapsed:.0f} s in all; logs in {work}")
    if args.json:
        print(json.dumps({"rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows],
                          "server_cpus": sorted(placed) if placed else None,
                          "args": vars(args) | {"keep": str(args.keep)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
