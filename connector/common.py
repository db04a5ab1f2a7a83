"""What both halves of :class:`GlmCacheConnector` share: its settings, the plan the
scheduler side hands the worker side each step (plain, picklable data), and small rules.

Extra config keys (``kv_connector_extra_config``) are listed in ``connector.glm_connector``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from cache_server.auth import TokenFileError, read_token_file
from cache_server.protocol import ErrorCode
from cache_server.client import CacheServerError, CacheServerUnavailable
from connector.geometry import Geometry, UnsupportedLayout, disabled_geometry, resolve_geometry

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so the engine's log configuration (handlers, level) applies.
logger = init_logger("vllm.glm_cache_connector")

CLIENT_ERRORS = (CacheServerUnavailable, CacheServerError, OSError)


@dataclass(frozen=True)
class Settings:
    """The connector's ``kv_connector_extra_config``, parsed once (see glm_connector)."""

    url: str = "tcp://127.0.0.1:5555"
    timeout_s: float = 2.0
    retry_after_s: float = 5.0
    save_decode: bool = False
    strict_prefix: bool = True
    max_pending_save_bytes: int = 1 << 30
    # Loads and saves move in batches of about this many bytes (an object larger than
    # this is a batch of its own); each batch's deadline is timeout_s plus its bytes at
    # min_rate_mb_s, so a long prompt gets the time its size needs and a stalled server
    # still fails within a bounded time.
    batch_bytes: int = 16 << 20
    min_rate_mb_s: float = 100.0
    # Payloads through shared memory when the server is on this host (negotiated; TCP
    # otherwise). Off: always TCP.
    shm: bool = True
    # Where chunk keys come from: "vllm" (vLLM's own block hashes at chunk ends, which its
    # engine computes for every request anyway; see SchedulerSide._vllm_key_scheme),
    # "lmcache" (our blake3 chain over the token ids, see connector.keys), or "auto" (vllm
    # where this engine's block hashes can serve as shared keys, else lmcache).
    chunk_keys: str = "auto"
    auth_token: str | None = None
    auth_broken: bool = False  # the token file was unusable: no external cache at all
    # Where the worker's transfer threads run on a CPU engine: "auto" (the engine's CPUs
    # the model's OpenMP threads are not pinned to), "off" (where vLLM put the worker),
    # or these CPU ids.
    transfer_cpus: str | tuple[int, ...] = "auto"

    def deadline_s(self, nbytes: int) -> float:
        """How long a transfer of ``nbytes`` may take: the floor plus the bytes at the
        slowest rate we accept."""
        return self.timeout_s + nbytes / (self.min_rate_mb_s * 1e6)

    @classmethod
    def from_config(cls, cfg: KVTransferConfig) -> Settings:
        get = cfg.get_from_extra_config
        auth_token, auth_broken = None, False
        try:
            auth_token = auth_token_from_config(get)
        except TokenFileError as e:
            auth_broken = True
            logger.error(
                "GlmCacheConnector: %s; serving without the external cache (fix "
                "auth_token_file and restart)", e,
            )
        return cls(
            url=str(get("server", cls.url)),
            timeout_s=float(get("timeout_s", cls.timeout_s)),
            retry_after_s=float(get("retry_after_s", cls.retry_after_s)),
            save_decode=flag(get("save_decode", False)),
            strict_prefix=flag(get("strict_prefix", True)),
            max_pending_save_bytes=int(get("max_pending_save_bytes", cls.max_pending_save_bytes)),
            batch_bytes=positive(get("batch_bytes", cls.batch_bytes), "batch_bytes", int),
            min_rate_mb_s=positive(get("min_rate_mb_s", cls.min_rate_mb_s), "min_rate_mb_s", float),
            shm=flag(get("shm", True)),
            chunk_keys=choice(get("chunk_keys", cls.chunk_keys), "chunk_keys", CHUNK_KEY_SCHEMES),
            auth_token=auth_token,
            auth_broken=auth_broken,
            transfer_cpus=cpu_setting(get("transfer_cpus", "auto")),
        )


