"""The engine's namespace: what an object's bytes depend on besides its chunk key, built
in one place (:class:`Namespace`).

An object is found under (namespace, chunk key, group, rank). The namespace fingerprints
the engine (:func:`engine_fingerprint`): its cache geometry, dtypes and parallel layout,
the model's cache-row format and numerics version, the key scheme (:func:`choose_key_scheme`:
vLLM's block hashes or the token chain of :mod:`connector.keys`), and the identity of
what computed the bytes: the weights (:mod:`connector.identity`, named again at run time
when they change in place: :mod:`connector.weights_view`), the engine, a drafter that
writes cache rows (:mod:`connector.drafts`), and for a multimodal model the processor's
settings (:mod:`connector.media`). The chunk keys themselves are :mod:`connector.keys`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.config import Settings, logger, refuse_decode_saves_with_draft_rows
from connector.drafts import NO_DRAFTS, Drafts, check_nameable, draft_identity
from connector.identity import Unnameable, engine_identity
from connector.media import media_identity
from connector.weights_view import runtime_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from connector.geometry import Geometry


# vLLM's block hash algorithms whose hashes we trust to name a prefix
# (vllm.config.cache.PrefixCachingHashAlgo): collision resistant, and the same in every
# process (a fixed seed, or PYTHONHASHSEED).
_CRYPTO_BLOCK_HASHES = frozenset({"sha256", "sha256_cbor"})


def hash_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int | None:
    """The token span of ``request.block_hashes`` (vLLM sets it on the scheduler's KV
    cache config at start-up); None where unknown, and None unless vLLM hashes blocks
    with a cryptographic hash: with ``xxhash`` a block-hash collision would hand one
    prompt another's chunk keys, and so its KV from the shared cache on every replica,
    not only a wrong local prefix hit."""
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    if algo not in _CRYPTO_BLOCK_HASHES:
        return None
    size = getattr(kv_cache_config, "hash_block_size", None)
    return size if isinstance(size, int) and size > 0 else None


@dataclass(frozen=True)
class KeyScheme:
    """Where this engine's chunk keys come from.

    ``span`` is None for the token chain; otherwise keys are vLLM's block hashes, one per
    ``span`` tokens, taken at chunk ends. ``identity`` is what those keys depend on (None
    for the token chain), for the namespace."""

    span: int | None = None
    identity: dict[str, Any] | None = None


def choose_key_scheme(wanted: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                      block: int, logger: Any) -> KeyScheme:
    """``chunk_keys: vllm`` (and ``auto`` where usable): chunk k's key is vLLM's block
    hash at the chunk's end (``request.block_hashes``, which vLLM's engine computes for
    every request on arrival whenever a KV connector is configured: a sha256 chain over
    the whole prefix, with the cache salt, LoRA and multimodal inputs as extra keys).
    Nothing is hashed by us, at admission or on save.

    Those hashes are the same in every process only for vLLM's cryptographic algorithms
    (their NONE_HASH seed is fixed, or PYTHONHASHSEED), and their bytes depend on the
    algorithm, the seed, the block span, vLLM's hashing code (its version) and Python's
    pickle (its version): all go into the namespace, so engines that would compute other
    keys for the same tokens never share objects. Elsewhere (``xxhash`` algorithms, a
    block span that does not divide the block) the connector says why and keeps the
    token chain."""
    if wanted == "lmcache":
        return KeyScheme()
    import vllm

    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    span = hash_block_size(vllm_config, kv_cache_config)
    why = None
    if span is None or block % span:
        why = (f"prefix_caching_hash_algo {algo!r} (usable: {sorted(_CRYPTO_BLOCK_HASHES)}), block hash "
               f"span {getattr(kv_cache_config, 'hash_block_size', None)!r} (must divide {block})")
    else:
        try:  # vLLM 0.32's names; a version without them keeps the token chain
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

            seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
        except (ImportError, AttributeError, ValueError) as e:
            why = f"cannot tell vLLM {vllm.__version__}'s block hash seed: {e}"
    if why is not None:
        log = logger.warning if wanted == "vllm" else logger.info
        log("GlmCacheConnector: chunk keys hash token ids (chunk_keys=%s; vLLM's block hashes not usable: %s)",
            wanted, why)
        return KeyScheme()
    logger.info("GlmCacheConnector: chunk keys are vLLM's block hashes (%s, every %d tokens)", algo, span)
    return KeyScheme(span, {
        "scheme": "vllm-block-hashes",
        "algo": algo,
        "seed": hashlib.sha256(str(seed).encode()).hexdigest()[:16],
        "span": span,
        "vllm": vllm.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    })


def engine_fingerprint(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    geometry: Geometry,
    row_format: str | None = None,
    chunk_keys: dict[str, Any] | None = None,
    identity: dict[str, Any] | None = None,
) -> str:
    """Namespace for this engine's cache entries: bytes are only valid for an engine with
    the same model, dtypes, cache group geometry, block sizes, parallel layout and cache
    row format (``row_format``: :func:`model_cache_row_format`; None, and then left out of
    the digest, for models that declare none). The chunk size is left out: it is
    negotiated per namespace, and keys already depend on it. ``chunk_keys`` describes a
    key scheme other than the default token chain (:attr:`KeyScheme.identity`); None
    leaves the digest as the token chain's. ``identity`` is what else the bytes depend on:
    the weights, the model config, vLLM's version and the device family
    (:func:`connector.identity.engine_identity`)."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    desc = {
        "model": model_config.model,
        "revision": model_config.revision,
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "mamba_cache_dtype": str(getattr(cache_config, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cache_config, "mamba_ssm_cache_dtype", None)),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "dcp": parallel.decode_context_parallel_size,
        "groups": [
            [
                g.group_id,
                g.name,
                g.vllm_group,
                g.is_state,
                g.block_size,
                [[p.name, p.page_bytes, p.dtype, p.states_per_page, p.rows, p.row_stride, p.row_offset]
                 for p in g.layers],
            ]
            for g in geometry.groups
        ],
        "group_tokens_per_block": list(geometry.group_tokens_per_block),
    }
    if row_format is not None:
        desc["cache_row_format"] = row_format
    if chunk_keys is not None:
        desc["chunk_keys"] = chunk_keys
    if identity is not None:
        desc["identity"] = identity
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    name = str(model_config.served_model_name or model_config.model).rstrip("/")
    return f"{name.split('/')[-1]}-{digest}"


