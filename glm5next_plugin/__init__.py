"""vLLM out-of-tree model plugin for GLM-5.3-Flash (``Glm5NextForConditionalGeneration``).

Which implementation serves the architecture is an explicit setting, ``GLM5NEXT_IMPL``:

- ``plugin``: this package's PyTorch model (KDA state layers, sparse MLA over vLLM's paged
  cache). Runs wherever PyTorch runs; the only choice on CPU.
- ``native``: vLLM's own ``vllm.models.glm5next`` (CUDA kernels: FlashKDA/FLA, DeepGEMM,
  FlashMLA-sparse). Much faster on GPUs; the plugin then registers nothing.
- ``auto`` (default): ``native`` on CUDA, ``plugin`` everywhere else, so installing the
  plugin never makes a GPU deployment slower by default.

The choice is logged once per process at start-up.

What the plugin puts in vLLM's cache (what a KV connector sees):

- one full-attention group for the sparse-MLA layers, one row per token
  ``[latent (kv_lora_rank) | indexer key | kpool gate (index_head_dim each)]`` in the model
  dtype; kpool pools are rebuilt from these rows, so there is no tail scratch group and
  every block-aligned prefix is complete;
- state ("Mamba") groups for the KDA layers, GDN metadata, per slot conv
  ``(conv_kernel - 1, 3 * heads * head_dim)`` (model dtype) and recurrent
  ``(heads, head_dim, head_dim)`` ``[H, V, K]`` (fp32 unless ``mamba_ssm_cache_dtype``);
  with ``--enable-prefix-caching`` vLLM keeps align-mode snapshots on the unified block grid.

CPU note (vLLM 0.32): on CPUs without AMX, vLLM disables prefix caching and chunked
prefill for every MLA model; ``VLLM_MLA_DISABLE=1`` keeps them on, and the plugin (which
uses no MLA kernel) runs unchanged. The model logs a warning when this applies.
"""

from __future__ import annotations

import logging
import os

# Under "vllm." so vLLM's log handler prints it in every process it starts.
logger = logging.getLogger("vllm.glm5next_plugin")

ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
IMPL_ENV = "GLM5NEXT_IMPL"

_registered_impl: str | None = None


def choose_impl(is_cuda: bool) -> str:
    """Resolve ``GLM5NEXT_IMPL`` (``plugin`` / ``native`` / ``auto``) for this platform."""
    wanted = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "plugin", "native"):
        raise ValueError(f"{IMPL_ENV}={wanted!r}: expected 'plugin', 'native' or 'auto'")
    if wanted == "auto":
        return "native" if is_cuda else "plugin"
    if wanted == "native" and not is_cuda:
        raise ValueError(
            f"{IMPL_ENV}=native needs CUDA (vLLM's GLM5-Next kernels); use {IMPL_ENV}=plugin on this platform"
        )
    return wanted


def _platform_is_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


CONNECTOR_NAME = "GlmCacheConnector"


def register_connector_name() -> None:
    """Let ``--kv-transfer-config '{"kv_connector":"GlmCacheConnector",...}'`` work without
    ``kv_connector_module_path``. Only the name and module path are registered: vLLM imports
    the connector lazily, so the plugin does not depend on it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # the factory raises on a second registration
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.glm_connector", CONNECTOR_NAME)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group.

    vLLM calls it once in every process it starts (and may call it again), so it is
    idempotent: the decision is made once and re-registering is a no-op.
    """
    global _registered_impl
    if _registered_impl is not None:
        return
    register_connector_name()
    impl = choose_impl(_platform_is_cuda())
    if impl == "plugin":
        from vllm import ModelRegistry

        from .model import Glm5NextForConditionalGeneration

        # The class itself, not a "module:Class" string: vLLM would inspect a string
        # in a subprocess at every start-up (~15 s on 2 cores).
        for arch in ARCHITECTURES:
            ModelRegistry.register_model(arch, Glm5NextForConditionalGeneration)
    _registered_impl = impl
    logger.info(
        "glm5next plugin: %s implementation serves %s (%s=%s)",
        "plugin (PyTorch)" if impl == "plugin" else "vLLM native",
        ", ".join(ARCHITECTURES),
        IMPL_ENV,
        os.environ.get(IMPL_ENV, "auto"),
    )
