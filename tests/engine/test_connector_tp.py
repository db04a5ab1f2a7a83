"""GlmCacheConnector at tensor parallel 2: the plugin (KDA heads sharded, MLA latent rows
replicated) in a real vLLM CPU engine with two workers and MTP drafts on vLLM's defaults, and
a real glm-cache-server.

What TP adds: every worker saves and loads its own KDA state shard (one object per rank),
while the sparse-MLA rows are the same on both ranks and are stored once (TP rank 0 saves
them under rank 0; both ranks load that copy). Reloaded prompts at chunk boundaries must
equal cold ones, and the server must hold half the attention bytes a per-rank layout would.

Thread binding: as in tests/engine/test_plugin_tp.py, the TP 2 engine is started the way vLLM's
CPU docs tell users to on a machine with one NUMA node: one core set per TP rank in
``VLLM_CPU_OMP_THREADS_BIND``.
"""

from __future__ import annotations

import os
import random
import time

import pytest

import glm5next_tiny
from cache_server.client import CacheClient
from testing.engines import connector_engine, stop_engine

pytestmark = pytest.mark.engine

C = 128  # the server's minimum chunk == the tiny checkpoint's unified block
# MTP drafts on vLLM's defaults (the padded drafter batch), as operators serve GLM-5.3-Flash:
# the MTP layer's rows are replicated on both ranks like the target's latent rows
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


SERVER_ARGS = ("--chunk-size", str(C), "--l1-size-gb", "1")  # the server fixture's (conftest.py)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"TP 2 needs 2 cores, {len(cores)} allowed")
    ckpt = tmp_path_factory.mktemp("tiny_tp_connector")
    glm5next_tiny.main([str(ckpt), "--seed", "3", "--linear-num-heads", "4"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
        engine = connector_engine(ckpt, server.url, dtype="float32", tensor_parallel_size=2,
                                  max_num_batched_tokens=C, prefix_cache_retention_interval=C, seed=0,
                                  speculative_config=MTP)
    yield engine
    stop_engine(engine)


def _run(llm, prompt, salt, max_tokens=32):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
    c = o.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], o.num_cached_tokens or 0


@pytest.mark.parametrize("k", [1, 3])
def test_tp2_boundary_lengths_reloaded_equal_cold(llm, k):
    """Prompts of k*C-1, k*C, k*C+1 tokens, cold then reloaded at the strict prefix: the same
    greedy tokens. With drafts a step's tokens are scored in verify windows whose shape
    depends on what was accepted and on where the prompt resumed (vLLM pads a one-token
    resume to a whole window), and float32 sums over other shapes round differently, so
    log-probs agree within 1e-4, not bit for bit (drafts off they are bit-equal: the
    sweep of tests/engine/test_connector_e2e.py)."""
    for i, n in enumerate([k * C - 1, k * C, k * C + 1]):
        ids = _prompt(n, 70 * k + i)
        cold = _run(llm, ids, f"tp2-sweep-{n}")
        llm.reset_prefix_cache()
        reloaded = _run(llm, ids, f"tp2-sweep-{n}")
        assert cold[2] == 0 and reloaded[2] == C * ((n - 1) // C), f"length {n}"
        assert reloaded[0] == cold[0], f"length {n}: continuation differs from cold"
        worst = max(abs(a - b) for a, b in zip(reloaded[1], cold[1]))
        assert worst < 1e-4, f"length {n}: log-probs {worst} apart"


def _new_objects(before: dict, after: dict) -> tuple[dict, list[int], dict[str, int]]:
    """The TP 2 namespace's entry, its replicated groups, and the objects each group gained."""
    (ns,) = [n for n, v in after["namespaces"].items() if v.get("world_size") == 2]
    entry = after["namespaces"][ns]
    groups = set(after["objects_by_group"]) | set(before["objects_by_group"])
    new = {g: after["objects_by_group"].get(g, 0) - before["objects_by_group"].get(g, 0) for g in groups}
    return entry, sorted(entry["replicated_groups"]), new


def _landed(before: dict, after: dict) -> bool:
    """Whether both ranks' saves of the 5-chunk prompt are on the server: 5 new objects in
    each replicated group, and at least one per rank in every other group."""
    if not any(v.get("world_size") == 2 for v in after["namespaces"].values()):
        return False
    _, replicated, new = _new_objects(before, after)
    states = [g for g in new if int(g) not in replicated]
    return (all(new.get(str(g), 0) == 5 for g in replicated)
            and bool(states) and all(new[g] >= 2 and new[g] % 2 == 0 for g in states))


def test_tp2_stores_the_replicated_latent_once_and_states_per_rank(llm, server):
    prompt = _prompt(5 * C + 10, seed=99)
    salt = "tp2-bytes"
    client = CacheClient(server.url, timeout_s=60)
    before = client.stats()
    _run(llm, prompt, salt, max_tokens=4)
    deadline = time.monotonic() + 60  # the saves leave from both ranks' background threads
    after = client.stats()
    while not _landed(before, after) and time.monotonic() < deadline:
        time.sleep(0.2)
        after = client.stats()
    (ns,) = [n for n, v in after["namespaces"].items() if v.get("world_size") == 2]
    entry, replicated, new = _new_objects(before, after)
    names = entry["object_groups"]  # the plugin's row split: latent and indexer apart
    assert sorted(names[str(g)] for g in replicated) == ["indexer_cache", "mla_latent"]
    latent = next(g for g in replicated if names[str(g)] == "mla_latent")
    states = [g for g in new if int(g) not in replicated]
    assert all(new[str(g)] == 5 for g in replicated), new  # one object per chunk, not one per rank
    assert states and all(names[g] == "kda_state" for g in states)
    assert all(new[g] >= 2 and new[g] % 2 == 0 for g in states)  # every state: one per rank
    # the keys: latent under rank 0 only, each state under ranks 0 and 1
    from cache_server.chunk_keys import lookahead_keys
    from testing.vllm_keys import vllm_chunk_keys

    hashes = lookahead_keys(vllm_chunk_keys(prompt, C, C, salt), prompt, C, 1, 0, 5)  # MTP: the next token too
    found = client.request({"op": "get", "ns": ns, "keys": [[hashes[0], latent, 1], [hashes[0], latent, 0]]})[0]
    assert found["found"] == [False, True]
    status = server.status()
    # attention on the server is half of what two per-rank copies would be
    saved = status["namespaces"][ns]["bytes_saved_by_storing_once"]
    assert saved == status["namespaces"][ns]["replicated_bytes"] > 0
    client.close()