def uncacheable_reason(request: Any) -> str | None:
    """Why a request's KV must not be shared through the cache, or None.

    Keys hash token ids only. Images/video (placeholder tokens whose KV depends on the
    pixels), LoRA adapters (other weights) and prompt embeddings (no token ids at all)
    would let different requests share a key, so such requests are not cached (fail
    closed) rather than keyed by something partial."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


def auth_token_from_config(get: Any) -> str | None:
    """The token named by ``auth_token_file`` (None if the key is absent or empty).

    ``get`` is ``KVTransferConfig.get_from_extra_config``. Raises :class:`TokenFileError`
    with the path and the reason when the file cannot be used.
    """
    path = get("auth_token_file", None)
    if path is None or str(path).strip() == "":
        return None
    return read_token_file(str(path))


def unauthorized(err: BaseException) -> bool:
    return isinstance(err, CacheServerError) and err.code == ErrorCode.UNAUTHORIZED.value


def resolve_or_disable(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[Geometry, str | None]:
    """The engine's cache geometry, or an empty one and the reason when vLLM handed us
    a layout we do not understand (fail closed: serve without the external cache, never
    guess a layout). Logged once here. Fixable misconfigurations (prefix caching off,
    recurrent state without align-mode snapshots) still raise :class:`GeometryError`
    and stop vLLM at start-up: the operator asked for the cache and one flag fixes it."""
    try:
        return resolve_geometry(vllm_config, kv_cache_config), None
    except UnsupportedLayout as e:
        logger.error("GlmCacheConnector: %s; serving without the external cache", e)
        return disabled_geometry(kv_cache_config), str(e)


def parent_of(hashes: list[bytes], k: int) -> bytes | None:
    """The chunk hash before chunk ``k`` of a chain (None for the first chunk)."""
    return hashes[k - 1] if k > 0 else None


def positive(value: Any, name: str, kind: type) -> Any:
    """A positive number from the extra config, or a clear error naming the key."""
    try:
        v = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config {name} must be a number, got {value!r}") from None
    if not v > 0:
        raise ValueError(f"kv_connector_extra_config {name} must be positive, got {value!r}")
    return v


CHUNK_KEY_SCHEMES = ("auto", "vllm", "lmcache")


def choice(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    """One of ``allowed`` from the extra config, or a clear error naming the key."""
    v = str(value).strip().lower()
    if v not in allowed:
        raise ValueError(f"kv_connector_extra_config {name} must be one of {', '.join(allowed)}; got {value!r}")
    return v


def batches(sizes: list[int], limit: int) -> list[range]:
    """Consecutive index ranges whose sizes sum to at most ``limit`` each (an item
    larger than ``limit`` is a range of its own); every index in exactly one range."""
    out: list[range] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > limit:
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def cpu_setting(value: Any) -> str | tuple[int, ...]:
    """``transfer_cpus``: "auto", "off", or CPU ids (a list, or "2,3" from the CLI)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    items = value.split(",") if isinstance(value, str) else value
    try:
        cpus = tuple(sorted({int(x) for x in items}))
    except (TypeError, ValueError):
        cpus = ()
    if not cpus or cpus[0] < 0:
        raise ValueError(f"kv_connector_extra_config transfer_cpus must be \"auto\", \"off\" or CPU ids, got {value!r}")
    return cpus


def flag(value: Any) -> bool:
    """A boolean setting from JSON or a CLI string ("false" is False)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


# --------------------------------------------------------------------------------------
# Scheduler -> worker plan (plain, picklable data)
# --------------------------------------------------------------------------------------


@dataclass
class ObjectMove:
    """One cache object and the blocks it maps to; None blocks are skipped on load
    (pages vLLM already holds from its local prefix cache)."""

    chunk_hash: bytes
    group_id: int
    block_ids: list[int | None]
    # State saves only: the hash of the previous state on this request's path, so the
    # server can evict the superseded one first (snapshot-aware retention).
    prev: bytes | None = None
    # Saves only: the hash of the chunk before this one (None: the first chunk; b"": not
    # known), so the server knows which prefixes are resumable and what nothing can resume.
    parent: bytes | None = b""
    # Saves only: the request whose blocks these are, so a failed save can be traced
    # back to it ("" : none, e.g. a local state offered again; its failure is only logged).
    req_id: str = ""


@dataclass
class LoadJob:
    req_id: str
    objects: list[ObjectMove]


@dataclass
class GlmConnectorMetadata(KVConnectorMetadata):
    namespace: str = ""
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[ObjectMove] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Worker -> scheduler: save outcomes
# --------------------------------------------------------------------------------------

# Why a save did not land on the server. Transient ones are retried by the scheduler
# while the request still holds its blocks; the others end this request's saves.
SAVE_DROPPED = "drop"  # over max_pending_save_bytes: never copied, never sent
SAVE_TIMEOUT = "timeout"  # the server did not answer within the batch's deadline
SAVE_NO_SPACE = "no_space"  # the server's budget was held by leased objects
SAVE_TOO_LARGE = "too_large"  # larger than the server accepts: retrying cannot help
SAVE_SERVER_ERROR = "server_error"  # an error reply (unauthorized included)
TRANSIENT_SAVE_FAILURES = frozenset({SAVE_DROPPED, SAVE_TIMEOUT, SAVE_NO_SPACE, SAVE_SERVER_ERROR})


@dataclass(frozen=True)
class SaveFailure:
    req_id: str
    chunk_hash: bytes
    group_id: int
    reason: str


@dataclass
class GlmWorkerMeta(KVConnectorWorkerMetadata):
    """Saves that did not land since the last step, from every worker rank."""

    failed_saves: list[SaveFailure] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, GlmWorkerMeta):
            return GlmWorkerMeta(self.failed_saves + other.failed_saves)
        return self


# --------------------------------------------------------------------------------------
# Scheduler-side bookkeeping
# --------------------------------------------------------------------------------------
