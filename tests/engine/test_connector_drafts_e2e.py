"""Resumed == fresh with MTP drafts on, through a real glm-cache-server.

One engine for the module: the tiny GLM-5.3-Flash (float32, a 128-token block and chunk)
with MTP drafts on vLLM's defaults (``num_speculative_tokens`` 2, the padded drafter batch)
and the connector; every prefill step ends on a chunk end, so every chunk's last draft row
was a step's last row. vLLM's own scheduler,
extended only to write down the drafts it schedules (``testing.draft_recorder``), shows
each step's draft token ids; the accepted count of a step is how far the request's
computed tokens advance past the one token every step verifies.

- Boundary lengths k*C-1, k*C, k*C+1 (k = 2): each prompt cold (a fresh salt), vLLM's
  local cache reset, then reloaded from the server: the same greedy tokens, the same draft
  ids at every step and the same acceptance counts as the cold run.
- Fork: two prompts equal up to a chunk boundary and different in the token right after it.
  The first is computed and saved; the second, under the same salt, must not take the MTP
  layer's rows of the chunk before the fork (its last row was computed from the first
  prompt's token there), so it resumes one chunk earlier and its drafts equal a cold run's;
  a third prompt forking one token later resumes at the boundary. Removing the lookahead
  rule makes the second prompt resume at the boundary (the hit assertion fails), and the
  control shows what it would then draft: served the first prompt's rows (by vLLM's own
  prefix cache with its EAGLE block drop off), its drafts differ from a cold run's.
"""

from __future__ import annotations

import time

import pytest

from testing.draft_recorder import log_lines, read_drafts
from testing.engines import connector_engine, random_prompt, stop_engine

pytestmark = pytest.mark.engine

C = 128
K = 2  # draft tokens per step
# vLLM's defaults (its padded drafter batch): the plugin gives a partial prefill's last
# draft row the next prompt token there too (glm5next_plugin.draft_rows), so it is cached
MTP = {"method": "mtp", "num_speculative_tokens": K}
MAX_TOKENS = 24


SERVER_ARGS = ("--chunk-size", str(C))  # the server fixture's (conftest.py)


@pytest.fixture(scope="module")
def draft_log(tmp_path_factory):
    return tmp_path_factory.mktemp("drafts") / "drafts.jsonl"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server, draft_log):
    import glm5next_tiny

    ckpt = tmp_path_factory.mktemp("tiny_mtp")
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    engine = connector_engine(
        ckpt, server.url, dtype="float32", max_num_batched_tokens=C, prefix_cache_retention_interval=C, seed=0,
        speculative_config=MTP,
        scheduler_cls="testing.draft_recorder.DraftRecorder", additional_config={"draft_log": str(draft_log)})
    yield engine
    stop_engine(engine)
    del engine


