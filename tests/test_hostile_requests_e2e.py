"""Hostile API clients of ``vllm serve`` with GlmCacheConnector: no request field stops the
engine, and no client can plant one image's KV under another image's name.

Two ``vllm serve`` replicas of the tiny GLM-5.3-Flash (float32, its vision tower, chunk 128,
vLLM's processor cache off so each request's pixels are its own) share one real
glm-cache-server.

- Odd ``kv_transfer_params``, ``cache_salt`` and media uuids (infinities, 10^40, NaN, nested
  objects, wrong types, very long keys and strings) are each sent as a raw JSON body; each
  is answered (200, or vLLM's own 400 for what its API refuses), never a 500, and a plain
  request is answered after each. Before the fix, ``"lmcache.max_offload_tokens": 1e999``
  raised OverflowError inside vLLM's scheduler: a fatal EngineCore error.
- The planting attack: on replica 1 a client sends image A under a uuid equal to vLLM's own
  content hash of image B (anyone holding B can compute it); a later request with B and no
  uuid then resumes from A's rows there (vLLM trusts the uuid: its prefix and encoder caches
  are keyed by it). The connector must not save those rows under the key that names B's
  pixels: replica 2's output for B equals B's cold output, and it resumes only before the
  image.
"""

from __future__ import annotations

import base64
import io
import json
import random
import urllib.error
import urllib.request

import pytest

from testing.server_process import ServerProcess
from validation.serving import VllmServer, chat, connector_config, metric_sum, scrape_metrics

pytestmark = pytest.mark.engine

C = 128
TOKENS = 8


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from glm5next_plugin.tiny_checkpoint import ensure_checkpoint

    ckpt = tmp_path_factory.mktemp("hostile") / "glm5next-tiny"
    ensure_checkpoint(ckpt)
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        engines = [VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(C),
                              "--prefix-cache-retention-interval", str(C), "--dtype", "float32",
                              "--limit-mm-per-prompt", json.dumps({"image": 1}), "--mm-processor-cache-gb", "0",
                              "--max-num-seqs", "4", kv_transfer_config=connector_config(srv.url),
                              max_model_len=4096, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
                   for _ in range(2)]
        try:
            for e in engines:  # both start-ups overlap
                e.launch()
            for e in engines:
                e.wait_ready(progress=False)
            yield engines, srv, str(ckpt)
        finally:
            for e in engines:
                e.stop()


def _raw_post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _completion(prompt: list[int], extra: str = "") -> bytes:
    """A completion request's JSON text with ``extra`` spliced in verbatim (so it can carry
    what Python's json would not write: 1e999, big integer literals, NaN)."""
    base = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    return (base[:-1] + (", " + extra if extra else "") + "}").encode()


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


PROMPT = [random.Random(5).randrange(16, 512) for _ in range(300)]

HOSTILE_FIELDS = [
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 1e999}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": -1e999}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": NaN}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 1e40}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 10000000000000000000000000000000000000000}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": -5}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 12.5}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": "1e999"}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": true}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": [1, 2]}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": ' + _nested(60) + "}",
    '"kv_transfer_params": {"lmcache.skip_load": ' + _nested(60) + "}",
    '"kv_transfer_params": {"lmcache.skip_load": "' + "t" * 100_000 + '"}',
    '"kv_transfer_params": {"lmcache.' + "k" * 100_000 + '": 1}',
    '"kv_transfer_params": {' + ", ".join(f'"lmcache.x{i}": {i}' for i in range(2000)) + "}",
    '"kv_transfer_params": {"glm_strict_prefix": false, "lmcache.skip_load": 1e999}',
    '"kv_transfer_params": [1, 2, 3]',
    '"kv_transfer_params": "lmcache.skip_load"',
    '"kv_transfer_params": 1e999',
    '"cache_salt": "' + "s" * 200_000 + '"',
    '"cache_salt": 1e40',
    '"cache_salt": {"a": [1, 2]}',
    '"cache_salt": ""',
]


