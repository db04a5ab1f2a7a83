"""Images on a token-in/token-out engine (``skip_tokenizer_init``) with GlmCacheConnector:
served and cached, named by their pixels as with a tokenizer (issue 33, item 5).

Without a tokenizer vLLM's chat API refuses every request, so an image reaches the model
as token ids (``<|begin_of_image|><|image|><|end_of_image|>``, ids 10, 14, 11 in the tiny
checkpoint) with its data: vLLM's offline API here, or its ``/inference/v1/generate``
route. The plugin's processor expands the ``<|image|>`` id without a tokenizer
(:mod:`glm5next_plugin.multimodal`); the connector names the image by its processed
tensors (:mod:`connector.media`), which no tokenizer enters.

One offline ``vllm.LLM`` of the tiny GLM-5.3-Flash copied without its tokenizer files
(float32, chunk 128, one image a prompt, vLLM's processor cache off), one real
glm-cache-server; a prompt of 200 ids, one 112x112 image (16 tokens), 200 ids: 418 tokens,
the image at positions 201-216, in the second chunk. After vLLM's prefix cache is reset
each time:

- the same image resumes 384 tokens (past the image) with the cold run's greedy tokens;
- another image behind the same token ids resumes only the 128 tokens before it;
- that image, sent again, resumes 384.

Measured on the shared 2-core machine (``.venv/bin/python -m pytest
tests/engine/test_skip_tokenizer_init_images_e2e.py -q``): 277 s while other engines ran, most
of it the engine start; without the plugin's fix the engine stops at start-up
("Glm5NextImageProcessing requires a tokenizer ...", 74 s).
"""

from __future__ import annotations

import random
import shutil

import pytest

from testing.engines import connector_engine, stop_engine
from testing.server_process import ServerProcess

pytestmark = pytest.mark.engine

C = 128
TOKENS = 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
_rng = random.Random(4)
PROMPT = ([_rng.randrange(16, 512) for _ in range(200)] + [10, 14, 11]
          + [_rng.randrange(16, 512) for _ in range(200)])


def _image(seed: int, size: int = 112):
    from PIL import Image

    rng = random.Random(seed)
    return Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from glm5next_tiny import ensure_checkpoint

    root = tmp_path_factory.mktemp("skip-tok-images")
    full = root / "glm5next-tiny"
    ensure_checkpoint(full)
    copy = root / "glm5next-tiny-no-tokenizer"
    copy.mkdir()
    for f in full.iterdir():
        if f.is_file() and f.name not in TOKENIZER_FILES:
            shutil.copy2(f, copy / f.name)
    assert not any((copy / n).exists() for n in TOKENIZER_FILES)
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        engine = connector_engine(copy, srv.url, dtype="float32", skip_tokenizer_init=True,
                                  max_num_batched_tokens=C, prefix_cache_retention_interval=C, seed=0,
                                  limit_mm_per_prompt={"image": 1}, mm_processor_cache_gb=0)
        yield engine
        stop_engine(engine)
        del engine


def _run(llm, image) -> tuple[list[int], int, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    (o,) = llm.generate([{"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image}}], params,
                        use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0, len(o.prompt_token_ids)


def test_images_are_served_and_keyed_by_their_pixels_without_a_tokenizer(llm):
    cold, cached, n = _run(llm, _image(1))
    assert n == len(PROMPT) - 1 + 16 == 418  # the <|image|> id became the image's 16 tokens
    assert cached == 0 and len(cold) == TOKENS
    llm.reset_prefix_cache()  # only glm-cache-server can serve what follows
    warm, cached, _ = _run(llm, _image(1))
    assert cached == (n - 1) // C * C == 384, "the image's chunks did not resume from the server"
    assert warm == cold
    llm.reset_prefix_cache()
    other, cached, _ = _run(llm, _image(2))
    assert cached == C, "another image behind the same token ids resumed past the chunk before it"
    llm.reset_prefix_cache()
    again, cached, _ = _run(llm, _image(2))
    assert cached == 384 and again == other
