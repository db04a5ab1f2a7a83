"""Admission rules: whether a request may use the external cache at all, and what its
``kv_transfer_params`` ask of it, decided before anything is looked up (the lookup
protocol itself is the scheduler's,
:meth:`connector.scheduler.SchedulerSide.get_num_new_matched_tokens`)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from connector.config import logger
from connector.handoff import pd_flags
from connector.lmcache_settings import request_params
from connector.media import MediaUnnamed, request_items

if TYPE_CHECKING:
    from connector.requests import RequestState

# Distinct unhonoured kv_transfer_params names said in the log (clients choose them).
MAX_WARNED_PARAMS = 32


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


class AdmissionRules:
    """The engine's admission rules (scheduler thread). ``keys_name_media``: the chunk keys
    name images (vLLM's block hashes); ``trust_media_ids``: vLLM's media identifiers are
    taken as they are; ``stats``: the connector's counters."""

    def __init__(self, keys_name_media: bool, trust_media_ids: bool, stats: collections.Counter[str]) -> None:
        self._keys_name_media = keys_name_media
        self._trust_media_ids = trust_media_ids
        self._stats = stats
        self.warned_params: set[str] = set()  # kv_transfer_params keys said to be ignored (bounded)
        self._logged_uncacheable: set[str] = set()
        # vLLM's prefix-cache map holding blocks of replaced weights (set by a change of weights)
        self.stale_map: Any = None

    def enter(self, state: RequestState, num_computed_tokens: int, current_map: Any) -> None:
        """A request vLLM asks about (each time it asks): served without the external cache
        (``state.bypass``) where it resumes from blocks of replaced weights
        (:meth:`stale_weights`); otherwise its parameters are read (once)."""
        self.stale_weights(state, num_computed_tokens, current_map)
        if state.bypass is None:
            self.read_params(state)

    def read_params(self, state: RequestState) -> None:
        """Read a request's ``kv_transfer_params`` once into its record: LMCache's
        ``lmcache.max_offload_tokens`` (saves stop there) and ``lmcache.skip_load`` (no
        lookup), and vLLM's PD flags (:func:`connector.handoff.pd_flags`). Strict prefix is
        operator policy: an API client must not be able to turn it off (and, with decode
        saves, store wrong states under shared keys). A request asking for it, or for an
        LMCache per-request setting this connector does not honour, or sending a malformed
        value, is served without it; each key is said once (at most
        :data:`MAX_WARNED_PARAMS` names, cut to 64 characters: clients choose them), so a
        client relying on it learns why."""
        if state.params_read:
            return
        state.params_read = True
        params = getattr(state.request, "kv_transfer_params", None)
        state.offload_cap, state.skip_load, unhonoured = request_params(params)
        state.remote_decode, state.remote_prefill, state.prefill_chunks = pd_flags(params)
        if isinstance(params, dict) and "glm_strict_prefix" in params:
            unhonoured.append("glm_strict_prefix")
        self._stats["params_ignored"] += len(unhonoured)
        for key in unhonoured:
            if key in self.warned_params or len(self.warned_params) >= MAX_WARNED_PARAMS:
                continue
            self.warned_params.add(key)
            logger.warning(
                "GlmCacheConnector: ignoring kv_transfer_params %.64s of request %.64s: %s", key,
                state.request.request_id,
                "strict prefix is operator policy (kv_connector_extra_config strict_prefix)"
                if key == "glm_strict_prefix" else "not honoured by this connector (honoured: "
                "lmcache.max_offload_tokens as a non-negative integer, lmcache.skip_load)",
            )

    def uncacheable(self, state: RequestState) -> bool:
        """True for requests whose keys would not capture their inputs (logged once per
        kind). Names a request's images on first sight (:mod:`connector.media`)."""
        request = state.request
        reason = uncacheable_reason(request, keys_name_media=self._keys_name_media)
        if reason is None and state.media is None and getattr(request, "mm_features", None):
            try:  # trusted ids: vLLM's block hashes name the images as they are
                if not self._trust_media_ids:
                    state.media_items = request_items(request)
                state.media = [(it.offset, it.digest) for it in state.media_items]
            except MediaUnnamed as e:
                reason = f"multimodal inputs whose pixels cannot be named ({e})"
        if reason is None:
            return False
        if reason not in self._logged_uncacheable:
            self._logged_uncacheable.add(reason)
            logger.info(
                "GlmCacheConnector: requests with %s are not looked up or saved (%s); first: %s", reason,
                "chunk_keys lmcache hashes token ids only, which name no image; chunk_keys vllm caches them"
                if reason == "multimodal inputs" else "their keys would not name everything their KV depends on",
                request.request_id,
            )
        return True

    def stale_weights(self, state: RequestState, num_computed_tokens: int, current_map: Any) -> None:
        """After an in-place change without a reset, vLLM's prefix cache holds blocks the
        old weights computed: a request resuming from it is served without the external
        cache (its saves would carry those blocks into the new weights' namespace), until
        vLLM's prefix cache is reset (``current_map``: vLLM's prefix-cache map now)."""
        if self.stale_map is None or state.bypass is not None:
            return
        if current_map is not None and current_map is not self.stale_map:
            self.stale_map = None
            logger.info("GlmCacheConnector: vLLM's prefix cache was reset since the weights changed; requests "
                        "resuming from it are cached again")
            return
        if num_computed_tokens > 0:
            state.bypass = "resumes from vLLM's prefix cache, which holds blocks of replaced weights"
            state.scheduled = False
            self._stats["weights_stale_local"] += 1
