"""Routing measured (issue 33, item 4): two ``vllm serve`` replicas, each with its own
glm-cache-server (as on separate hosts: no shared L2), behind a small router
(:mod:`validation.kv_router`), round robin against a router that asks each replica's
server ``POST /query`` how much of the prompt it can resume, on LMCache's multi-round-chat
workload (``lmcache bench engine --workload multi-round-chat`` pointed at the router).

    .venv/bin/python -m validation.bench_routing [--policies cache-aware,round-robin] [--blocks N]
    .venv/bin/python -m validation.bench_routing --smoke      # tiny sizes, to check the wiring

Each replica: the tiny GLM-5.3-Flash (``artifacts/glm5next-tiny``, float32, block 128) with
the CPU flags of the README (``--enforce-eager``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), prefix
caching on as operators run it, ``--prefix-cache-retention-interval 128`` and the connector's
``save_decode`` (so a conversation's next turn resumes after the previous answer), and
``chunk_keys: lmcache`` (token-chain keys: the router sends token ids to ``/query``; with
vLLM's block-hash keys it would send vLLM's hashes to ``/query_by_hash``). Each server:
``--separate-object-groups --chunk-size 128 --l1-size-gb 1``, no L2. ``--blocks N`` shrinks
vLLM's local pool (``--num-gpu-blocks-override``) so vLLM's own prefix cache evicts and
the hits come from the server; by default the pool holds the whole workload, and the hits a
replica finds are then mostly local (vLLM's prefix cache) rather than from its server: both
are reported, and either only exists on the replica that computed the prefix.

The workload (sizes in the tool's *words*: a ``help`` is 4 tokens, a ``hi`` 2, a ``tell``
1 on this tokenizer): 5 sessions (odd, so round robin alternates each session between the
replicas; with an even count it would pin session s to replica s mod 2), each its own
system prompt and pre-filled history, one 1-token warm-up request per session, then 1
request/s round robin over the sessions, each the whole conversation so far plus a
``tell``-turn, ``--ignore-eos`` answers. Between policies both engines' prefix caches are
reset (``/reset_prefix_cache``) and both servers cleared (``/cache/clear``, forced).

Per policy, printed side by side: requests; TTFT mean and p99, the tool's own
(``bench_summary.json``, measured requests only) and as served at the router (all requests
with usage, warm-ups included: cache-aware from receipt, its scoring included; round robin
from the forward to the engine, without the probe that only measures it, which the tool's
figure includes); the cached prompt tokens vLLM reports per request (usage
``cached_tokens``, as the router saw them) and vLLM's ``/metrics`` split of them over both
replicas: local prefix-cache hits and external hits (loaded from the replica's server);
the servers' lookup hit tokens (``lmcache_mp_lookup_hit_tokens_total``, both servers);
*reusable*: per request, the longest prefix any replica's server could resume at routing
time (``/query`` ``CPU``, capped at whole chunks before the last prompt token), summed;
*routed to*: the same on the replica chosen; *captured*: cached tokens over reusable; and
the router's cost per request (tokenize and ask both servers, ms, mean and p99; timed again
with the engines idle after the run). The host's load average
is printed with the table: other engines share the 2 cores.

Measured (docs/benchmarks.md, "Routing"; 300-340 s a run on 2 cores at load average 7-15):
cache-aware captured 100% of the reusable prefix, round robin 81% (default pool) and 76%
(``--blocks 24 --max-model-len 2048``), and every request's cached tokens equalled what the
chosen replica's server answered at routing time; TTFT differed by 1-11% (queueing on the
loaded cores dominates the tiny model's prefill); scoring cost 14-22 ms a request with the
engines idle, 47-186 ms (means) beside them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from testing.server_process import ServerProcess
from validation.kv_router import POLICIES, Replica, Router, Tokenizer
from validation.serving import VllmServer, connector_config, metric_sum, scrape_metrics

ROOT = Path(__file__).resolve().parents[1]

C = 128
MAX_MODEL_LEN = 4096
ENGINE_COUNTERS = [
    ("prompt", "vllm:prompt_tokens_total", {}),
    ("computed", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("local_hit", "vllm:prefix_cache_hits_total", {}),
    ("ext_hit", "vllm:external_prefix_cache_hits_total", {}),
]
SERVER_COUNTERS = [("server_hit", "lmcache_mp_lookup_hit_tokens_total", {})]


def workload(smoke: bool, duration: int = 40) -> list[str]:
    """``lmcache bench engine`` arguments: 5 sessions (see the module docstring)."""
    users, sys_words, hist_words, user_words, out = 5, 100, 150, 100, 32
    if smoke:
        users, sys_words, hist_words, user_words, out, duration = 3, 40, 40, 20, 4, 4
    return ["--workload", "multi-round-chat", "--kv-cache-volume", "1",
            "--tokens-per-gb-kvcache", str(users * (sys_words + hist_words)),
            "--mrc-shared-prompt-length", str(sys_words), "--mrc-chat-history-length", str(hist_words),
            "--mrc-user-input-length", str(user_words), "--mrc-output-length", str(out),
            "--mrc-qps", "1", "--mrc-duration", str(duration)]


def lmcache_cmd(url: str, args: list[str], out_dir: Path) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
    return [exe, "bench", "engine", "--engine-url", url, "--model", "model", *args, "--seed", "42",
            "--ignore-eos", "--no-interactive", "--json", "--output-dir", str(out_dir), "-q"]


def counters(engines: list[VllmServer], servers: list[ServerProcess]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url, table in [(e.base_url, ENGINE_COUNTERS) for e in engines] + [(s.http_url, SERVER_COUNTERS)
                                                                           for s in servers]:
        samples = scrape_metrics(url)
        for label, name, labels in table:
            out[label] = out.get(label, 0.0) + metric_sum(samples, name, **labels)
    return out


def clear(engines: list[VllmServer], servers: list[ServerProcess]) -> None:
    for e in engines:
        assert e.reset_prefix_cache(), "reset_prefix_cache refused"
    for s in servers:
        req = urllib.request.Request(s.http_url + "/cache/clear", data=b'{"tier": "l1", "force": true}',
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else 0.0


def run_policy(policy: str, engines: list[VllmServer], servers: list[ServerProcess], tokenize: Tokenizer,
               query_model: str, args: list[str], work: Path) -> dict[str, Any]:
    clear(engines, servers)
    time.sleep(1.0)  # the engines' idle steps publish the clear; nothing in flight
    out_dir = work / policy
    out_dir.mkdir(parents=True, exist_ok=True)
    replicas = [Replica(e.base_url, s.http_url) for e, s in zip(engines, servers)]
    before = counters(engines, servers)
    load0 = os.getloadavg()[0]
    with Router(replicas, policy, tokenize, query_model, C) as router:
        cmd = lmcache_cmd(router.url, args, out_dir)
        print(f"[{policy}] {shlex.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"})
        (out_dir / "lmcache.log").write_text(proc.stdout)
        if proc.returncode != 0 or not (out_dir / "bench_summary.json").exists():
            raise RuntimeError(f"lmcache bench engine exited {proc.returncode}:\n{proc.stdout[-4000:]}")
        time.sleep(0.5)
        routes = router.records()
        idle_ms = router.time_scoring(20)  # the last request's scoring again, the engines idle
    after = counters(engines, servers)
    load1 = os.getloadavg()[0]
    (out_dir / "routes.json").write_text(json.dumps(routes, indent=1))
    res = json.loads((out_dir / "bench_summary.json").read_text())["results"]
    ok = [r for r in routes if r["status"] == 200]
    reusable = sum(max(max(r["held"]), 0) for r in ok)
    routed = sum(max(r["held"][r["replica"]], 0) for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    unanswered = sum(1 for r in routes for h in r["held"] if h < 0)
    mismatched = sum(1 for r in ok if r["prompt_tokens"] is not None and r["tokens"] != r["prompt_tokens"])
    path_ms = [r["score_ms"] for r in ok]
    # as served: cache-aware from receipt (its scoring included); round robin from the forward
    # (its measuring probe excluded, as round robin without it would serve)
    served = [r["ttft_ms"] if policy == "cache-aware" else r["forward_ttft_ms"] for r in ok
              if r["ttft_ms"] is not None and r["prompt_tokens"] is not None]
    row = {"policy": policy, "requests": res["successful_requests"], "failed": res["failed_requests"],
           "routed_requests": len(routes), "ttft_mean_ms": res["mean_ttft_ms"], "ttft_p50_ms": res["p50_ttft_ms"],
           "ttft_p99_ms": res["p99_ttft_ms"], "cached": cached, "reusable": reusable, "routed_to": routed,
           "per_replica": [sum(1 for r in routes if r["replica"] == i) for i in range(len(replicas))],
           "score_ms_mean": statistics.fmean(path_ms) if path_ms else 0.0, "score_ms_p99": p99(path_ms),
           "tokenize_ms_mean": statistics.fmean([r["tokenize_ms"] for r in ok]) if ok else 0.0,
           "query_ms_mean": statistics.fmean([r["query_ms"] for r in ok]) if ok else 0.0,
           "served_ttft_mean_ms": statistics.fmean(served) if served else 0.0, "served_ttft_p99_ms": p99(served),
           "served_n": len(served),
           "idle_score_ms_mean": idle_ms[0], "idle_score_ms_p99": idle_ms[1],
           "token_count_mismatches": mismatched, "unanswered_queries": unanswered, "load_avg": [round(load0, 1), round(load1, 1)],
           **{k: after[k] - before[k] for k in after}}
    print(f"  {row['requests']} requests, TTFT mean {row['ttft_mean_ms']:.0f} ms, cached {cached} of reusable "
          f"{reusable}; local {row['local_hit']:.0f}, external {row['ext_hit']:.0f}", flush=True)
    return row


def share(a: float, b: float) -> str:
    return f"{100 * a / b:.0f}%" if b else "-"


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("requests", lambda r: f"{r['requests']}" + (f" ({r['failed']} failed)" if r["failed"] else "")),
            ("to replica 0 / 1", lambda r: " / ".join(str(n) for n in r["per_replica"])),
            ("TTFT mean / p99 ms (the tool's)", lambda r: f"{r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f}"),
            ("TTFT mean / p99 ms as served (router)", lambda r: f"{r['served_ttft_mean_ms']:.0f} / "
             f"{r['served_ttft_p99_ms']:.0f}"),
            ("prompt tokens", lambda r: f"{r['prompt']:.0f}"),
            ("cached (usage)", lambda r: f"{r['cached']:.0f}"),
            ("local hits", lambda r: f"{r['local_hit']:.0f}"),
            ("external hits (from server)", lambda r: f"{r['ext_hit']:.0f}"),
            ("server lookup hits", lambda r: f"{r['server_hit']:.0f}"),
            ("computed", lambda r: f"{r['computed']:.0f}"),
            ("reusable at routing", lambda r: f"{r['reusable']:.0f}"),
            ("held by the replica chosen", lambda r: f"{r['routed_to']:.0f} ({share(r['routed_to'], r['reusable'])})"),
            ("captured (cached / reusable)", lambda r: share(r["cached"], r["reusable"])),
            ("router ms/request mean / p99", lambda r: f"{r['score_ms_mean']:.1f} / {r['score_ms_p99']:.1f}"
             + ("" if r["policy"] == "cache-aware" else " (measuring only)")),
            ("router ms, engines idle, mean / p99", lambda r: f"{r['idle_score_ms_mean']:.1f} / "
             f"{r['idle_score_ms_p99']:.1f}"),
            ("load average", lambda r: f"{r['load_avg'][0]}-{r['load_avg'][1]}")]
    head = "| | " + " | ".join(r["policy"] for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for name, fn in cols:
        lines.append(f"| {name} | " + " | ".join(fn(r) for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="cache-aware,round-robin")
    ap.add_argument("--blocks", type=int, help="vLLM's local pool per replica (--num-gpu-blocks-override)")
    ap.add_argument("--duration", type=int, default=40, help="the tool's --mrc-duration, seconds")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help="lower it with a small --blocks")
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--keep", type=Path, help="keep logs, lmcache outputs and per-request routes here")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}")
    from glm5next_tiny import ensure_checkpoint

    ckpt = Path(args.checkpoint)
    ensure_checkpoint(ckpt)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-routing-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenize = Tokenizer(str(ckpt))
    load_args = workload(args.smoke, args.duration)
    started = time.monotonic()
    rows = []
    with ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess("--separate-object-groups", "--chunk-size", str(C),
                                                     "--l1-size-gb", "1", log_path=work / f"server{i}.log"))
                   for i in range(2)]
        extra = ["--num-gpu-blocks-override", str(args.blocks)] if args.blocks else []
        engines = [VllmServer(ckpt, "--enforce-eager", "--dtype", "float32", "--max-num-batched-tokens", "2048",
                              "--prefix-cache-retention-interval", str(C), "--max-num-seqs", "8", *extra,
                              kv_transfer_config=connector_config(s.url, chunk_keys="lmcache", save_decode=True),
                              max_model_len=args.max_model_len, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
                              log_path=work / f"vllm{i}.log") for i, s in enumerate(servers)]
        for e in engines:
            e.launch()
            stack.callback(e.stop)
        for e in engines:
            e.wait_ready()
        print(f"2 replicas ready after {time.monotonic() - started:.0f} s", flush=True)
        for policy in policies:
            # the namespace starts with the served model name (vllm serve --served-model-name)
            rows.append(run_policy(policy, engines, servers, tokenize, "model", load_args, work))
    text = table(rows)
    print()
    print(f"lmcache bench engine multi-round-chat through the router, 2 replicas of the tiny GLM-5.3-Flash "
          f"(float32, chunk {C}), each with its own glm-cache-server; local pool "
          f"{args.blocks or 'default'}, --max-model-len {args.max_model_len}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"tool args: {shlex.join(load_args)}")
    print(text)
    print(f"{time.monotonic() - started:.0f} s in all; logs, lmcache outputs and routes in {work}")
    print(json.dumps(rows))
    return 0 if all(not r["failed"] and not r["unanswered_queries"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
