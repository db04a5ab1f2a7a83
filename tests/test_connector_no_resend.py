"""No byte is sent twice: on a turn that resumes from vLLM's own prefix
cache, the connector learns from the lookup what the server already holds (attention from
chunk 0, the states at the local boundary) and sends only the new chunks.

A lookup that only started past the local hit would find nothing deeper, and every chunk
from 0 (and the state at the local boundary) would be copied and sent again; the server
answers EXISTS for each such put, which its ``puts_existing`` counter counts.

Tiny GLM-5.3-Flash checkpoint (KDA state groups + sparse MLA), C = 2N = 256, a real
glm-cache-server, one engine for the module (see test_connector_glm.py for the settings).
"""

from __future__ import annotations

import time

import pytest
from engines import random_prompt, stop_engine, tiny_glm_engine

from cache_server.client import CacheClient
from testing.vllm_keys import vllm_chunk_keys

pytestmark = pytest.mark.engine

C = 256
SPAN = 128  # vLLM hashes this float32 engine's blocks every 128 tokens (its start-up log says)


_prompt = random_prompt


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C, worker_extension_cls="engines.CacheGroupProbe")
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, prompt, salt, max_tokens=2):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0


def _settled(client):
    """Server stats once background saves stopped changing them."""
    seen = [client.stats()]
    while len(seen) < 4 or seen[-1]["stored_bytes_total"] != seen[-3]["stored_bytes_total"]:
        time.sleep(0.25)
        seen.append(client.stats())
    return seen[-1]


@pytest.mark.parametrize(("n1", "local"), [(1000, 896), (1025, 1024)])
def test_local_hit_turn_sends_only_new_chunks(llm, server, n1, local):
    """Turn 1 saves attention chunks 0-2 (0-3 for 1025 tokens) and states on the chunk
    grid; turn 2 extends it and resumes from vLLM's local cache at its replay boundary:
    896 (mid-chunk: only attention could be re-sent) or 1024 (a chunk boundary: the
    state there was re-offered too)."""
    client = CacheClient(server.url)
    salt = f"turns-{n1}"
    turn1 = _prompt(n1, seed=n1)
    turn2 = turn1 + _prompt(500, seed=n1 + 1)
    _run(llm, turn1, salt)
    s1 = _settled(client)
    namespace = next(iter(s1["namespaces"]))
    out2, cached2 = _run(llm, turn2, salt)  # vLLM's prefix cache still holds turn 1
    s2 = _settled(client)
    assert cached2 == local, "turn 2 should resume from vLLM's local cache"
    # Nothing was sent that the server already had...
    assert s2["puts_existing"] == s1["puts_existing"]
    # ...and the new chunks were sent and stored.
    assert s2["puts_stored"] > s1["puts_stored"]
    assert s2["stored_bytes_total"] > s1["stored_bytes_total"]
    groups = sorted(int(g) for g in s2["bytes_by_group"])
    names = s2["namespaces"][namespace]["object_groups"]  # what the engine said each holds
    attention = {g for g in groups if names[str(g)] in ("mla_latent", "indexer_cache")}
    assert attention and attention != set(groups) and {names[str(g)] for g in set(groups) - attention} == {"kda_state"}
    (kinds,) = llm.collective_rpc("kv_cache_group_kinds")  # vLLM's own word: one state object group per state group
    assert kinds.count("state") == len(set(groups) - attention)
    hashes = vllm_chunk_keys(turn2, C, SPAN, salt)[:5]
    present = [{g for g, x in zip(groups, client.get(namespace, [(h, g, 0) for g in groups])) if x is not None}
               for h in hashes]
    # Every chunk up to the strict prefix has its attention (states exist only where a
    # prefill step ended on the chunk grid, which a local hit at 896 shifts).
    assert all(attention <= p for p in present), present
    assert all(p <= present[0] for p in present)
    # A third turn loads from the server (prefix cache reset) and matches turn 2's output.
    llm.reset_prefix_cache()
    out3, cached3 = _run(llm, turn2, salt)
    assert cached3 >= 3 * C and out3 == out2
    client.close()
