"""Prefill/decode disaggregation through glm-cache-server, measured (issue 34): TTFT and
inter-token latency (ITL) of streamed completions, and the prompt tokens the decode side
computes, for

* ``pd``: the PD proxy (:mod:`validation.pd_proxy`) in front of a prefill ``vllm serve``
  (``kv_role`` ``kv_producer``) and a decode ``vllm serve`` (``kv_consumer``), both with
  ``GlmCacheConnector`` on one glm-cache-server: the prefill instance computes ``T[:-1]``
  and stores its chunks and the hand-off, the decode instance resumes from the server;
* ``single``: one ``vllm serve`` doing both, ``kv_both`` on the same server
  (``--single-connector none``: no connector).

    .venv/bin/python -m validation.bench_pd [--requests 8] [--prompt-min 2048 --prompt-max 3072]
        [--max-tokens 32] [--concurrency 2] [--modes pd,single] [--bind split|auto] [--json] [--keep DIR]

The workload: ``--requests`` prompts of random token ids (lengths uniform in
``[--prompt-min, --prompt-max]``, fixed seeds), each under a salt of its own per mode (so
every prompt is computed cold once per mode: nothing is shared across modes or requests),
``max_tokens`` ``--max-tokens`` with ``ignore_eos``, greedy, streamed with usage,
``--concurrency`` requests in flight. One short warm-up request per mode, not measured.

Per request: TTFT at the client (send to the first streamed token; for ``pd`` this
includes the prefill instance's pass and the proxy); the decode side's TTFT (``pd``: from
the proxy's decode request to its first token, :attr:`PdRecord.decode_ttft_ms`; ``single``:
the TTFT); ITL (last token's arrival minus the first's, over the tokens after the first);
the decode side's computed prompt tokens, ``usage.prompt_tokens`` minus
``usage.prompt_tokens_details.cached_tokens`` of the decode response (the proxy runs with
``decode_usage``, so that usage is the decode instance's own, not vLLM's
``remote_prefill_cached_tokens``), checked against the decode engine's
``vllm:prompt_tokens_by_source_total{source="local_compute"}``. Whether each prompt's
greedy tokens are equal across the modes is reported (equal batch composition is not
guaranteed at ``--concurrency`` > 1, and vLLM's CPU kernels are not batch-invariant).

Engines: the tiny GLM-5.3-Flash (``artifacts/glm5next-tiny``), float32, the CPU flags of the
README (``--enforce-eager``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), chunk 128
(``--max-num-batched-tokens 128 --prefix-cache-retention-interval 128``; server
``--separate-object-groups --chunk-size 128``). Modes run one after the other. vLLM's CPU
backend binds every engine's OpenMP threads to the same cores (on a 2-core host: core 0,
core 1 reserved), so ``pd``'s two engines would take turns on one core; ``--bind split``
(the default) gives the prefill instance core 0 and the decode instance core 1, and the
single instance core 1 too (one core each, as separate hosts would; ``--bind auto``:
vLLM's own). Also printed: the proxy's prefill pass (``T[:-1]``, one token), which the PD
TTFT at the client includes. A side-by-side table, then with ``--json`` one JSON line last.

Measured (2 cores, AMD EPYC, other agents' engines running beside: load average 7-13, so
the figures are noisy; defaults, 8 prompts of 2199-2815 tokens, 2 in flight):

                                     pd (split)   single    pd (auto)   single
    TTFT at the client, mean ms            2101        1566        3151       1493
    prefill pass (T[:-1]), mean ms         1704           -           -          -
    decode-side TTFT, mean / p50 ms     361 / 311         -     148 / 93          -
    ITL mean / p50 / p99 ms          19.3/12.9/89  13.1/12.3/24  15.5/14.2/36  12.1/11.5/40
    decode-side computed tokens/req         3.6        2603         1.0       2603

In the split run one request of 8 computed 22 tokens on the decode side (its strict
prefix, 2688 of 2710: the hand-off was not on the server yet when the decode instance
looked, most likely: the prefill instance answers before its worker's saves land, and
vLLM does not wait for them); greedy tokens equal the single instance's for 8 of 8
prompts in both runs. The same race measured directly (prefill, then the decode request
at once or 1 s later, 12 prompts of 2-3k tokens a round, 2 in flight, split cores): sent
at once, 7 of 60 decode requests computed 432-2529 prompt tokens (chunks missing too, not
only the hand-off; the server had evicted nothing: 71 MB of 2 GiB used); sent 1 s later,
24 of 24 computed 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testing.server_process import ServerProcess
from validation.pd_proxy import PdProxy
from validation.serving import VllmServer, connector_config, metric_sum, scrape_metrics

ROOT = Path(__file__).resolve().parents[1]

C = 128
MODES = ("pd", "single")
VOCAB = (16, 512)  # token ids the tiny checkpoint's vocabulary holds (testing.engines.random_prompt)


@dataclass
class Result:
    """One streamed request, measured at the client."""

    prompt_tokens: int
    ttft_ms: float = 0.0
    decode_ttft_ms: float = 0.0
    prefill_ms: float = 0.0  # pd: the proxy's request to the prefill instance, sent to answered
    itl_ms: float | None = None  # mean gap after the first token
    gaps_ms: list[float] = field(default_factory=list)  # per token after the first
    tokens: list[int] = field(default_factory=list)
    usage_prompt: int = 0
    usage_cached: int = 0
    total_ms: float = 0.0

    @property
    def decode_computed(self) -> int:
        return self.usage_prompt - self.usage_cached


def prompts(n: int, lo: int, hi: int, seed: int = 34) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def stream(url: str, ids: list[int], max_tokens: int, salt: str, timeout_s: float = 900.0) -> Result:
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "cache_salt": salt}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    res = Result(len(ids))
    t0 = time.perf_counter()
    arrivals: list[float] = []  # one per generated token
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                got = choice.get("token_ids") or []
                res.tokens.extend(got)
                arrivals.extend([now] * len(got))
            if event.get("usage"):
                res.usage_prompt = event["usage"]["prompt_tokens"]
                res.usage_cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    res.total_ms = (time.perf_counter() - t0) * 1e3
    if arrivals:
        res.ttft_ms = res.decode_ttft_ms = (arrivals[0] - t0) * 1e3
        res.gaps_ms = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
        if len(arrivals) > 1:
            res.itl_ms = (arrivals[-1] - arrivals[0]) * 1e3 / (len(arrivals) - 1)
    return res


def _config(server_url: str, role: str) -> str:
    config = json.loads(connector_config(server_url))
    config["kv_role"] = role
    return json.dumps(config)


def _engine(ckpt: str, role: str | None, server_url: str, log_dir: Path, max_model_len: int,
            cores: str | None) -> VllmServer:
    args = ("--enforce-eager", "--max-num-batched-tokens", str(C), "--prefix-cache-retention-interval", str(C),
            "--dtype", "float32", "--max-num-seqs", "8", "--seed", "0")
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return VllmServer(ckpt, *args, kv_transfer_config=_config(server_url, role) if role else None,
                      max_model_len=max_model_len, env=env, log_path=log_dir / f"{role or 'no-connector'}.log")


def _cores(bind: str, engine: str) -> str | None:
    """The cores an engine's OpenMP threads are bound to: ``auto`` is vLLM's choice (every
    engine on the same cores: on a 2-core host, core 0, the other reserved), ``split``
    gives the prefill instance core 0 and the decode instance, and the single instance,
    core 1 (one core each, as separate hosts would; the single instance on the decode's)."""
    if bind == "auto":
        return None
    return "0" if engine == "prefill" else "1"


def _counters(engine: VllmServer) -> dict[str, float]:
    samples = scrape_metrics(engine.base_url)
    return {"computed": metric_sum(samples, "vllm:prompt_tokens_by_source_total", source="local_compute"),
            "external": metric_sum(samples, "vllm:external_prefix_cache_hits_total"),
            "prompt": metric_sum(samples, "vllm:prompt_tokens_total")}


def _run_requests(url: str, work: list[list[int]], max_tokens: int, concurrency: int, salt: str) -> list[Result]:
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(stream, url, ids, max_tokens, f"{salt}-{i}") for i, ids in enumerate(work)]
        return [f.result() for f in futures]


