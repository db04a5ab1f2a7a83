"""Image requests under the default keys (vLLM's block hashes, which name each image and
where it sits): the same image at the same place shares keys; another image, another
offset, another processor setting does not; a client's media id never reaches another
client's KV unless the operator trusts the clients; the token chain leaves images uncached.

A real glm-cache-server process; real scheduler sides (testing/sched_harness.py) and
real vLLM requests whose block hashes vLLM's own hasher computed with their images."""

from __future__ import annotations

import logging

import pytest
import torch

from testing.sched_harness import image_feature, request

C = 256  # the shared server fixture's minimum chunk (conftest.py)
PROMPT = list(range(16, 1016))  # 1000 tokens: strict prefix 3 chunks
AT, LENGTH = 300, 64  # the image's placeholders: inside chunk 1


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(64, 1176, generator=torch.Generator().manual_seed(seed))


def _image_request(rid: str, pixels: torch.Tensor | None, identifier: str = "vllm-digest", at: int = AT,
                   salt: str | None = None):
    return request(rid, PROMPT, salt, hash_block=C, mm_features=[image_feature(identifier, at, LENGTH, pixels)])


def _keys(side, req, n: int = 3) -> list[bytes]:
    assert not side._rules.uncacheable(side._requests.of(req))
    return side.request_keys(req, n)


def test_the_same_image_at_the_same_place_shares_keys_and_text_before_it_shares_with_text(sides):
    side = sides()
    a = _keys(side, _image_request("a", _pixels(1)))
    b = _keys(side, _image_request("b", _pixels(1)))
    assert a == b and len(a) == 3
    text = _keys(side, request("t", PROMPT, None, hash_block=C))
    assert a[0] == text[0]  # chunk 0 ends before the image: text only
    assert a[1] != text[1] and a[2] != text[2]  # the image's chunk and every later one name it


def test_another_image_or_offset_misses(sides):
    side = sides()
    base = _keys(side, _image_request("a", _pixels(1)))
    other_pixels = _keys(side, _image_request("b", _pixels(2), identifier="vllm-digest"))
    assert other_pixels[0] == base[0] and not set(other_pixels[1:]) & set(base)
    moved = _keys(side, _image_request("c", _pixels(1), at=AT + 1))
    assert moved[0] == base[0] and not set(moved[1:]) & set(base)
    later = _keys(side, _image_request("d", _pixels(1), at=600))  # chunk 2 now
    assert later[:2] == _keys(side, request("t", PROMPT, None, hash_block=C), 2)
    assert later[2] != base[2]


def test_a_client_media_id_reaches_another_clients_kv_only_when_trusted(sides):
    """Client B sends its own picture under client A's media id (``multi_modal_uuids``,
    used verbatim by vLLM): vLLM's block hashes are then equal. By default the keys name
    the pixels and B shares nothing past the image; an operator who trusts the fleet's
    clients (``trust_media_ids``) gets vLLM's keys as they are."""
    from testing.vllm_keys import vllm_hashed_request

    a_req = _image_request("a", _pixels(1), identifier="tenant-a-photo")
    b_req = _image_request("b", _pixels(7), identifier="tenant-a-photo")
    assert a_req.block_hashes == b_req.block_hashes  # what vLLM itself would share

    side = sides()
    a, b = _keys(side, a_req), _keys(side, b_req)
    assert a[0] == b[0] and not set(a[1:]) & set(b[1:])

    trusting = sides(trust_media_ids=True)
    ta = _keys(trusting, _image_request("a2", _pixels(1), identifier="tenant-a-photo"))
    tb = _keys(trusting, _image_request("b2", _pixels(7), identifier="tenant-a-photo"))
    assert ta == tb
    # trusted keys are vLLM's block hashes at chunk ends, as for text
    hashed = vllm_hashed_request("x", PROMPT, C, mm_features=[image_feature("tenant-a-photo", AT, LENGTH, None)])
    from cache_server.chunk_keys import block_hash_keys

    assert ta == block_hash_keys(hashed.block_hashes, C, C, 0, 3)


def test_the_processor_settings_and_hasher_are_in_the_namespace(sides):
    """For a model that takes images: another mm hash algorithm or --mm-processor-kwargs is
    another namespace (their objects are never shared); a text-only model's namespace is
    what it was."""
    text_only = sides().namespace
    mm = sides(multimodal={}).namespace
    spaces = {
        text_only,
        mm,
        sides(multimodal={"mm_hasher_algorithm": "sha256"}).namespace,
        sides(multimodal={"mm_processor_kwargs": {"max_image_tokens": 64}}).namespace,
        sides(multimodal={}, trust_media_ids=True).namespace,
    }
    assert len(spaces) == 5
    assert sides(multimodal={}).namespace == mm  # stable
    assert sides(trust_media_ids=True).namespace == text_only  # no images: nothing changes


def test_image_requests_are_uncached_under_the_token_chain_with_one_log_line(sides, caplog):
    side = sides(chunk_keys="lmcache")
    caplog.set_level(logging.INFO, logger="vllm.glm_cache_connector")
    for i in range(3):
        req = _image_request(f"img-{i}", _pixels(1))
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    lines = [r.getMessage() for r in caplog.records if "not looked up or saved" in r.getMessage()]
    assert len(lines) == 1
    assert "multimodal inputs" in lines[0] and "chunk_keys lmcache" in lines[0] and "img-0" in lines[0]
    # a text request on the same side is still asked about (a lookup goes out)
    assert side.get_num_new_matched_tokens(request("t", PROMPT, None, hash_block=C), 0) == (None, False)


def test_an_image_whose_pixels_are_not_on_the_scheduler_is_not_cached(sides):
    """vLLM's shm processor cache keeps processed tensors on the workers only: nothing to
    name the pixels by, so the request is neither looked up nor saved (unless trusted)."""
    side = sides()
    req = _image_request("shm", None)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side._rules.uncacheable(side._requests.of(req))
    trusting = sides(trust_media_ids=True)
    assert not trusting._rules.uncacheable(trusting._requests.of(_image_request("shm2", None)))


@pytest.mark.parametrize("field", ["dtype", "shape", "grid"])
def test_the_digest_names_every_processed_field(field):
    """Two items alike but in one processed field's dtype, shape or value never share a
    digest (the encoder reads all of them)."""
    from connector.media import feature_digest

    pixels = _pixels(3)
    base = image_feature("x", 0, 16, pixels)
    other = image_feature("x", 0, 16, pixels)
    if field == "dtype":
        other.data["pixel_values"].data = pixels.to(torch.float64)
    elif field == "shape":
        other.data["pixel_values"].data = pixels.reshape(32, 2352)
    else:
        other.data["image_grid_thw"].data = torch.tensor([1, 4, 16])
    assert feature_digest(base) == feature_digest(image_feature("x", 0, 16, pixels.clone()))
    assert feature_digest(base) != feature_digest(other)
