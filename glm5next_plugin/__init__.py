"""vLLM out-of-tree model plugin for GLM-5.3-Flash (``Glm5NextForConditionalGeneration``).

Which implementation serves the architecture is an explicit setting, ``GLM5NEXT_IMPL``:

- ``plugin``: this package's PyTorch model (KDA state layers, sparse MLA over vLLM's paged
  cache). Runs wherever PyTorch runs; the only choice on CPU.
- ``native``: vLLM's own ``vllm.models.glm5next`` (CUDA kernels: FlashKDA/FLA, DeepGEMM,
  FlashMLA-sparse). Much faster on GPUs; the plugin then registers nothing.
- ``auto`` (default): ``native`` where vLLM has those kernels (CUDA and ROCm,
  ``is_cuda_alike``), ``plugin`` everywhere else, so installing the plugin never makes a GPU
  deployment slower by default.

The choice is logged once per process at start-up.

What the plugin serves: the text model and image inputs (its own vision tower,
:mod:`glm5next_plugin.vision`, and an image-only prompt processor built on transformers' PIL
image processor, :mod:`glm5next_plugin.multimodal`, so nothing needs torchvision); video
inputs are refused with a message.

What the plugin puts in vLLM's cache (what a KV connector sees):

- one full-attention group for the sparse-MLA layers, one row per token
  ``[latent (kv_lora_rank) | rope key (qk_rope_head_dim, none in GLM-5.3-Flash) |
  indexer key | kpool gate (index_head_dim each)]`` in the model dtype, except that a
  pool's closing row holds the pool's key in place of its gate
  (``mla_layer.CACHE_ROW_FORMAT``); every row depends only on its prefix, so there is no
  tail scratch group and every block-aligned prefix is complete. The model declares the
  row's parts (``kv_cache_row_parts``: MLA latent with the rope key, indexer cache), which
  the connector stores as two object groups;
- state ("Mamba") groups for the KDA layers, GDN metadata, per slot conv
  ``(conv_kernel - 1, 3 * heads * head_dim)`` (model dtype) and recurrent
  ``(heads, head_dim, head_dim)`` ``[H, V, K]`` (fp32 unless ``mamba_ssm_cache_dtype``);
  with ``--enable-prefix-caching`` vLLM keeps align-mode snapshots on the unified block grid.

How the plugin computes them has a version, ``NUMERICS_VERSION`` (:mod:`.version`), which
GlmCacheConnector joins into the namespace: bump it with any change that moves the plugin's
outputs (``tests/engine/test_identity_runtime.py`` fails until it is bumped and re-recorded).

Not MLA to vLLM (plugin only): vLLM's model-type list marks ``glm5_next`` as a DeepSeek-MLA
model, and vLLM 0.32's CPU platform then forces a 16-token block and turns prefix caching
and chunked prefill off on every CPU without AMX (``vllm/platforms/cpu.py``, "MLA is enabled
on a non-GPU platform"), which crashes align mode at start-up. The plugin uses none of vLLM's
MLA kernels (its backend reads and writes its own rows), so when it serves the architecture
it tells vLLM so: ``register()`` maps the ``glm5_next`` / ``glm5_next_text`` model types to
an architecture-config convertor that reports ``is_deepseek_mla=False``. The effect is
limited to those two model types in that process; every other model, and the native
implementation (which registers nothing), is unchanged. The page vLLM sizes the unified
block from is then the plugin backend's real row (``customize_spec``), the same on CPUs
with and without AMX.
"""

from __future__ import annotations

import logging
import os

from .version import NUMERICS_VERSION  # noqa: F401 (an interface, not a re-export: connector.namespace reads it from the model class's top-level package)

# Under "vllm." so vLLM's log handler prints it in every process it starts.
logger = logging.getLogger("vllm.glm5next_plugin")

ARCHITECTURES = ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM")
# Model types of GLM-5.3-Flash configs (multimodal wrapper and flat text-only) and of the
# MTP draft config vLLM derives from either (glm5next_plugin.mtp).
MODEL_TYPES = ("glm5_next", "glm5_next_text", "glm5_next_mtp")
IMPL_ENV = "GLM5NEXT_IMPL"

_registered_impl: str | None = None


