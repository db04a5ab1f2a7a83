"""Which requests the cache may serve: those whose keys name everything their KV depends on.
Token-chain keys hash token ids (and the salt) only; vLLM's block hashes also name images
(tests/server/test_connector_media.py). LoRA adapters and prompt embeddings are never cached
(fail closed)."""

from __future__ import annotations

import torch


def _request(**kwargs):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ids = kwargs.pop("prompt_token_ids", list(range(16, 80)))
    return Request("r", ids, SamplingParams(max_tokens=1), None, **kwargs)


def test_plain_and_salted_requests_are_cacheable():
    from connector.admission import uncacheable_reason

    assert uncacheable_reason(_request()) is None
    assert uncacheable_reason(_request(cache_salt="tenant-a")) is None


def test_lora_requests_are_not_cached():
    from vllm.lora.request import LoRARequest

    from connector.admission import uncacheable_reason

    lora = LoRARequest(lora_name="adapter", lora_int_id=1, lora_path="/nonexistent")
    assert uncacheable_reason(_request(lora_request=lora)) == "a LoRA adapter"


def test_prompt_embeddings_are_not_cached():
    from connector.admission import uncacheable_reason

    req = _request(prompt_token_ids=None, prompt_embeds=torch.zeros(64, 8))
    assert uncacheable_reason(req) == "prompt embeddings"


def test_multimodal_requests_are_cached_only_where_keys_name_media():
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from connector.admission import uncacheable_reason

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier="img-0",
                                    mm_position=PlaceholderRange(offset=4, length=16))
    assert uncacheable_reason(_request(mm_features=[feature])) == "multimodal inputs"
    assert uncacheable_reason(_request(mm_features=[feature]), keys_name_media=True) is None

