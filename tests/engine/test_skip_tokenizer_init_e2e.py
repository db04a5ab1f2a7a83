"""Token-in/token-out workers: ``vllm serve --skip-tokenizer-init`` with GlmCacheConnector
starts and caches text requests sent as token ids (issue 33, item 5).

Router frontends that tokenize themselves (Dynamo's vLLM workers, RL rollout engines)
start vLLM without a tokenizer and send ``prompt`` as a list of token ids. vLLM 0.32 turns
``enable_mm_embeds`` on for every KV consumer (``kv_role`` ``kv_both`` included), so the
API server builds the model's multimodal processor even at ``--limit-mm-per-prompt
'{"image":0}'``, and vLLM's default processor refuses to exist without a tokenizer: before
the fix the engine stopped at start-up ("Glm5NextImageProcessing requires a tokenizer and
cannot be initialized when `skip_tokenizer_init=True`"), while the same engine without the
connector started. The plugin's processor reads token ids only, and says so
(``requires_tokenizer = False``, :mod:`glm5next_plugin.multimodal`).

One ``vllm serve`` of the tiny GLM-5.3-Flash copied without its tokenizer files
(float32, chunk 128, image limit 0), with a real glm-cache-server:

- a 300-token prompt of token ids is served cold and saved; after vLLM's own prefix cache
  is reset, the same request resumes from the server at the strict-prefix depth (256
  tokens: vLLM's external-hit counter, the usage report, the connector's loaded objects)
  and generates the same greedy tokens;
- the chat API, which needs a tokenizer, is refused by vLLM (0.32 answers a 500 with an
  empty message; its reason is in the log), and the engine still answers.

The processor itself profiles an image without a tokenizer (the default image limit):
its dummy prompt is built from the config's image token ids.

Measured on the shared 2-core machine (``.venv/bin/python -m pytest
tests/engine/test_skip_tokenizer_init_e2e.py -q``): 145-191 s while other engines ran, most of it
the engine start; without the plugin's fix the engine stops at start-up with the error
above and both engine tests error, and without its dummy prompt the processor test fails
("You cannot pass text prompts when `skip_tokenizer_init=True`"). Images on such an
engine: ``tests/engine/test_skip_tokenizer_init_images_e2e.py``.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import urllib.error
import urllib.request

import pytest

from cache_server.client import CacheClient
from testing.engines import TIMEOUT_S
from testing.server_process import ServerProcess
from validation.serving import VllmServer, connector_config, metric_sum, post_json, scrape_metrics

pytestmark = pytest.mark.engine

C = 128
TOKENS = 8
_rng = random.Random(33)
PROMPT = [_rng.randrange(16, 512) for _ in range(300)]
RESUMED = (len(PROMPT) - 1) // C * C  # strict prefix: the last prompt token is always computed
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


@pytest.fixture(scope="module")
def no_tokenizer_checkpoint(tmp_path_factory):
    """The tiny checkpoint without any tokenizer file: a worker behind a tokenizing router."""
    from glm5next_tiny import ensure_checkpoint

    root = tmp_path_factory.mktemp("skip-tok")
    full = root / "glm5next-tiny"
    ensure_checkpoint(full)
    copy = root / "glm5next-tiny-no-tokenizer"
    copy.mkdir()
    for f in full.iterdir():
        if f.is_file() and f.name not in TOKENIZER_FILES:
            shutil.copy2(f, copy / f.name)
    assert (full / "tokenizer.json").is_file() and not any((copy / n).exists() for n in TOKENIZER_FILES)
    return copy


@pytest.fixture(scope="module")
def engine(no_tokenizer_checkpoint):
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        e = VllmServer(no_tokenizer_checkpoint, "--skip-tokenizer-init", "--limit-mm-per-prompt",
                       json.dumps({"image": 0}), "--enforce-eager", "--max-num-batched-tokens", str(C),
                       "--prefix-cache-retention-interval", str(C), "--dtype", "float32", "--max-num-seqs", "4",
                       kv_transfer_config=connector_config(srv.url, timeout_s=TIMEOUT_S), max_model_len=4096,
                       env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
        try:
            e.start(progress=False)
            yield e, srv
        finally:
            e.stop()


def _complete(e: VllmServer, prompt: list[int]) -> dict:
    # no logprobs: vLLM decodes them into strings, which needs the tokenizer
    body = {"model": "model", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True}
    return post_json(e.base_url + "/v1/completions", body, timeout_s=300)


def _counters(e: VllmServer) -> tuple[float, float, float]:
    m = scrape_metrics(e.base_url)
    return (metric_sum(m, "vllm:external_prefix_cache_hits_total"),
            metric_sum(m, "vllm:glm_cache_loaded_objects_total"),
            metric_sum(m, "vllm:glm_cache_saved_objects_total"))


def _server_objects(srv: ServerProcess) -> int:
    client = CacheClient(srv.url)
    try:
        return int(client.stats()["objects"])
    finally:
        client.close()


def test_token_ids_are_cached_without_a_tokenizer(engine):
    e, srv = engine
    hits0, loaded0, saved0 = _counters(e)
    cold = _complete(e, PROMPT)
    cold_ids = cold["choices"][0]["token_ids"]
    assert len(cold_ids) == TOKENS and all(isinstance(t, int) for t in cold_ids)
    assert cold["choices"][0]["prompt_token_ids"] == PROMPT  # the ids went in as sent
    assert (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    # the cold run's resumable chunks reached the server (saves land asynchronously: beside
    # a busy loop later than 10 s, in a fresh-clone run at 17056cc; and the engine publishes
    # its count with a step, so the count is asserted after the resend's steps)
    deadline = time.monotonic() + 120  # generous: a hang fails, a loaded machine does not
    while _server_objects(srv) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _server_objects(srv) > 0, "the cold request saved nothing"
    hits, loaded, _ = _counters(e)
    assert hits == hits0 and loaded == loaded0

    assert e.reset_prefix_cache()  # only the server can serve the resend now
    warm = _complete(e, PROMPT)
    hits1, loaded1, saved1 = _counters(e)
    assert saved1 - saved0 > 0, "the engine counted no save of the cold request"
    assert hits1 - hits0 == RESUMED == 256, "the resend did not resume from glm-cache-server"
    assert loaded1 - loaded0 > 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == RESUMED
    assert warm["choices"][0]["token_ids"] == cold_ids


def test_chat_without_a_tokenizer_is_refused_and_the_engine_answers(engine):
    e, _ = engine
    body = json.dumps({"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(e.base_url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    # vLLM's refusal, raised while rendering the chat template: vLLM 0.32 answers a 500 with
    # an empty message (its "Tokenizer not available when `skip_tokenizer_init=True`" is in
    # the engine's log only); not the connector's, the same without it
    assert err.value.code in (400, 500)
    assert json.loads(err.value.read())["error"]["code"] == err.value.code
    assert len(_complete(e, PROMPT[:20])["choices"][0]["token_ids"]) == TOKENS
    assert e.proc.poll() is None


def test_processor_profiles_an_image_without_a_tokenizer(no_tokenizer_checkpoint):
    """At the default image limit vLLM profiles the encoder with the processor's dummy
    inputs; with no tokenizer vLLM leaves their prompt empty, so the image had no
    placeholder to expand. The plugin builds it from the config's image token ids."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    import glm5next_plugin

    glm5next_plugin.register()  # the plugin's model class and its processor, as vLLM's plugin hook does
    mc = ModelConfig(model=str(no_tokenizer_checkpoint), dtype="float32", max_model_len=4096,
                     skip_tokenizer_init=True)
    processor = MULTIMODAL_REGISTRY.create_processor(mc, tokenizer=None)
    mm = processor.get_dummy_mm_inputs({"image": 1})
    placeholders = mm["mm_placeholders"]["image"]
    assert len(placeholders) == 1
    assert placeholders[0].length == processor.info.get_max_image_tokens() > 0
    image_token = int(mc.hf_config.image_token_id)
    ids = mm["prompt_token_ids"]
    start = placeholders[0].offset
    assert ids[start:start + placeholders[0].length] == [image_token] * placeholders[0].length
