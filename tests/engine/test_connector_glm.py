"""GlmCacheConnector on the generated GLM-5.3-Flash checkpoint (the project's plugin:
KDA state groups + sparse-MLA group, its vision tower) with a real glm-cache-server: one
engine for the module, shared by four groups of tests (each engine start-up costs about
30 s of the suite's engine lane).

The tiny checkpoint's unified block N is 128 while the server's minimum chunk is 256, so
C = 2N: a chunk spans two attention blocks, and vLLM keeps state snapshots on its own
128-token grid. The engine therefore runs with ``max_num_batched_tokens`` = C and
``prefix_cache_retention_interval`` = C, so prefill steps end, and states are kept, on
chunk boundaries (the connector warns at start-up when they are not). It accepts one image
per prompt (the image tests) and carries a worker extension that names vLLM's KV cache
groups (the no-resend test). Requests are compared one at a time (see
test_connector_e2e.py for why); every test uses salts of its own.

1. Boundary sweep: prompts of k*C-1, k*C, k*C+1 tokens reloaded equal cold.
2. No byte is sent twice: on a turn that resumes from vLLM's own prefix cache, the connector
   learns from the lookup what the server already holds (attention from chunk 0, the states
   at the local boundary) and sends only the new chunks. A lookup that only started past the
   local hit would find nothing deeper, and every chunk from 0 (and the state at the local
   boundary) would be copied and sent again; the server answers EXISTS for each such put,
   which its ``puts_existing`` counter counts.
3. Image prompts: each computed cold (under a salt of its own), then, after vLLM's local
   prefix cache is reset, reloaded under the shared salt's saved objects: the reload resumes
   at the strict prefix when the image is the same one at the same place, and its greedy
   tokens equal the cold run's. A resume point before, inside and after the image's
   placeholders is each tested (inside: with vLLM's encoder cache reset too, the vision tower
   runs again and the model takes the embeddings from the resume point on). Another image, or
   the same image one token later, resumes only at the chunks before the image.
4. A router finds what the connector saved (``/query_by_hash`` with vLLM's block hashes).
"""

from __future__ import annotations

import http.client
import json
import random
import time

import pytest
from PIL import Image

from cache_server.client import CacheClient
from testing.engines import assert_boundary_reloads_equal_cold, generate_one, random_prompt, stop_engine, tiny_glm_engine
from testing.vllm_keys import vllm_chunk_keys, vllm_hashed_request

pytestmark = pytest.mark.engine

C = 256
CONTINUATION = 16
SPAN = 128  # vLLM hashes this float32 engine's blocks every 128 tokens (its start-up log says)


_prompt = random_prompt


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C, limit_mm_per_prompt={"image": 1},
                             worker_extension_cls="testing.engines.CacheGroupProbe")
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, prompt, salt, max_tokens=CONTINUATION):
    return generate_one(llm, prompt, salt, max_tokens)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_glm_boundary_sweep_reloaded_equals_cold(llm, k):
    assert_boundary_reloads_equal_cold(llm, _run, _prompt, C, k, seed=40 * k, salt="glm-sweep")


def test_glm_reload_of_a_longer_prompt_mid_chunk(llm):
    """1200 tokens: the strict prefix (1024) is a chunk boundary but not vLLM's replay
    boundary (1152): the state there exists only because steps end on chunks."""
    prompt = _prompt(1200, seed=77)
    cold = _run(llm, prompt, "glm-1200", max_tokens=16)
    llm.reset_prefix_cache()
    reloaded = _run(llm, prompt, "glm-1200", max_tokens=16)
    assert reloaded[2] == 1024
    assert reloaded[0] == cold[0] and reloaded[1] == cold[1]


# -- 2. no byte sent twice --------------------------------------------------------------------------

def _run_ids(llm, prompt, salt, max_tokens=2):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0


def _settled(client, timeout_s: float = 60.0):
    """Server stats once background saves stopped changing them (the stored bytes the same
    across three reads 0.25 s apart), polled for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    seen = [client.stats()]
    while len(seen) < 4 or seen[-1]["stored_bytes_total"] != seen[-3]["stored_bytes_total"]:
        assert time.monotonic() < deadline, (
            f"the saves did not settle within {timeout_s}s: stored bytes {[s['stored_bytes_total'] for s in seen[-4:]]}")
        time.sleep(0.25)
        seen.append(client.stats())
    return seen[-1]


@pytest.mark.parametrize(("n1", "local"), [(1000, 896), (1025, 1024)])
def test_local_hit_turn_sends_only_new_chunks(llm, server, n1, local):
    """Turn 1 saves attention chunks 0-2 (0-3 for 1025 tokens) and states on the chunk
    grid; turn 2 extends it and resumes from vLLM's local cache at its replay boundary:
    896 (mid-chunk: only attention could be re-sent) or 1024 (a chunk boundary: the
    state there was re-offered too)."""
    client = CacheClient(server.url, timeout_s=60)
    salt = f"turns-{n1}"
    turn1 = _prompt(n1, seed=n1)
    turn2 = turn1 + _prompt(500, seed=n1 + 1)
    _run_ids(llm, turn1, salt)
    s1 = _settled(client)
    (namespace,) = s1["namespaces"]  # the one engine's
    out2, cached2 = _run_ids(llm, turn2, salt)  # vLLM's prefix cache still holds turn 1
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
    out3, cached3 = _run_ids(llm, turn2, salt)
    assert cached3 >= 3 * C and out3 == out2
    client.close()


# -- 3. image prompts --------------------------------------------------------------------------------

IMAGE_CONTINUATION = 12
BOI, IMAGE, EOI = 10, 14, 11  # the tiny checkpoint's <|begin_of_image|>, <|image|>, <|end_of_image|>


def _image(seed: int, size: int = 112) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))


def _image_prompt(before: int, after: int, seed: int) -> list[int]:
    """``before`` text tokens, one image's markers, ``after`` text tokens (vLLM expands the
    image token to the image's placeholders)."""
    rng = random.Random(seed)
    text = [rng.randrange(16, 512) for _ in range(before + after)]
    return text[:before] + [BOI, IMAGE, EOI] + text[before:]