def test_no_request_field_stops_the_engine(replicas):
    (engine, _), _srv, _ = replicas
    url = engine.base_url + "/v1/completions"
    plain = _completion(PROMPT[:40])
    assert _raw_post(url, plain)[0] == 200
    before = metric_sum(scrape_metrics(engine.base_url), "vllm:glm_cache_params_ignored_total")
    statuses = []
    for extra in HOSTILE_FIELDS:
        status, body = _raw_post(url, _completion(PROMPT, extra))
        statuses.append(status)
        assert status in (200, 400), f"{extra[:80]}: {status} {body[:300]!r}"
        status, body = _raw_post(url, plain)
        assert status == 200, f"after {extra[:80]}: the engine no longer answers: {status} {body[:300]!r}"
        assert json.loads(body)["choices"][0]["text"] is not None
    # the infinities, NaN and 1e40 reached the connector (vLLM's API refuses a few of the others itself)
    assert statuses[:4] == [200] * 4 and statuses.count(200) >= 12, statuses
    # the malformed caps and unknown keys reached the connector and were counted, not honoured
    after = metric_sum(scrape_metrics(engine.base_url), "vllm:glm_cache_params_ignored_total")
    assert after - before >= 10
    assert engine.proc.poll() is None


def _png(seed: int, size: int = 112) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _vllm_image_id(png: bytes, model_id: str) -> str:
    """vLLM's own identifier for this image when no uuid is given (what its prefix and
    encoder caches key the image by), computed as vLLM's renderer does for a data URL:
    anyone who holds the image can compute it."""
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    return MultiModalHasher.hash_kwargs("blake3", model_id=model_id, image=ImageMediaIO().load_bytes(png))


def _message(png: bytes, uuid: str | None = None) -> list[dict]:
    rng = random.Random(11)
    words = ["cache", "state", "chunk", "prefix", "token", "layer", "block", "server", "the", "of", "and", "to"]
    before = " ".join(rng.choice(words) for _ in range(300))
    after = " ".join(rng.choice(words) for _ in range(200)) + "\nDescribe the image."
    part: dict = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    if uuid is not None:
        part["uuid"] = uuid
    return [{"role": "user", "content": [{"type": "text", "text": before}, part, {"type": "text", "text": after}]}]


def test_a_client_uuid_cannot_plant_one_images_kv_under_anothers_pixels(replicas):
    (one, two), _srv, model_id = replicas
    a, b = _png(1), _png(2)
    forged = _vllm_image_id(b, model_id)
    salt = "tenant-shared"

    # replica 1: A under B's identifier, then B itself (no uuid)
    planted = chat(one.base_url, _message(a, uuid=forged), TOKENS, cache_salt=salt)
    victim = chat(one.base_url, _message(b), TOKENS, cache_salt=salt)
    strict = C * ((victim.prompt_tokens - 1) // C)
    # vLLM's own caches took A's rows for B on replica 1 (the forged id matched): the attack is real
    assert victim.cached_tokens == strict, (victim.cached_tokens, strict)
    assert planted.prompt_tokens == victim.prompt_tokens

    # replica 2: B cold (a salt of its own), then B under the shared salt from the server
    cold_b = chat(two.base_url, _message(b), TOKENS, cache_salt="b-cold")
    assert cold_b.cached_tokens == 0
    assert victim.text != cold_b.text or victim.top_logprobs[0] != cold_b.top_logprobs[0]
    reloaded_b = chat(two.base_url, _message(b), TOKENS, cache_salt=salt)
    assert reloaded_b.text == cold_b.text
    assert reloaded_b.top_logprobs[0] == cold_b.top_logprobs[0]
    # only the text chunks before the image came from the server (they hold text rows only)
    assert C <= reloaded_b.cached_tokens < strict, reloaded_b.cached_tokens

    # replica 1 said so in its counters
    assert metric_sum(scrape_metrics(one.base_url), "vllm:glm_cache_media_withheld_total") >= 1