def model_cache_row_format(vllm_config: VllmConfig) -> str | None:
    """The cache-row format the engine's model class declares (class attribute
    ``kv_cache_row_format``), or None when it declares none (vLLM's own models).

    A model whose page sizes stay the same while what the bytes mean changes (the GLM
    plugin storing pool keys in its rows) declares a new format, so that objects saved by
    other code land in another namespace and are never loaded into this one. Read from
    the class vLLM resolves for the model config (cached by vLLM; importing the class
    builds nothing), so the scheduler sees it without the model's layers."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    fmt = getattr(get_model_cls(vllm_config.model_config), "kv_cache_row_format", None)
    return None if fmt is None else str(fmt)


def numerics_version_of(model_cls: type) -> str | None:
    """``"<package>/<NUMERICS_VERSION>"`` for a model class whose top-level package
    declares ``NUMERICS_VERSION`` (glm5next_plugin does: :mod:`glm5next_plugin.version`);
    None for the rest (vLLM's own models: vLLM's version names their code)."""
    package = str(getattr(model_cls, "__module__", "") or "").split(".")[0]
    version = getattr(sys.modules.get(package), "NUMERICS_VERSION", None) if package else None
    return None if version is None else f"{package}/{version}"


def model_numerics_version(vllm_config: VllmConfig) -> str | None:
    """The numerics version of the code that computes this engine's cache bytes: the
    package of the model class vLLM resolves for the model config (the GLM plugin's
    ``NUMERICS_VERSION``, bumped whenever its outputs change), or None for models whose
    package declares none. It joins the namespace, so a rolling upgrade to plugin code that
    computes other KV never shares objects with the old code (the row format alone, which
    :func:`model_cache_row_format` reads, changes only when the rows' layout does)."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    return numerics_version_of(get_model_cls(vllm_config.model_config))


class Namespace:
    """Everything that names this engine's objects besides their chunk keys, assembled
    once at start-up: the key scheme, the drafter, the identity (weights, engine, drafts,
    media, numerics) and the fingerprint over all of it with the geometry and row format.
    :meth:`of` gives the namespace for the weights the workers report at run time.
    ``identity`` is None where something cannot be named (the engine then serves without
    the external cache)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: Settings,
                 geometry: Geometry, row_format: str | None = None, numerics: str | None = None) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._geometry = geometry
        self._row_format = row_format
        # vLLM's block hash span, for the chunk-key memo (None: no memo)
        self.hash_span = hash_block_size(vllm_config, kv_cache_config)
        self.scheme = choose_key_scheme(settings.chunk_keys, vllm_config, kv_cache_config,
                                        geometry.scheduler_block_size, logger)
        try:
            drafts = check_nameable(vllm_config)
            identity = engine_identity(vllm_config.model_config, getattr(vllm_config, "load_config", None))
            draft = draft_identity(drafts)
            if draft is not None:  # absent otherwise: drafts-off namespaces stay what they were
                identity["draft"] = draft
        except Unnameable as e:  # what identity cannot name is not cached
            logger.error("GlmCacheConnector: %s; serving without the external cache", e)
            drafts, identity = NO_DRAFTS, None
        media = media_identity(vllm_config.model_config, settings.trust_media_ids)
        if media is not None and identity is not None:  # a multimodal model: the processor's settings too
            identity["media"] = media
        refuse_decode_saves_with_draft_rows(settings, drafts.method, drafts.lookahead)
        if drafts.method is not None:
            logger.info("GlmCacheConnector: %s drafts (k=%d) %s", drafts.method, drafts.num_speculative_tokens,
                        f"cached: chunk keys cover the {drafts.lookahead} token(s) after each chunk, the draft "
                        "is in the namespace" if drafts.lookahead else "write no cache rows: keys and namespace "
                        "as without drafts")
        if numerics is not None and identity is not None:  # the model code's numerics version
            identity["numerics"] = numerics
        self.drafts: Drafts = drafts
        # the model's cache-row format, the key scheme, the weights and the engine join the
        # namespace; the weights as the workers report them at run time (of)
        self.identity = identity

    def of(self, tokens: tuple[str | None, ...]) -> str | None:
        """The namespace for the workers' weights ``tokens`` (None: the weights cannot be named)."""
        identity = runtime_identity(self.identity, tokens)
        if identity is None:
            return None
        return engine_fingerprint(self._vllm_config, self._kv_cache_config, self._geometry, self._row_format,
                                  chunk_keys=self.scheme.identity, identity=identity)

    def chunk_keys(self) -> dict[str, Any]:
        """How the engine names chunks, told at hello so the server can name chunks for
        routers' queries (cache_server.prefix_query)."""
        span = self.scheme.span
        return {"scheme": "lmcache" if span is None else "vllm", "span": span, "lookahead": self.drafts.lookahead}