def run(llm, draft_log, ids: list[int], salt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """One greedy request: its tokens, cached prompt tokens, per-step drafts and accepted counts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = log_lines(draft_log)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False)
    steps = read_drafts(draft_log, salt, after=before)
    # a verify step runs 1 + len(drafts) tokens; the computed count advances by 1 + accepted
    accepted = [nxt - c - 1 for (c, _), (nxt, _) in zip(steps, steps[1:])]
    # A resumed request with one prompt token left is padded by vLLM's scheduler to a whole
    # verify step with -1 placeholders (vllm/v1/core/sched/scheduler.py, pad_spec_decode:
    # a uniform batch for CUDA graphs), local hit or external alike; nothing was drafted.
    drafts = [[] if d and all(t == -1 for t in d) else d for _, d in steps]
    return {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
            "drafts": drafts, "accepted": accepted}


@pytest.mark.parametrize("n", [2 * C - 1, 2 * C, 2 * C + 1])
def test_reloaded_with_drafts_equals_cold_at_boundary_lengths(llm, draft_log, n):
    ids = random_prompt(n, seed=n)
    cold = run(llm, draft_log, ids, f"boundary-{n}")
    llm.reset_prefix_cache()
    reloaded = run(llm, draft_log, ids[:], f"boundary-{n}")
    assert cold["cached"] == 0
    assert reloaded["cached"] == C * ((n - 1) // C), "resumed at the strict-prefix checkpoint"
    assert reloaded["tokens"] == cold["tokens"]
    # the first row is the step that finishes the prompt (nothing drafted yet), then K a step
    assert cold["drafts"][0] == [] and len(cold["drafts"]) > 1 and all(len(d) == K for d in cold["drafts"][1:])
    assert reloaded["drafts"] == cold["drafts"]
    assert reloaded["accepted"] == cold["accepted"]
    assert sum(cold["accepted"]) > 0, "the MTP layer agrees with the model often enough to see a difference"


def test_stored_draft_rows_depend_on_the_prefix_and_next_token_only(llm, draft_log, server):
    """X and Y are equal for two chunks and the token after them, then differ (other tails,
    other last tokens); each is computed under a salt of its own, in steps of one chunk, so
    rows 127 and 255 are the ends of partial prefill steps. Their attention objects (the
    latent and indexer rows of every layer, the MTP layer's among them) must be
    byte-identical, as rows a one-shot prefill computes are: each row from its prefix and
    the next token. On vLLM's padded batch without glm5next_plugin.draft_rows, rows 127 and
    255 came from each prompt's last token. (KDA state objects are checked by the reloads
    above: with drafts on, vLLM pads each state page, and the padding between the conv and
    recurrent parts holds whatever the pool held.)"""
    from cache_server.chunk_keys import lookahead_keys
    from cache_server.client import CacheClient
    from testing.vllm_keys import vllm_chunk_keys

    shared = random_prompt(2 * C + 1, seed=77)
    x = shared + random_prompt(40, seed=78)
    y = shared + random_prompt(71, seed=79)
    assert x[-1] != y[-1]
    objects = []
    for ids, salt in ((x, "rows-x"), (y, "rows-y")):
        run(llm, draft_log, ids, salt, max_tokens=2)
        keys = lookahead_keys(vllm_chunk_keys(ids, C, C, salt), ids, C, 1, 0, 2)
        index = {key: k for k, key in enumerate(keys)}
        with CacheClient(server.url, timeout_s=60) as c:
            ((namespace, status),) = c.stats()["namespaces"].items()
            groups = [int(g) for g, name in status["object_groups"].items() if name != "kda_state"]
            wanted = [(key, g, 0) for key in keys for g in groups]
            deadline = time.monotonic() + 60  # saves land from the worker's background thread
            while True:
                found = {(index[w[0]], w[1]): bytes(o) for w, o in zip(wanted, c.get(namespace, wanted))
                         if o is not None}
                if len(found) == len(wanted) or time.monotonic() > deadline:
                    break  # (short of them: the assertion below says how many)
                time.sleep(0.1)
        objects.append(found)
    assert len(objects[0]) == len(objects[1]) == 2 * len(groups) >= 4  # latent and indexer, both chunks
    differing = [key for key in objects[0] if objects[0][key] != objects[1][key]]
    assert differing == [], f"(chunk, group) objects whose bytes depend on the prompt's tail: {differing}"


def test_an_image_prompt_with_drafts_reloads_as_cold(llm, draft_log):
    """MTP with an image: the drafter reads the target's hidden states (which carry the
    image) and the placeholder token's embedding, so its rows at image positions are named
    by the keys that name the image's pixels. A prompt with the image in chunk 1, cold, then
    reloaded from the server at the strict prefix (past the image): the same tokens, drafts
    and acceptance."""
    import random

    from PIL import Image
    from vllm import SamplingParams

    rng = random.Random(5)
    image = Image.frombytes("RGB", (112, 112), bytes(rng.randrange(256) for _ in range(112 * 112 * 3)))
    text = random_prompt(2 * C + 60, seed=55)
    ids = text[:C + 20] + [10, 14, 11] + text[C + 20:]  # <|begin_of_image|> <|image|> <|end_of_image|>

    def go(salt):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        before = log_lines(draft_log)
        (o,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}, "cache_salt": salt}],
                            params, use_tqdm=False)
        steps = read_drafts(draft_log, salt, after=before)
        return list(o.outputs[0].token_ids), o.num_cached_tokens or 0, len(o.prompt_token_ids), steps

    cold = go("image-drafts")
    llm.reset_prefix_cache()
    llm.llm_engine.engine_core.reset_encoder_cache()
    reloaded = go("image-drafts")
    assert cold[1] == 0 and reloaded[1] == C * ((reloaded[2] - 1) // C) > C + 20
    assert reloaded[0] == cold[0]
    assert [d for _, d in reloaded[3]][1:] == [d for _, d in cold[3]][1:]  # after the step finishing the prompt


FORK_SEEDS = (2, 3)  # two forks; each changes drafts when served the other prompt's rows (control)
FORK_TOKENS = 64  # generated per fork request: one draft row among 2C shows in a few steps only


def _fork_prompts(seed: int) -> tuple[list[int], list[int], list[int]]:
    """A = S + [x, z] with S two chunks; B = S + [y], differing from A exactly at the token
    after chunk 1 (position 2C); D = S + [x, w], differing from A one token later."""
    shared = random_prompt(2 * C, seed=900 + seed)
    a = shared + random_prompt(2, seed=950 + seed)
    b = shared + [(a[2 * C] + 1) % 512 or 16]
    d = a[: 2 * C + 1] + [(a[2 * C + 1] + 1) % 512 or 16]
    return a, b, d


@pytest.mark.parametrize("seed", FORK_SEEDS)
def test_a_fork_at_a_chunk_boundary_drafts_as_a_cold_run(llm, draft_log, seed):
    """B shares A's first two chunks but not the token after them, so chunk 1's MTP rows
    (the last one computed from A's token 2C) are not B's: B resumes at chunk 0's end and
    drafts exactly as a cold B. D forks one token later, so all of chunk 1 is D's: it
    resumes at 2C, with a cold D's drafts too."""
    a, b, d = _fork_prompts(seed)
    salt = f"fork-{seed}"
    run(llm, draft_log, a, salt, FORK_TOKENS)  # computes and saves A's chunks
    cold = {}
    for name, ids in (("b", b), ("d", d)):
        llm.reset_prefix_cache()
        cold[name] = run(llm, draft_log, ids, f"{salt}-cold-{name}", FORK_TOKENS)
    resumed = {}
    for name, ids in (("b", b), ("d", d)):
        llm.reset_prefix_cache()
        resumed[name] = run(llm, draft_log, ids, salt, FORK_TOKENS)
    assert resumed["b"]["cached"] == C, "the chunk before the fork holds A's draft row: not B's"
    assert resumed["d"]["cached"] == 2 * C
    for name in ("b", "d"):
        assert resumed[name]["tokens"] == cold[name]["tokens"]
        assert resumed[name]["drafts"] == cold[name]["drafts"], name
        assert resumed[name]["accepted"] == cold[name]["accepted"], name


def test_control_without_the_lookahead_rule_the_fork_drafts_differ(tmp_path_factory):
    """The control: a cache that reuses chunk 1 for B although B's token after it differs.
    vLLM's own prefix cache is such a cache when its EAGLE block drop (which recomputes the
    last block of every local hit for this reason) is switched off
    (``disable_eagle_block_drop``; the connector refuses that setting and serves without
    the external cache). B then resumes at 2C on A's rows and its drafts are not a cold B's
    (measured: 2 and 3 of 64 steps differ at these two forks): without the lookahead rule the
    fork test above would fail."""
    from vllm import LLM

    import glm5next_tiny

    ckpt = tmp_path_factory.mktemp("tiny_mtp_control")
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    log = tmp_path_factory.mktemp("control") / "drafts.jsonl"
    engine = LLM(model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
                 max_model_len=4096, enforce_eager=True, max_num_batched_tokens=C, prefix_cache_retention_interval=C,
                 seed=0, speculative_config={**MTP, "disable_eagle_block_drop": True},
                 scheduler_cls="testing.draft_recorder.DraftRecorder", additional_config={"draft_log": str(log)})
    differing = []
    try:
        for seed in FORK_SEEDS:
            a, b, _ = _fork_prompts(seed)
            engine.reset_prefix_cache()
            cold_b = run(engine, log, b, f"control-cold-{seed}", FORK_TOKENS)
            engine.reset_prefix_cache()
            run(engine, log, a, f"control-{seed}", FORK_TOKENS)
            polluted_b = run(engine, log, b, f"control-{seed}", FORK_TOKENS)  # vLLM's local cache, no reset
            assert polluted_b["cached"] == 2 * C, "B resumed on chunk 1, whose last draft row is A's"
            assert polluted_b["tokens"] == cold_b["tokens"], "drafts never change greedy output"
            differing.append(sum(x != y for x, y in zip(polluted_b["drafts"], cold_b["drafts"])))
    finally:
        stop_engine(engine)
        del engine
    assert all(n > 0 for n in differing), f"steps whose drafts differ from a cold B: {differing}"
