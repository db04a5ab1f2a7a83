"""Image prompts through a real glm-cache-server: resumed == fresh.

One engine (the tiny GLM-5.3-Flash with its vision tower, float32, chunk 256) and the
module's real server. Each prompt is computed cold (under a salt of its own), then, after
vLLM's local prefix cache is reset, reloaded under the shared salt's saved objects: the
reload resumes at the strict prefix when the image is the same one at the same place, and
its greedy tokens equal the cold run's. A resume point before, inside and after the image's
placeholders is each tested (inside: with vLLM's encoder cache reset too, the vision tower
runs again and the model takes the embeddings from the resume point on). Another image, or the same image one token later,
resumes only at the chunks before the image."""

from __future__ import annotations

import random

import pytest
from engines import stop_engine
from PIL import Image

from tests.engines import tiny_glm_engine

pytestmark = pytest.mark.engine

C = 256
CONTINUATION = 12
BOI, IMAGE, EOI = 10, 14, 11  # the tiny checkpoint's <|begin_of_image|>, <|image|>, <|end_of_image|>


def _image(seed: int, size: int = 112) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))


def _prompt(before: int, after: int, seed: int) -> list[int]:
    """``before`` text tokens, one image's markers, ``after`` text tokens (vLLM expands the
    image token to the image's placeholders)."""
    rng = random.Random(seed)
    text = [rng.randrange(16, 512) for _ in range(before + after)]
    return text[:before] + [BOI, IMAGE, EOI] + text[before:]


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C, limit_mm_per_prompt={"image": 1})
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, ids: list[int], image: Image.Image, salt: str) -> tuple[list[int], int, list[int]]:
    """Greedy continuation: (tokens, cached prompt tokens, the prompt as the engine ran it)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=CONTINUATION, ignore_eos=True)
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
    cold = _run(llm, ids, image, f"{salt}-cold")
    saved = _run(llm, ids, image, salt)  # computes it under the shared salt and saves it
    assert saved[0] == cold[0]
    _reset_local(llm)
    return cold, _run(llm, ids, image, salt)


@pytest.mark.parametrize("where", ["after", "inside", "before"])
def test_reload_of_an_image_prompt_equals_cold(llm, where):
    """The resume point (strict prefix) after the image (the image early in a long
    prompt), inside its placeholders, and before it."""
    before = {"after": 40, "inside": 2 * C - 8, "before": 2 * C + 20}[where]
    total = {"after": 900, "inside": 2 * C + 100, "before": 2 * C + 100}[where]
    ids = _prompt(before, total - before, seed=len(where))
    (cold, cold_hit, prompt), (tokens, hit, _) = _cold_then_reloaded(llm, ids, _image(1), f"where-{where}")
    first, end = _span(prompt)
    strict = C * ((len(prompt) - 1) // C)
    assert cold_hit == 0
    assert hit == strict > 0
    assert {"after": end <= hit, "inside": first < hit < end, "before": hit <= first}[where], (first, end, hit)
    assert tokens == cold


def test_another_image_or_place_resumes_only_before_the_image(llm):
    ids = _prompt(C + 40, 500, seed=7)
    _, (_, hit, prompt) = _cold_then_reloaded(llm, ids, _image(2), "swap")
    assert hit == C * ((len(prompt) - 1) // C)  # the same image and place: the strict prefix
    _reset_local(llm)
    cold_other = _run(llm, ids, _image(3), "swap-other-cold")[0]
    _reset_local(llm)
    tokens, hit, _ = _run(llm, ids, _image(3), "swap")
    assert hit == C  # chunk 0 is text only; from the image's chunk on, the keys name the pixels
    assert tokens == cold_other
    moved = _prompt(C + 41, 499, seed=7)  # the same text, the image one token later
    assert moved[:C + 40] == ids[:C + 40] and moved[C + 41] == BOI
    _reset_local(llm)
    cold_moved = _run(llm, moved, _image(2), "swap-moved-cold")[0]
    _reset_local(llm)
    tokens, hit, _ = _run(llm, moved, _image(2), "swap")
    assert hit == C
    assert tokens == cold_moved