def run_mode(mode: str, args: argparse.Namespace, server: ServerProcess, work: list[list[int]],
             log_dir: Path) -> dict[str, Any]:
    if mode == "pd":
        engines = [_engine(args.checkpoint, "kv_producer", server.url, log_dir, args.max_model_len,
                           _cores(args.bind, "prefill")),
                   _engine(args.checkpoint, "kv_consumer", server.url, log_dir, args.max_model_len,
                           _cores(args.bind, "decode"))]
    else:
        role = None if args.single_connector == "none" else "kv_both"
        engines = [_engine(args.checkpoint, role, server.url, log_dir, args.max_model_len, _cores(args.bind, "single"))]
    proxy: PdProxy | None = None
    try:
        t = time.perf_counter()
        for e in engines:
            e.launch()
        for e in engines:
            e.wait_ready(progress=False)
        print(f"  {mode}: {len(engines)} engine(s) ready after {time.perf_counter() - t:.0f} s", flush=True)
        decode = engines[-1]
        if mode == "pd":
            proxy = PdProxy(engines[0].base_url, decode.base_url, decode_usage=True).start()
        url = proxy.url if proxy else decode.base_url
        stream(url, prompts(1, C + 9, C + 9, seed=7)[0], 4, f"warm-{mode}-{time.time_ns()}")
        before = _counters(decode)
        load0 = os.getloadavg()[0]
        t = time.perf_counter()
        salt = f"{mode}-{time.time_ns()}"
        results = _run_requests(url, work, args.max_tokens, args.concurrency, salt)
        wall_s = time.perf_counter() - t
        after = _counters(decode)
        if proxy is not None:  # the decode side's TTFT, from the proxy's decode request
            by_salt = {rec["cache_salt"]: rec for rec in proxy.records()}
            for i, res in enumerate(results):
                res.decode_ttft_ms = by_salt[f"{salt}-{i}"]["decode_ttft_ms"]
                res.prefill_ms = by_salt[f"{salt}-{i}"]["prefill_ms"]
        return {"results": results, "wall_s": wall_s, "load": (load0, os.getloadavg()[0]),
                "decode_counters": {k: after[k] - before[k] for k in after}, "engines": len(engines)}
    finally:
        if proxy is not None:
            proxy.stop()
        for e in engines:
            e.stop()


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    res: list[Result] = run["results"]
    ttft = [r.ttft_ms for r in res]
    dttft = [r.decode_ttft_ms for r in res]
    itl = [r.itl_ms for r in res if r.itl_ms is not None]
    gaps = [g for r in res for g in r.gaps_ms]
    computed = [r.decode_computed for r in res]
    return {
        "requests": len(res), "engines": run["engines"],
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in res),
        "generated_tokens": sum(len(r.tokens) for r in res),
        "ttft_ms_mean": statistics.mean(ttft), "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_max": max(ttft),
        "prefill_ms_mean": statistics.mean(r.prefill_ms for r in res),
        "decode_ttft_ms_mean": statistics.mean(dttft), "decode_ttft_ms_p50": _pct(dttft, 0.5),
        "itl_ms_mean": statistics.mean(itl) if itl else None, "itl_ms_p50": _pct(gaps, 0.5),
        "itl_ms_p99": _pct(gaps, 0.99),
        "decode_computed_per_request": computed,
        "decode_computed_mean": statistics.mean(computed),
        "decode_cached_mean": statistics.mean(r.usage_cached for r in res),
        "decode_engine_computed": run["decode_counters"]["computed"],
        "decode_engine_external_hits": run["decode_counters"]["external"],
        "wall_s": run["wall_s"], "load_avg": list(run["load"]),
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("requests", "requests", "{:.0f}"), ("engines", "engines", "{:.0f}"),
        ("prompt tokens (mean)", "prompt_tokens_mean", "{:.0f}"),
        ("TTFT at the client, mean ms", "ttft_ms_mean", "{:.0f}"), ("TTFT p50 ms", "ttft_ms_p50", "{:.0f}"),
        ("TTFT max ms", "ttft_ms_max", "{:.0f}"),
        ("prefill instance's pass (T[:-1], 1 token), mean ms", "prefill_ms_mean", "{:.0f}"),
        ("decode-side TTFT, mean ms", "decode_ttft_ms_mean", "{:.0f}"),
        ("decode-side TTFT p50 ms", "decode_ttft_ms_p50", "{:.0f}"),
        ("ITL mean ms (per request, mean)", "itl_ms_mean", "{:.1f}"), ("ITL p50 ms (all gaps)", "itl_ms_p50", "{:.1f}"),
        ("ITL p99 ms (all gaps)", "itl_ms_p99", "{:.1f}"),
        ("decode-side computed prompt tokens / request (usage)", "decode_computed_mean", "{:.1f}"),
        ("decode-side cached tokens / request (usage)", "decode_cached_mean", "{:.1f}"),
        ("decode engine: computed prompt tokens (metrics, all)", "decode_engine_computed", "{:.0f}"),
        ("decode engine: external hits (metrics, all)", "decode_engine_external_hits", "{:.0f}"),
        ("wall s", "wall_s", "{:.1f}"),
    ]
    modes = list(summaries)
    width = max(len(r[0]) for r in rows) + 2
    out = ["".ljust(width) + "".join(m.rjust(12) for m in modes)]
    for label, key, fmt in rows:
        cells = []
        for m in modes:
            v = summaries[m].get(key)
            cells.append(("-" if v is None else fmt.format(v)).rjust(12))
        out.append(label.ljust(width) + "".join(cells))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=2048)
    ap.add_argument("--prompt-max", type=int, default=3072)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--single-connector", choices=("kv_both", "none"), default="kv_both")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--bind", choices=("auto", "split"), default="split",
                    help="engines' OpenMP cores: split = prefill core 0, decode and single core 1; auto = vLLM's")
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--keep", type=Path, help="keep the engines' and server's logs here")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated subset of {','.join(MODES)}")
    if not 0 < args.prompt_min <= args.prompt_max < args.max_model_len - args.max_tokens:
        ap.error("need 0 < --prompt-min <= --prompt-max < --max-model-len - --max-tokens")

    from glm5next_tiny import ensure_checkpoint

    ensure_checkpoint(args.checkpoint)
    log_dir = args.keep or Path(tempfile.mkdtemp(prefix="bench-pd-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    work = prompts(args.requests, args.prompt_min, args.prompt_max)
    runs: dict[str, dict[str, Any]] = {}
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "2",
                       log_path=log_dir / "server.log") as server:
        for mode in modes:
            runs[mode] = run_mode(mode, args, server, work, log_dir)
    summaries = {m: summarize(r) for m, r in runs.items()}
    same = None
    if len(runs) == 2:
        a, b = (runs[m]["results"] for m in modes)
        same = sum(x.tokens == y.tokens for x, y in zip(a, b))
    print(f"\nPD vs one instance: {args.requests} prompts of {args.prompt_min}-{args.prompt_max} random token ids, "
          f"{args.max_tokens} tokens each, {args.concurrency} in flight, chunk {C}, {os.cpu_count()} cores, "
          f"bind {args.bind}; single = {args.single_connector}; logs in {log_dir}")
    print(table(summaries))
    if same is not None:
        print(f"greedy tokens equal across modes: {same} of {args.requests} prompts")
    for m in modes:
        print(f"load average during {m}: {summaries[m]['load_avg'][0]:.1f} -> {summaries[m]['load_avg'][1]:.1f}")
    if args.json:
        print(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "modes": summaries, "tokens_equal": same,
                          "requests": {m: [{k: v for k, v in asdict(r).items() if k not in ("gaps_ms", "tokens")}
                                           | {"decode_computed": r.decode_computed} for r in runs[m]["results"]] for m in modes}}))


if __name__ == "__main__":
    main()
