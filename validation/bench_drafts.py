"""Speculative decoding with the external cache: TTFT, decode speed and acceptance, drafts
off and on, cold and reloaded, side by side in one run.

    python -m validation.bench_drafts [--prompt 1000] [--tokens 64] [--prompts 3]
    python -m validation.bench_drafts --prompts-from demo [--sentences 180] [--prompts 3]

For each configuration (drafts off; MTP drafts, ``num_speculative_tokens`` 2, with
``disable_padded_drafter_batch`` and on vLLM's default padded drafter batch; ngram drafts,
2) this starts a real ``glm-cache-server`` and ``vllm serve`` on the tiny GLM-5.3-Flash
(float32, a 128-token block and chunk) with ``GlmCacheConnector``, then for each prompt: a
cold request (a fresh ``cache_salt``, nothing cached), vLLM's local prefix cache reset, the
same request again (reloaded from the server).

Prompts: ``--prompts-from random`` (the default) sends random token ids, so ngram finds few
matches; ``--prompts-from demo`` sends the demo's document chat (``validation/demo.py``:
a system message holding a ``--sentences``-sentence document, then the demo's questions,
prompt ``i`` being turn ``i + 1`` with the earlier turns' answers filled in) rendered
through the checkpoint's chat template and tokenizer, natural-ish text as the demo sends it.

Measured from the client, as an operator sees it: time to first token of the streamed
completion, and decode speed, (generated - 1) / (total - TTFT), summed over the prompts.
Acceptance is vLLM's own count from ``/metrics``: mean acceptance length, 1 + accepted
draft tokens / drafts (``vllm:spec_decode_num_accepted_tokens_total`` /
``vllm:spec_decode_num_drafts_total``), one verify step's tokens, 1.0 meaning no draft was
ever accepted; and the rate per draft position,
``vllm:spec_decode_num_accepted_tokens_per_pos_total`` / drafts (position 2 is accepted
only after position 1). It also checks that each reloaded output equals its cold run and
prints the tokens the reload took from the server.

The seed-3 tiny checkpoint's MTP layer is trained on its random target's own greedy
outputs (``validation/train_tiny_mtp.py``), fitted to the prompts this script sends (both
kinds, 3 each, 64 tokens): there it drafts what the target generates, so acceptance shows
whether a resumed request drafts as well as a cold one. On other prompts (or other
``--prompts``, ``--prompt``, ``--sentences``, ``--tokens``) it accepts about 5-10% of
first drafts, the most one layer learns of this chaotic random target; neither is what
GLM-5.3-Flash's layer accepts. The last line is JSON.
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

from testing.server_process import ServerProcess
from validation.serving import VllmServer, complete, connector_config

C = 128
CONFIGS = {
    "off": None,
    # vLLM's non-padded drafter batch, the first the connector cached MTP rows under
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True},
    # vLLM's default (padded) drafter batch, cached since glm5next_plugin.draft_rows gives its
    # partial prefill ends the next prompt token (connector.drafts._padded_rows_exact)
    "mtp k=2 pad": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def metric(base_url: str, name: str, label: str | None = None) -> float | dict[str, float]:
    """Sum of one Prometheus counter's samples on ``vllm serve``'s /metrics (0 if absent);
    with ``label``, the sums by that label's value."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+)$", re.M)
    if label is None:
        return sum(float(v) for _, v in pattern.findall(text))
    by: dict[str, float] = {}
    for labels, v in pattern.findall(text):
        m = re.search(rf'(?:^|,){re.escape(label)}="([^"]*)"', labels)
        if m:
            by[m.group(1)] = by.get(m.group(1), 0.0) + float(v)
    return by


def spec_counts(base_url: str) -> dict:
    """vLLM's draft counters: drafts (verify steps with drafts), draft tokens, accepted
    tokens, accepted tokens per draft position (a list, position 1 first)."""
    per_pos = metric(base_url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    return {"drafts": metric(base_url, "vllm:spec_decode_num_drafts_total"),
            "draft_tokens": metric(base_url, "vllm:spec_decode_num_draft_tokens_total"),
            "accepted": metric(base_url, "vllm:spec_decode_num_accepted_tokens_total"),
            "per_pos": [per_pos[k] for k in sorted(per_pos, key=int)]}


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    pos = before["per_pos"] + [0.0] * (len(after["per_pos"]) - len(before["per_pos"]))
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], pos)]
    return out


