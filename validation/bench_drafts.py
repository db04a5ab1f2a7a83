"""Speculative decoding with the external cache: TTFT, decode speed and acceptance, drafts
off and on, cold and reloaded, side by side in one run.

    PYTHONPATH=$PWD python validation/bench_drafts.py [--prompt 1000] [--tokens 64] [--prompts 3]

For each configuration (drafts off; MTP drafts, ``num_speculative_tokens`` 2 with
``disable_padded_drafter_batch``, which the connector needs to cache MTP rows; ngram drafts,
2) this starts a real ``glm-cache-server`` and ``vllm serve`` on the tiny GLM-5.3-Flash
(float32, a 128-token block and chunk) with ``GlmCacheConnector``, then for each prompt
(random token ids, so ngram finds few matches): a cold request (a fresh ``cache_salt``,
nothing cached), vLLM's local prefix cache reset, the same request again (reloaded from the
server). Measured from the client, as an operator sees it: time to first token of the
streamed completion, and decode speed, (generated - 1) / (total - TTFT). Mean acceptance
length is vLLM's own count from ``/metrics``: 1 + accepted draft tokens / drafts
(``vllm:spec_decode_num_accepted_tokens_total`` / ``vllm:spec_decode_num_drafts_total``),
one verify step's tokens; 1.0 means no draft was ever accepted. It also checks that each
reloaded output equals its cold run and prints the tokens the reload took from the server.

The tiny checkpoint's MTP layer is derived from its last layer (``glm5next-tiny``), so its
acceptance is what that construction gives, not GLM-5.3-Flash's. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testing.server_process import ServerProcess  # noqa: E402
from validation.serving import VllmServer, complete, connector_config  # noqa: E402

C = 128
CONFIGS = {
    "off": None,
    # the connector caches MTP rows only off vLLM's padded drafter batch (connector.identity)
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True},
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def metric(base_url: str, name: str) -> float:
    """Sum of one Prometheus counter's samples on ``vllm serve``'s /metrics (0 if absent)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def spec_counts(base_url: str) -> tuple[float, float]:
    return (metric(base_url, "vllm:spec_decode_num_drafts_total"),
            metric(base_url, "vllm:spec_decode_num_accepted_tokens_total"))


def run_config(ckpt: Path, name: str, spec: dict | None, prompts: list[list[int]], tokens: int) -> dict:
    extra = ["--enforce-eager", "--dtype", "float32", "--max-num-batched-tokens", str(C),
             "--prefix-cache-retention-interval", str(C), "--seed", "0"]
    if spec is not None:
        extra += ["--speculative-config", json.dumps(spec)]
    rows: dict[str, list[dict]] = {"cold": [], "reloaded": []}
    equal = True
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C)) as srv, \
            VllmServer(ckpt, *extra, kv_transfer_config=connector_config(srv.url), max_model_len=4096,
                       env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}) as engine:
        complete(engine.base_url, prompts[0][:64], max_tokens=4, cache_salt="warm-up")
        for i, ids in enumerate(prompts):
            outs = {}
            for phase in ("cold", "reloaded"):
                if phase == "reloaded":
                    engine.reset_prefix_cache()
                before = spec_counts(engine.base_url)
                r = complete(engine.base_url, ids, max_tokens=tokens, cache_salt=f"{name}-{i}")
                after = spec_counts(engine.base_url)
                drafts, accepted = after[0] - before[0], after[1] - before[1]
                outs[phase] = r.token_ids
                rows[phase].append({"ttft_s": r.ttft_s, "decode_tps": (len(r.token_ids) - 1) / max(r.total_s - r.ttft_s, 1e-9),
                                    "cached": r.cached_tokens, "drafts": drafts, "accepted": accepted})
            equal &= outs["cold"] == outs["reloaded"]
    out = {"config": name, "equal": equal}
    for phase, rs in rows.items():
        drafts = sum(r["drafts"] for r in rs)
        out[phase] = {
            "ttft_ms": 1000 * statistics.mean(r["ttft_s"] for r in rs),
            "decode_tps": statistics.mean(r["decode_tps"] for r in rs),
            "acceptance_length": (1 + sum(r["accepted"] for r in rs) / drafts) if drafts else None,
            "cached_tokens": statistics.mean(r["cached"] for r in rs),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    args = ap.parse_args(argv)
    from glm5next_plugin import tiny_checkpoint

    ckpt = Path(tempfile.mkdtemp(prefix="bench-drafts-")) / "tiny"
    tiny_checkpoint.main([str(ckpt), "--seed", "3"])
    rng = random.Random(7)
    prompts = [[rng.randrange(16, 512) for _ in range(args.prompt)] for _ in range(args.prompts)]
    results = [run_config(ckpt, name, CONFIGS[name], prompts, args.tokens) for name in args.configs.split(",")]
    print(f"\ntiny GLM-5.3-Flash, CPU, {args.prompts} prompts x {args.prompt} tokens, {args.tokens} generated, "
          f"chunk {C}; mean over prompts")
    head = f"{'drafts':<11} {'phase':<9} {'TTFT ms':>8} {'decode tok/s':>13} {'accept len':>11} {'from server':>12}"
    print(head)
    print("-" * len(head))
    for r in results:
        for phase in ("cold", "reloaded"):
            p = r[phase]
            acc = f"{p['acceptance_length']:.2f}" if p["acceptance_length"] is not None else "-"
            print(f"{r['config']:<11} {phase:<9} {p['ttft_ms']:>8.0f} {p['decode_tps']:>13.1f} {acc:>11} "
                  f"{p['cached_tokens']:>12.0f}")
        ratio = r["cold"]["ttft_ms"] / max(r["reloaded"]["ttft_ms"], 1e-9)
        print(f"{'':<11} reload TTFT {ratio:.2f}x faster; outputs equal cold: {r['equal']}")
    base = next((r for r in results if r["config"] == "off"), None)
    if base:
        for r in results:
            if r is not base:
                print(f"{r['config']}: decode {r['cold']['decode_tps'] / base['cold']['decode_tps']:.2f}x drafts off (cold)")
    print(json.dumps(results))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
