"""Demo: GLM-5.3-Flash (a generated tiny checkpoint) on vLLM with glm-cache-server.

1. generates the checkpoint (random weights under the real tensor names, a small trained
   tokenizer with a chat template), unless it is already there;
2. starts ``glm-cache-server --separate-object-groups`` and ``vllm serve`` with
   ``GlmCacheConnector``;
3. runs a multi-turn document chat. Each turn is sent cold (a fresh ``cache_salt``, so no
   cache can help), then under the conversation's salt (computed, stored in the server);
4. resets vLLM's local prefix cache before resending each turn, so every reused token
   comes from the cache server;
5. prints cold vs reloaded TTFT, hit tokens and whether the outputs match;
6. shuts everything down, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from testing.server_process import ServerProcess
from validation.serving import ChatResult, VllmServer, chat, connector_config

ROOT = Path(__file__).resolve().parent.parent

WORDS = ("cache state token prompt model layer block chunk server engine request vector latent pool "
         "index sparse expert router stream gate decay value key query memory host device prefix "
         "resume snapshot boundary hash group").split()
QUESTIONS = ["What does the report say about the cache?", "Which layer keeps a recurrent state?",
             "How are snapshots kept at the chunk boundary?", "Summarise the third section please."]


def document(n_sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences = []
    for i in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(f"{i + 1}. " + " ".join(words).capitalize() + ".")
    return " ".join(sentences)


def ensure_checkpoint(path: Path) -> Path:
    import glm5next_tiny

    return glm5next_tiny.ensure_checkpoint(path, log=lambda line: print(f"[1/5] {line}", flush=True))


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def run(args: argparse.Namespace) -> int:
    ckpt = ensure_checkpoint(Path(args.checkpoint))
    print("[2/5] starting glm-cache-server ...", flush=True)
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "1", "--chunk-size", str(args.min_chunk)) as server:
        print(f"      {server.url} (HTTP {server.http_url})")
        print("[3/5] starting vllm serve with GlmCacheConnector (first start compiles; minutes on 2 cores) ...",
              flush=True)
        # vLLM-CPU reserves one more core per rank for any KV connector (meant for NIXL); on
        # a small machine that leaves the engine's worker spinning on too few cores. One
        # reserved core, as without a connector (recipes/cpu-demo.md).
        reserved = {"VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
        print(f"      VLLM_CPU_NUM_OF_RESERVED_CPU={reserved['VLLM_CPU_NUM_OF_RESERVED_CPU']}")
        engine = VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(args.max_batched_tokens),
                            kv_transfer_config=connector_config(server.url), max_model_len=args.max_model_len,
                            env=reserved)
        with engine:
            geometry = [line.split("Resolved geometry:")[1].strip() for line in engine.log().splitlines()
                        if "Resolved geometry:" in line]
            negotiated = [line.split("INFO glm_cache_server: ")[1] for line in server.log().splitlines()
                          if "Negotiated chunk size" in line]
            print("      server:    ", negotiated[0] if negotiated else "(no negotiation logged)")
            print("      connector: Resolved geometry:", geometry[0] if geometry else "(not logged)")

            print(f"[4/5] {args.turns}-turn chat over a {args.sentences}-sentence document: cold, stored, then "
                  "reloaded after resetting vLLM's local cache", flush=True)
            chat(engine.base_url, [{"role": "user", "content": "warm up"}], 4)  # first-request costs out of the way
            salt = f"demo-{uuid.uuid4().hex[:8]}"
            messages = [{"role": "system", "content": "Answer from this document. " + document(args.sentences, 0)}]
            rows: list[tuple[int, ChatResult, ChatResult]] = []
            for turn in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                cold = chat(engine.base_url, messages, args.max_tokens, cache_salt=f"cold-{uuid.uuid4().hex}")
                stored = chat(engine.base_url, messages, args.max_tokens, cache_salt=salt)
                rows.append((turn + 1, cold, stored))
                messages.append({"role": "assistant", "content": stored.text})
                print(f"      turn {turn + 1}: {cold.prompt_tokens} prompt tokens, cold TTFT "
                      f"{cold.ttft_s * 1e3:.0f} ms", flush=True)

            # Resend every turn with vLLM's local cache emptied first: hits come from the server.
            results = []
            for i, (turn, cold, stored) in enumerate(rows):
                replay = messages[: 2 + 2 * i]
                if not engine.reset_prefix_cache():
                    time.sleep(0.5)
                    engine.reset_prefix_cache()
                reloaded = chat(engine.base_url, replay, args.max_tokens, cache_salt=salt)
                results.append((turn, cold, stored, reloaded))
            with urllib.request.urlopen(engine.base_url + "/metrics", timeout=5) as r:
                # the connector's counters in vLLM's metrics: vllm:glm_cache_<name>_total{...} value
                counters = {line.split("_total{")[0].removeprefix("vllm:glm_cache_"): float(line.split()[-1])
                            for line in r.read().decode().splitlines()
                            if line.startswith("vllm:glm_cache_") and "_total{" in line}

        print("[5/5] results")
        print(f"{'turn':>4} {'prompt':>7} {'hit':>6} | {'cold TTFT ms':>12} {'reloaded ms':>12} {'speed-up':>8} | "
              f"{'reloaded == cold':>16}")
        all_match = True
        for turn, cold, stored, reloaded in results:
            match = reloaded.text == cold.text and reloaded.token_logprobs[:1] == cold.token_logprobs[:1]
            all_match &= match
            print(f"{turn:>4} {cold.prompt_tokens:>7} {reloaded.cached_tokens:>6} | {fmt_ms(cold.ttft_s):>12} "
                  f"{fmt_ms(reloaded.ttft_s):>12} {cold.ttft_s / reloaded.ttft_s:>7.2f}x | {str(match):>16}")
        status = server.status()
        print(f"server: {status['objects']} objects, bytes per object group {status['bytes_by_group_name']}, "
              f"{status['hits']} lookup hits, {status['misses']} misses, {status['evictions']} evictions")
        print("engine (vllm serve /metrics, vllm:glm_cache_*):",
              ", ".join(f"{k} {v:.0f}" for k, v in counters.items() if k.endswith(("bytes", "failures"))))
        print("outputs reloaded from the cache equal cold outputs:", all_match)
        return 0 if all_match and all(r[3].cached_tokens > 0 for r in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--min-chunk", type=int, default=128,
                    help="server --chunk-size. The tiny checkpoint's unified block is 128 tokens; 128 keeps the chunk "
                         "equal to the block, as in production (1152 at TP 4), so vLLM's end-of-prompt state "
                         "snapshot always falls on a chunk boundary")
    ap.add_argument("--sentences", type=int, default=180, help="document length (~10 tokens a sentence)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: cache server and vllm serve were shut down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
