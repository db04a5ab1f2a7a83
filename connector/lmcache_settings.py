"""``LMCacheMPConnector``'s settings, read by ``GlmCacheConnector``: switching an engine from
LMCache's multiprocess connector to ours is the connector's name only.

Each ``lmcache.*`` key of ``kv_connector_extra_config`` that LMCache's connector reads
(lmcache 0.5.7, ``integration/vllm/lmcache_mp_connector.py`` and
``vllm_multi_process_adapter.py``) is one of:

- the same meaning as one of ours: it sets that setting (``lmcache.mp.host`` and
  ``lmcache.mp.port`` the server URL, ``lmcache.mp.save_decode_cache`` ``save_decode``);
- a value that says what this connector does anyway (``lmcache.mp.hash_algorithm:
  blake3``, our token chain's hash; ``lmcache.mp.nonblocking_lookup_status: true``, lookups
  never block a step): accepted;
- anything else, and any ``lmcache.*`` key not listed: refused by name at start-up
  (ValueError), never ignored.

Per request, ``kv_transfer_params`` may carry LMCache's ``lmcache.max_offload_tokens``
(saves stop at that many tokens, rounded down to a chunk) and ``lmcache.skip_load`` (no
lookup); the others are logged and not honoured (:func:`request_params`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

LMCACHE_DEFAULT_HOST = "tcp://localhost"
LMCACHE_DEFAULT_PORT = 5555


class LMCacheSettingRefused(ValueError):
    """An ``lmcache.*`` setting this connector cannot honour."""


def _strict_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise LMCacheSettingRefused(f"kv_connector_extra_config {key} must be true or false, got {value!r}")


def _only(expected: Any, why: str) -> Callable[[Any, str], None]:
    """A key accepted only at the value that is what this connector does."""

    def check(value: Any, key: str) -> None:
        v = _strict_bool(value, key) if isinstance(expected, bool) else str(value).strip().lower()
        if v != expected:
            raise LMCacheSettingRefused(
                f"GlmCacheConnector cannot honour kv_connector_extra_config {key}={value!r}: {why}; "
                f"remove it (or set {expected!r})")

    return check


def _refuse(why: str) -> Callable[[Any, str], None]:
    def check(value: Any, key: str) -> None:
        raise LMCacheSettingRefused(f"GlmCacheConnector cannot honour kv_connector_extra_config {key}: {why}; "
                                    "remove it")

    return check


# What each LMCacheMPConnector key means here; ``None``: translated by ``translate`` below.
_KEYS: dict[str, Callable[[Any, str], None] | None] = {
    "lmcache.mp.host": None,
    "lmcache.mp.port": None,
    "lmcache.mp.server_urls": None,
    "lmcache.mp.save_decode_cache": None,
    "lmcache.mp.hash_algorithm": _only(
        "blake3", "chunk keys are vLLM's block hashes or LMCache's blake3 token chain (chunk_keys), "
        "and lookups send keys, not tokens, so no other token hash is used"),
    "lmcache.mp.nonblocking_lookup_status": _only(True, "lookups never hold an engine step"),
    "lmcache.mp.eager_prefetch": _only(False, "the lookup is sent when vLLM first asks about the request"),
    "lmcache.mp.lazy_offload": _only(False, "chunks are saved as their steps finish"),
    "lmcache.mp.mp_transfer_mode": _only(
        "engine_driven", "the engine's workers copy pages to and from the server (no server-driven GPU access)"),
    "lmcache.mp.isolated_ipc": _only(False, "no CUDA IPC: payloads go over TCP or host shared memory"),
    "lmcache.mp.use_vmm_api": _only(False, "no CUDA IPC: payloads go over TCP or host shared memory"),
    "lmcache.mp.transfer_intermediate_tensors": _only(False, "not implemented"),
    "lmcache.mp.mq_timeout": _refuse("this connector's time limits are timeout_s (per request, default 2 s) "
                                     "and min_rate_mb_s; a 300 s blocking call has no equivalent"),
    "lmcache.mp.heartbeat_interval": _refuse("the connector sends no heartbeats (a failed call puts the link "
                                             "in back-off for retry_after_s)"),
    "lmcache.mp.autostart": _only(False, "start glm-cache-server yourself (one per host)"),
    "lmcache.mp.autostart.server_args": _refuse("the connector does not start glm-cache-server"),
    "lmcache.mp.autostart.wait_timeout": _refuse("the connector does not start glm-cache-server"),
}
# Lazy-offload policy knobs: meaningful only with lazy_offload, which is refused.
for _k in ("policy", "horizon_steps", "max_drain_per_step", "max_deferral_seconds", "threshold", "select_count"):
    _KEYS[f"lmcache.mp.lazy_offload_{_k}"] = _refuse("lazy offload is not implemented")


def _url(host: Any, port: Any) -> str:
    host = str(host).strip()
    url = f"{host}:{int(port)}"
    return url if "://" in url else f"tcp://{url}"


def translate(extra: Mapping[str, Any]) -> dict[str, Any]:
    """Our settings that ``extra``'s ``lmcache.*`` keys set (``{"server": ..., "save_decode":
    ...}``), after checking every ``lmcache.*`` key; raises :class:`LMCacheSettingRefused`
    naming the first key it cannot honour. A URL given both ways must agree."""
    ours: dict[str, Any] = {}
    for key in sorted(k for k in extra if str(k).startswith("lmcache.")):
        if key not in _KEYS:
            raise LMCacheSettingRefused(
                f"GlmCacheConnector does not know kv_connector_extra_config {key} (an LMCache setting it "
                "cannot honour); remove it. Known: " + ", ".join(sorted(_KEYS)))
        check = _KEYS[key]
        if check is not None:
            check(extra[key], key)
    if "lmcache.mp.save_decode_cache" in extra:
        ours["save_decode"] = _strict_bool(extra["lmcache.mp.save_decode_cache"], "lmcache.mp.save_decode_cache")
    urls = extra.get("lmcache.mp.server_urls")
    if urls is not None:
        items = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else [str(u) for u in urls]
        items = [u for u in items if u]
        if len(items) != 1:
            raise LMCacheSettingRefused(
                f"GlmCacheConnector cannot honour kv_connector_extra_config lmcache.mp.server_urls={urls!r}: "
                "one glm-cache-server per engine (replicas share it; an L2 tier shares servers)")
        if "lmcache.mp.host" in extra or "lmcache.mp.port" in extra:
            raise LMCacheSettingRefused("kv_connector_extra_config: give lmcache.mp.server_urls or "
                                        "lmcache.mp.host/port, not both")
        ours["server"] = items[0] if "://" in items[0] else f"tcp://{items[0]}"
    elif "lmcache.mp.host" in extra or "lmcache.mp.port" in extra:
        ours["server"] = _url(extra.get("lmcache.mp.host", LMCACHE_DEFAULT_HOST),
                              extra.get("lmcache.mp.port", LMCACHE_DEFAULT_PORT))
    for key, value in ours.items():
        given = extra.get(key)
        if given is not None and str(given).strip().lower() != str(value).strip().lower():
            raise LMCacheSettingRefused(
                f"kv_connector_extra_config sets {key}={given!r} and, through LMCache's settings, {value!r}")
    return ours


# Per-request keys (kv_transfer_params) of LMCache's connector.
MAX_OFFLOAD_TOKENS = "lmcache.max_offload_tokens"
SKIP_LOAD = "lmcache.skip_load"


# A cap beyond this many tokens caps nothing (no prompt is longer); bigger values are clamped.
MAX_TOKENS = 1 << 40
_MAX_TEXT = 32  # longer strings are not a number or a boolean of ours


def token_count(value: Any) -> int | None:
    """A client's token count as a non-negative int (clamped to :data:`MAX_TOKENS`), or None
    where it is not one: a bool, an infinity or NaN, a fraction, a negative number, a
    string that is not a short decimal integer, or any other type. Never raises."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and len(value) <= _MAX_TEXT and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    if not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_TOKENS)


def request_params(params: Any) -> tuple[int | None, bool, list[str]]:
    """``(max_offload_tokens, skip_load, keys not honoured)`` of a request's
    ``kv_transfer_params``. A malformed value is not honoured (listed) rather than guessed;
    nothing here raises on what a client sends (a non-mapping is itself not honoured)."""
    if not params:
        return None, False, []
    if not isinstance(params, Mapping):
        return None, False, ["kv_transfer_params"]
    # every other lmcache.* key (lmcache.token_drop, lmcache.hint.engine_computed_tokens, ...)
    unhonoured = [k for k in params
                  if isinstance(k, str) and k.startswith("lmcache.") and k not in (MAX_OFFLOAD_TOKENS, SKIP_LOAD)]
    cap = None
    if MAX_OFFLOAD_TOKENS in params:
        cap = token_count(params[MAX_OFFLOAD_TOKENS])
        if cap is None:
            unhonoured.append(MAX_OFFLOAD_TOKENS)
    skip = params.get(SKIP_LOAD)
    skip = skip is True or (isinstance(skip, str) and len(skip) <= _MAX_TEXT and skip.strip().lower() == "true")
    return cap, skip, unhonoured
