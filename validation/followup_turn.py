"""Does a follow-up turn resume after the previous answer, or before it?

    python -m validation.followup_turn

A conversation's next prompt starts with the previous prompt and the model's answer. The
follow-up can resume after the answer only if the answer's attention chunks and a KDA state
at the last whole chunk of the answer were saved. vLLM 0.32 keeps decode-time state
snapshots only with ``--prefix-cache-retention-interval`` set (its default 0 keeps only the
prompt's replay boundary), and the connector saves chunks of generated tokens only with
``save_decode``. This runs the same two-turn conversation on the tiny GLM-5.3-Flash through
real glm-cache-server processes, once with the defaults and once with both set, and prints
where the follow-up resumed (vLLM's local cache reset between the turns, so every reused
token comes from the server) and whether its output equals a cold run.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

from testing.server_process import ServerProcess

C = 128
PROMPT, ANSWER, FOLLOW_UP = 600, 300, 40


def run(ckpt: Path, decode_snapshots: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"save_decode": True} if decode_snapshots else {}
    engine_args = {"prefix_cache_retention_interval": C} if decode_snapshots else {}
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C)) as srv:
        llm = LLM(model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
                  max_model_len=4096, enforce_eager=True, seed=0, max_num_batched_tokens=C,
                  kv_transfer_config={"kv_connector": "GlmCacheConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"server": srv.url, **extra}},
                  **engine_args)
        try:
            rng = random.Random(5)
            first = [rng.randrange(16, 500) for _ in range(PROMPT)]
            greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
            (o1,) = llm.generate([TokensPrompt(prompt_token_ids=first, cache_salt="conv")], greedy, use_tqdm=False)
            second = first + list(o1.outputs[0].token_ids) + [rng.randrange(16, 500) for _ in range(FOLLOW_UP)]
            short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            llm.reset_prefix_cache()
            (o2,) = llm.generate([TokensPrompt(prompt_token_ids=second, cache_salt="conv")], short, use_tqdm=False)
            llm.reset_prefix_cache()
            (cold,) = llm.generate([TokensPrompt(prompt_token_ids=second, cache_salt="cold")], short, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return {"turn2_tokens": len(second), "hit": o2.num_cached_tokens or 0,
            "after_answer": C * ((PROMPT + ANSWER) // C), "before_answer": C * ((PROMPT - 1) // C),
            "equal_cold": list(o2.outputs[0].token_ids) == list(cold.outputs[0].token_ids)}


def main() -> int:
    from glm5next_tiny import write_checkpoint

    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="glm-followup-")) / "tiny", seed=3)
    rows = [("defaults (retention interval 0, save_decode off)", run(ckpt, False)),
            (f"--prefix-cache-retention-interval {C} + save_decode", run(ckpt, True))]
    print(f"\nfollow-up turn: {PROMPT}-token prompt, {ANSWER}-token answer, {FOLLOW_UP} new tokens (C = {C})")
    for name, r in rows:
        print(f"{name:52s} | turn 2 {r['turn2_tokens']} tokens, resumed at {r['hit']} (prompt boundary "
              f"{r['before_answer']}, after the answer {r['after_answer']}); output == cold: {r['equal_cold']}")
    return 0 if all(r["equal_cold"] for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
