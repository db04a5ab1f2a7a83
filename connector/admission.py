"""Admission rules: whether a request may use the external cache at all, decided before
anything is looked up (the lookup protocol itself is the scheduler's,
:meth:`connector.scheduler.SchedulerSide.get_num_new_matched_tokens`)."""

from __future__ import annotations

from typing import Any


def uncacheable_reason(request: Any, keys_name_media: bool = False) -> str | None:
    """Why a request's KV must not be shared through the cache, or None.

    Images/video are placeholder tokens whose KV depends on the pixels: cached only where
    the keys name them (``keys_name_media``: vLLM's block hashes, which carry each item's
    identifier and offset, see :mod:`connector.media`), not under the token chain. LoRA
    adapters (other weights, which vLLM's key names by adapter name and path only) and
    prompt embeddings (no token ids; the plugin has neither) are not cached: fail closed
    rather than keyed by something partial."""
    if getattr(request, "mm_features", None) and not keys_name_media:
        return "multimodal inputs"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None
