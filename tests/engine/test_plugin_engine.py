"""The plugin inside a real vLLM engine (CPU build) against the transformers reference.

One engine for the module (~25-40 s to start on 2 cores). Prefill is chunked at 512
tokens, so the 2,100-token prompt crosses chunk boundaries (KDA state and MLA cache
carried across steps) and runs the sparse top-k path (``index_topk`` = 128).
"""

from __future__ import annotations

import pytest
import torch

from testing.engines import stop_engine

pytestmark = pytest.mark.engine

# float32 engine vs float32 reference; measured max |diff| ~1e-4 on these prompts.
FP32_LOGPROB_TOL = 1e-3
PROMPT_LENGTHS = [20, 150, 700, 2100]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(16, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm(ckpt):
    from vllm import LLM

    engine = LLM(
        model=str(ckpt),
        dtype="float32",
        gpu_memory_utilization=0.15,
        max_model_len=4096,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        seed=0,
    )
    yield engine
    # stop the engine-core process now, not from a finalizer at interpreter exit
    stop_engine(engine)
    del engine


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers with the plugin's documented tie order, and where two pools' scores
    differ by float32 rounding only, the plugin's pick (``validation.parity_sweep``: at 2100
    tokens one query row of this checkpoint is such a near tie, 2.8e-7 apart, and moves the
    later log-probs by 0.17 nats)."""
    from transformers import Glm5NextForConditionalGeneration

    from glm5next_plugin.standalone import load_standalone

    model = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, load_standalone(ckpt)


def _reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    from validation.parity_sweep import plugin_choices, stable_tie_order

    model, plugin = reference
    with torch.no_grad(), plugin_choices() as chosen:
        plugin.logprobs(torch.tensor(ids))
    with torch.no_grad(), stable_tie_order(model, adopt=chosen):
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_engine_runs_the_plugin_with_align_mode_kda_state(llm):
    from glm5next_plugin.model import Glm5NextForConditionalGeneration

    cfg = llm.llm_engine.vllm_config
    model_cls = cfg.model_config.registry.resolve_model_cls(cfg.model_config.architectures, cfg.model_config)[0]
    assert model_cls is Glm5NextForConditionalGeneration
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert cfg.cache_config.enable_prefix_caching
    # The worker aligns mamba_block_size to the unified block size after building the
    # model (this front-end copy of the config is not updated); the prefix-cache test
    # checks the resulting grid.
    assert cfg.cache_config.block_size % 16 == 0


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_prompt_logprobs_match_transformers(llm, reference, n):
    from vllm import SamplingParams

    ids = _ids(n, seed=n)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ref = _reference_logprobs(reference, ids)
    diffs = []
    for pos, entry in enumerate(out.prompt_logprobs[1:]):  # entry for token pos+1, from logits at pos
        for tok, lp in entry.items():  # the prompt token and the top-1 token
            diffs.append(abs(lp.logprob - ref[pos, tok].item()))
    assert len(diffs) >= n - 1
    assert max(diffs) < FP32_LOGPROB_TOL


def test_greedy_decode_matches_transformers(llm, reference):
    """Decode steps (KDA recurrent step, MLA over the paged cache) against full re-runs."""
    from vllm import SamplingParams

    ids = _ids(300, seed=7)
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    seq = list(ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        ref = _reference_logprobs(reference, seq)[-1]
        assert tok == int(ref.argmax())
        assert abs(lp[tok].logprob - ref[tok].item()) < FP32_LOGPROB_TOL
        seq.append(tok)


def test_batched_requests_match_transformers_each(llm, reference):
    """Several requests per step: prefills side by side, then decodes batched together."""
    from vllm import SamplingParams

    prompts = [_ids(n, seed=100 + n) for n in (37, 260, 610)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for tok, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            ref = _reference_logprobs(reference, seq)[-1]
            assert tok == int(ref.argmax())
            assert abs(lp[tok].logprob - ref[tok].item()) < FP32_LOGPROB_TOL
            seq.append(tok)


def test_repeated_prompt_resumes_from_vllm_prefix_cache(llm):
    from vllm import SamplingParams

    block = llm.llm_engine.vllm_config.cache_config.block_size
    ids = _ids(700, seed=11)
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # strict prefix on the block grid: the last prompt token is always recomputed
    assert second.num_cached_tokens == block * ((len(ids) - 1) // block) > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    for a, b, tok in zip(first.outputs[0].logprobs, second.outputs[0].logprobs, first.outputs[0].token_ids):
        assert abs(a[tok].logprob - b[tok].logprob) < FP32_LOGPROB_TOL