def choose_impl(is_cuda: bool) -> str:
    """Resolve ``GLM5NEXT_IMPL`` (``plugin`` / ``native`` / ``auto``) for this platform.

    ``is_cuda`` means vLLM's native GLM5-Next kernels exist here: CUDA or ROCm
    (``current_platform.is_cuda_alike()``; the native package has ``nvidia/`` and ``amd/``).
    """
    wanted = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "plugin", "native"):
        raise ValueError(f"{IMPL_ENV}={wanted!r}: expected 'plugin', 'native' or 'auto'")
    if wanted == "auto":
        return "native" if is_cuda else "plugin"
    if wanted == "native" and not is_cuda:
        raise ValueError(
            f"{IMPL_ENV}=native needs CUDA or ROCm (vLLM's GLM5-Next kernels); use {IMPL_ENV}=plugin on this platform"
        )
    return wanted


def _platform_is_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


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
    from .draft_rows import install as exact_draft_rows

    # MTP rows at partial prefill ends from the next prompt token on vLLM's default drafter
    # batch too (both implementations: the defect is in vLLM's drafter, not the model)
    exact_drafts = exact_draft_rows()
    impl = choose_impl(_platform_is_cuda())
    if impl == "plugin":
        from vllm import ModelRegistry

        from .model import Glm5NextForCausalLM, Glm5NextForConditionalGeneration
        from .mtp import MTP_ARCHITECTURE, Glm5NextMTPModel, install_config_override

        # The class itself, not a "module:Class" string: vLLM would inspect a string
        # in a subprocess at every start-up (~15 s on 2 cores).
        ModelRegistry.register_model("Glm5NextForConditionalGeneration", Glm5NextForConditionalGeneration)
        ModelRegistry.register_model("Glm5NextForCausalLM", Glm5NextForCausalLM)
        # the MTP draft of both (--speculative-config '{"method":"mtp",...}'); the config
        # rewrite also maps flat glm5_next_text checkpoints to it
        ModelRegistry.register_model(MTP_ARCHITECTURE, Glm5NextMTPModel)
        install_config_override()
        mark_not_mla()
    _registered_impl = impl
    logger.info(
        "glm5next plugin: %s implementation serves %s (%s=%s, platform %s)%s",
        "plugin (PyTorch)" if impl == "plugin" else "vLLM native",
        ", ".join(ARCHITECTURES),
        IMPL_ENV,
        os.environ.get(IMPL_ENV, "auto"),
        _platform_name(),
        "; vLLM treats model types glm5_next/glm5_next_text as non-MLA in this process "
        "(the plugin's own sparse-MLA backend sizes the cache; other models unchanged)"
        if impl == "plugin"
        else "",
    )
    if exact_drafts:
        logger.info("glm5next plugin: MTP/EAGLE draft rows at partial prefill ends use the next prompt token on "
                    "vLLM's padded drafter batch too (glm5next_plugin.draft_rows; GLM-5.3-Flash only)")


def _platform_name() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "unknown")


def mark_not_mla() -> None:
    """Make vLLM see GLM-5.3-Flash's model types as non-MLA (``model_config.use_mla`` False).

    vLLM derives ``use_mla`` from a list of model types, not from the model class, and its
    CPU platform acts on it before the model exists: a 16-token block and, without AMX,
    prefix caching and chunked prefill switched off. The plugin's layers use no vLLM MLA
    kernel, so the flag only does harm. The override is a convertor for these model types
    only (the two config types and the MTP draft's), wrapping whatever convertor vLLM had
    for them; idempotent.
    """
    from vllm.transformers_utils import model_arch_config_convertor as mac

    for model_type in MODEL_TYPES:
        base = mac.MODEL_ARCH_CONFIG_CONVERTORS.get(model_type, mac.ModelArchConfigConvertorBase)
        if getattr(base, "glm5next_plugin_not_mla", False):
            continue

        class NotMLAConvertor(base):  # type: ignore[misc, valid-type]
            glm5next_plugin_not_mla = True

            def is_deepseek_mla(self) -> bool:
                return False

        NotMLAConvertor.__name__ = f"Glm5NextPluginNotMLA({base.__name__})"
        mac.MODEL_ARCH_CONFIG_CONVERTORS[model_type] = NotMLAConvertor
