"""Image chat through ``vllm serve`` with the external cache: cold vs reloaded, side by side.

    python -m validation.image_chat [--prompts 3] [--words 900] [--tokens 16]

Starts a real ``glm-cache-server`` and ``vllm serve`` on the tiny GLM-5.3-Flash (float32,
its vision tower, ``--limit-mm-per-prompt '{"image":1}'``) with ``GlmCacheConnector``. Each
prompt is one user message: an image (a PNG data URL of random pixels, 112x112, 16 image
tokens) early, then ``--words`` words of text. It is sent cold (nothing cached under its
``cache_salt``), vLLM's local prefix cache is reset, and the same message is sent again: the
reload comes from glm-cache-server only. Printed per prompt and as means: time to first
token (streamed, from the client), prompt and cached tokens (vLLM's usage), and whether
the reloaded text and first-token log-probs equal the cold run's. A last row sends the same
text with another image under the same salt: it may resume only before the image. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
from pathlib import Path

from testing.server_process import ServerProcess
from validation.serving import VllmServer, chat, connector_config

C = 128
MODEL = Path(__file__).resolve().parents[1] / "artifacts" / "glm5next-tiny"


def png_data_url(seed: int, size: int = 112) -> str:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def message(image_seed: int, words: int, text_seed: int) -> list[dict]:
    rng = random.Random(text_seed)
    vocab = ["cache", "state", "chunk", "prefix", "token", "image", "layer", "block", "server", "replica",
             "the", "of", "and", "to", "in", "is", "for", "on", "with", "as"]
    text = " ".join(rng.choice(vocab) for _ in range(words)) + "\nDescribe the image."
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(image_seed)}},
        {"type": "text", "text": text},
    ]}]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--words", type=int, default=900)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    from glm5next_tiny import ensure_checkpoint

    ensure_checkpoint(MODEL)
    rows = []
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        vllm = VllmServer(MODEL, "--enforce-eager", "--max-num-batched-tokens", str(C),
                          "--prefix-cache-retention-interval", str(C), "--dtype", "float32",
                          "--limit-mm-per-prompt", json.dumps({"image": 1}),
                          kv_transfer_config=connector_config(srv.url),
                          env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
        with vllm:
            chat(vllm.base_url, message(999, 50, 999), 2, cache_salt="warm-up")  # first-request costs out
            for i in range(args.prompts + 1):
                swap = i == args.prompts  # the last: the first prompt's text, another image
                msgs = message(1000 + i, args.words, 0 if swap else i)
                salt = "image-chat-0" if swap else f"image-chat-{i}"
                if swap:
                    vllm.reset_prefix_cache()
                    cold = chat(vllm.base_url, msgs, args.tokens, cache_salt=f"swap-cold-{i}")
                else:
                    cold = chat(vllm.base_url, msgs, args.tokens, cache_salt=salt)
                vllm.reset_prefix_cache()
                again = chat(vllm.base_url, msgs, args.tokens, cache_salt=salt)
                first_cold = next(iter(cold.top_logprobs[0].values())) if cold.top_logprobs else None
                first_again = next(iter(again.top_logprobs[0].values())) if again.top_logprobs else None
                rows.append({
                    "prompt": "other image" if swap else i, "prompt_tokens": again.prompt_tokens,
                    "cold_ttft_ms": 1000 * cold.ttft_s, "reloaded_ttft_ms": 1000 * again.ttft_s,
                    "cold_cached": cold.cached_tokens, "reloaded_cached": again.cached_tokens,
                    "text_equal": again.text == cold.text, "first_logprob_equal": first_cold == first_again,
                })
    print("| prompt | prompt tokens | cold TTFT ms | reloaded TTFT ms | cached cold | cached reloaded "
          "| text equal | first log-prob equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['prompt_tokens']} | {r['cold_ttft_ms']:.0f} | {r['reloaded_ttft_ms']:.0f} "
              f"| {r['cold_cached']} | {r['reloaded_cached']} | {r['text_equal']} | {r['first_logprob_equal']} |")
    same = [r for r in rows if r["prompt"] != "other image"]
    summary = {
        "cold_ttft_ms": statistics.mean(r["cold_ttft_ms"] for r in same),
        "reloaded_ttft_ms": statistics.mean(r["reloaded_ttft_ms"] for r in same),
        "all_equal": all(r["text_equal"] and r["first_logprob_equal"] for r in rows),
        "rows": rows,
    }
    print(f"mean TTFT cold {summary['cold_ttft_ms']:.0f} ms, reloaded {summary['reloaded_ttft_ms']:.0f} ms "
          f"({summary['cold_ttft_ms'] / summary['reloaded_ttft_ms']:.2f}x); every reloaded output equals cold: "
          f"{summary['all_equal']}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