def run_config(ckpt: Path, name: str, spec: dict | None, prompts: list[list[int]], tokens: int,
               max_model_len: int = 4096) -> dict:
    extra = ["--enforce-eager", "--dtype", "float32", "--max-num-batched-tokens", str(C),
             "--prefix-cache-retention-interval", str(C), "--seed", "0"]
    if spec is not None:
        extra += ["--speculative-config", json.dumps(spec)]
    rows: dict[str, list[dict]] = {"cold": [], "reloaded": []}
    equal = True
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C)) as srv, \
            VllmServer(ckpt, *extra, kv_transfer_config=connector_config(srv.url), max_model_len=max_model_len,
                       env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}) as engine:
        complete(engine.base_url, prompts[0][:64], max_tokens=4, cache_salt="warm-up")
        for i, ids in enumerate(prompts):
            outs = {}
            for phase in ("cold", "reloaded"):
                if phase == "reloaded":
                    engine.reset_prefix_cache()
                before = spec_counts(engine.base_url)
                r = complete(engine.base_url, ids, max_tokens=tokens, cache_salt=f"{name}-{i}")
                counts = _delta(spec_counts(engine.base_url), before)
                outs[phase] = r.token_ids
                rows[phase].append({"ttft_s": r.ttft_s, "decode_tokens": len(r.token_ids) - 1,
                                    "decode_s": r.total_s - r.ttft_s, "cached": r.cached_tokens, **counts})
            equal &= outs["cold"] == outs["reloaded"]
    out = {"config": name, "equal": equal}
    for phase, rs in rows.items():
        drafts = sum(r["drafts"] for r in rs)
        per_pos = [sum(col) for col in zip(*(r["per_pos"] for r in rs))] if drafts else []
        out[phase] = {
            "ttft_ms": 1000 * statistics.mean(r["ttft_s"] for r in rs),
            # tokens over time summed over the prompts: one stream delivered late in a burst
            # (its client starved of CPU) cannot dominate as it would a mean of rates
            "decode_tps": sum(r["decode_tokens"] for r in rs) / max(sum(r["decode_s"] for r in rs), 1e-9),
            "acceptance_length": (1 + sum(r["accepted"] for r in rs) / drafts) if drafts else None,
            "drafts": drafts,
            "draft_tokens": sum(r["draft_tokens"] for r in rs),
            "accepted": sum(r["accepted"] for r in rs),
            "accepted_per_pos": per_pos,
            "acceptance_per_pos": [a / drafts for a in per_pos] if drafts else None,
            "cached_tokens": statistics.mean(r["cached"] for r in rs),
        }
    return out


def random_prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(16, 512) for _ in range(length)] for _ in range(n)]


def demo_prompts(ckpt: Path, n: int, sentences: int) -> list[list[int]]:
    """The demo's chat (``validation.demo``: its document, seed 0, and its questions) as the
    token ids ``vllm serve`` renders for it: prompt ``i`` is turn ``i + 1``, each earlier
    answer a sentence of another demo-style document (the demo's are the model's replies)."""
    from transformers import AutoTokenizer

    from validation.demo import QUESTIONS, document

    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "system", "content": "Answer from this document. " + document(sentences, 0)}]
    out = []
    for turn in range(n):
        if turn:
            messages.append({"role": "assistant", "content": document(1, 100 + turn)})
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-from", choices=["random", "demo"], default="random",
                    help="random token ids (--prompt of them) or the demo's document chat through the chat template")
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens (random prompts)")
    ap.add_argument("--sentences", type=int, default=180,
                    help="document sentences (demo prompts; the demo's default, about 3,070 tokens)")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    args = ap.parse_args(argv)
    import glm5next_tiny

    ckpt = Path(tempfile.mkdtemp(prefix="bench-drafts-")) / "tiny"
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    if args.prompts_from == "demo":
        prompts = demo_prompts(ckpt, args.prompts, args.sentences)
        what = f"{args.prompts} demo chat turns of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    else:
        prompts = random_prompts(args.prompts, args.prompt)
        what = f"{args.prompts} prompts x {args.prompt} random tokens"
    max_len = max(4096, max(map(len, prompts)) + args.tokens + 8)
    results = [run_config(ckpt, name, CONFIGS[name], prompts, args.tokens, max_len)
               for name in args.configs.split(",")]
    print(f"\ntiny GLM-5.3-Flash, CPU, {what}, {args.tokens} generated, chunk {C}; TTFT and hits a mean over "
          "prompts, decode over all of them")
    head = (f"{'drafts':<11} {'phase':<9} {'TTFT ms':>8} {'decode tok/s':>13} {'accept len':>11} "
            f"{'accepted/pos':>14} {'from server':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        for phase in ("cold", "reloaded"):
            p = r[phase]
            acc = f"{p['acceptance_length']:.2f}" if p["acceptance_length"] is not None else "-"
            pos = " / ".join(f"{a:.2f}" for a in p["acceptance_per_pos"]) if p["acceptance_per_pos"] else "-"
            print(f"{r['config']:<11} {phase:<9} {p['ttft_ms']:>8.0f} {p['decode_tps']:>13.1f} {acc:>11} "
                  f"{pos:>14} {p['cached_tokens']:>12.0f}")
        ratio = r["cold"]["ttft_ms"] / max(r["reloaded"]["ttft_ms"], 1e-9)
        print(f"{'':<11} reload TTFT {ratio:.2f}x faster; outputs equal cold: {r['equal']}")
        for phase in ("cold", "reloaded"):
            p = r[phase]
            if p["drafts"]:
                print(f"{'':<11} {phase}: {p['accepted']:.0f} of {p['draft_tokens']:.0f} draft tokens accepted over "
                      f"{p['drafts']:.0f} verify steps (per position: "
                      + ", ".join(f"{a:.0f}" for a in p["accepted_per_pos"]) + ")")
    base = next((r for r in results if r["config"] == "off"), None)
    if base:
        for r in results:
            if r is not base:
                print(f"{r['config']}: decode {r['cold']['decode_tps'] / base['cold']['decode_tps']:.2f}x drafts off "
                      f"(cold), {r['reloaded']['decode_tps'] / base['reloaded']['decode_tps']:.2f}x (reloaded)")
    print(json.dumps(results))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