def _run_image(llm, ids: list[int], image: Image.Image, salt: str) -> tuple[list[int], int, list[int]]:
    """Greedy continuation: (tokens, cached prompt tokens, the prompt as the engine ran it)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=IMAGE_CONTINUATION, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}, "cache_salt": salt}],
                        params, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0, list(o.prompt_token_ids)


def _span(prompt: list[int]) -> tuple[int, int]:
    """[first, last + 1) of the image's placeholder tokens in the engine's prompt."""
    at = [i for i, t in enumerate(prompt) if t == IMAGE]
    assert at and at == list(range(at[0], at[-1] + 1))
    return at[0], at[-1] + 1


def _reset_local(llm):
    """vLLM's local prefix cache and its encoder cache: a reload takes KV only from the
    server, and image embeddings it needs (a resume point inside an image) only from
    running the vision tower again."""
    llm.reset_prefix_cache()
    llm.llm_engine.engine_core.reset_encoder_cache()


def _cold_then_reloaded(llm, ids, image, salt):
    cold = _run_image(llm, ids, image, f"{salt}-cold")
    saved = _run_image(llm, ids, image, salt)  # computes it under the shared salt and saves it
    assert saved[0] == cold[0]
    _reset_local(llm)
    return cold, _run_image(llm, ids, image, salt)


@pytest.mark.parametrize("where", ["after", "inside", "before"])
def test_reload_of_an_image_prompt_equals_cold(llm, where):
    """The resume point (strict prefix) after the image (the image early in a long
    prompt), inside its placeholders, and before it."""
    before = {"after": 40, "inside": 2 * C - 8, "before": 2 * C + 20}[where]
    total = {"after": 900, "inside": 2 * C + 100, "before": 2 * C + 100}[where]
    ids = _image_prompt(before, total - before, seed=len(where))
    (cold, cold_hit, prompt), (tokens, hit, _) = _cold_then_reloaded(llm, ids, _image(1), f"where-{where}")
    first, end = _span(prompt)
    strict = C * ((len(prompt) - 1) // C)
    assert cold_hit == 0
    assert hit == strict > 0
    assert {"after": end <= hit, "inside": first < hit < end, "before": hit <= first}[where], (first, end, hit)
    assert tokens == cold


def test_another_image_or_place_resumes_only_before_the_image(llm):
    ids = _image_prompt(C + 40, 500, seed=7)
    _, (_, hit, prompt) = _cold_then_reloaded(llm, ids, _image(2), "swap")
    assert hit == C * ((len(prompt) - 1) // C)  # the same image and place: the strict prefix
    _reset_local(llm)
    cold_other = _run_image(llm, ids, _image(3), "swap-other-cold")[0]
    _reset_local(llm)
    tokens, hit, _ = _run_image(llm, ids, _image(3), "swap")
    assert hit == C  # chunk 0 is text only; from the image's chunk on, the keys name the pixels
    assert tokens == cold_other
    moved = _image_prompt(C + 41, 499, seed=7)  # the same text, the image one token later
    assert moved[:C + 40] == ids[:C + 40] and moved[C + 41] == BOI
    _reset_local(llm)
    cold_moved = _run_image(llm, moved, _image(2), "swap-moved-cold")[0]
    _reset_local(llm)
    tokens, hit, _ = _run_image(llm, moved, _image(2), "swap")
    assert hit == C
    assert tokens == cold_moved


# -- 4. a router finds what the connector saved ----------------------------------------------------

def test_real_connector_saves_what_a_router_query_finds(llm, server):
    """The tiny GLM-5.3-Flash with GlmCacheConnector (its default keys: vLLM's block hashes)
    saves a 600-token prompt; its hello told the server its key scheme, so /status names the
    span, and a router that hashes the prompt as vLLM does (vLLM's own block hasher, the
    request's salt) finds the strict prefix the connector stored: 2 chunks of 256 (the 88
    tokens after them are a partial chunk). Token ids alone cannot name such chunks: 400."""
    prompt = random_prompt(600, seed=5)
    generate_one(llm, prompt, "router-salt", 4)
    doc = server.status()
    (ns, info), = doc["namespaces"].items()  # the one engine's
    assert info["chunk_keys"]["scheme"] == "vllm" and info["chunk_keys"]["lookahead"] == 0
    span = info["chunk_keys"]["span"]
    model = ns.rsplit("-", 1)[0]
    hashes = vllm_hashed_request("router", prompt, span, "router-salt").block_hashes
    status, got = post(server, "/query_by_hash", {"model": model, "seq_hashes": [h.hex() for h in hashes]})
    assert status == 200 and got == {"default": {ns: {"longest_matched": 512, "CPU": 512}}}
    other = vllm_hashed_request("router", prompt, span, "another-salt").block_hashes
    status, got = post(server, "/query_by_hash", {"model": model, "seq_hashes": [h.hex() for h in other]})
    assert got["default"][ns]["longest_matched"] == 0
    status, got = post(server, "/query", {"model": model, "token_ids": prompt})
    assert status == 400 and "seq_hashes" in got["error"]


def post(server, path: str, body: object) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()
