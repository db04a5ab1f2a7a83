"""``Glm5NextForConditionalGeneration`` for vLLM, in plain PyTorch: text and images.

Module names mirror transformers' model, so checkpoint tensors load by name:
``model.language_model.layers.{i}.{self_attn,mlp,attn_hc,ffn_hc,...}``, ``model.visual.*``
and ``lm_head``.
Layers follow ``layer_types`` (``linear_attention`` -> KDA state layer,
``indexed_attention`` -> sparse MLA) and ``mlp_layer_types`` (``dense`` / ``sparse``).

Tensor parallel (``--tensor-parallel-size N``): KDA heads, MLA attention heads and the
MLP/expert intermediate dimension are split across the N ranks; the MLA latent, the
indexer (so the MLA cache rows, identical on every rank), norms, router, mHC, embeddings
and ``lm_head`` are replicated. Each decoder block all-reduces its attention output and its
MLP output once. Rank shards are cut from the full checkpoint tensors on load
(:mod:`glm5next_plugin.weight_loading`), so one checkpoint serves every TP size
(:mod:`glm5next_plugin.tp`).

Images: the entry class is multimodal to vLLM (``SupportsMultiModal``). The vision tower
(:mod:`glm5next_plugin.vision`) turns each image's patches into one embedding per
``<|image|>`` placeholder token, and those embeddings replace the placeholders' token
embeddings (the text model is NoPE: positions do not change). vLLM's runner hands
``embed_input_ids`` the embeddings of exactly the scheduled placeholder positions, so an
image may be split across prefill steps and a prefill may start inside an image (align-mode
prefix caching requires chunked multimodal input). Prompt processing (the image processor,
placeholder expansion, profiling inputs) is :mod:`glm5next_plugin.multimodal`. With
``--limit-mm-per-prompt '{"image": 0}'`` the tower is not built and its tensors are skipped.

Not supported yet, and refused with a message rather than ignored: video inputs,
FP8/NVFP4 checkpoints, pipeline parallelism, ``"shared"`` indexer layers, TP sizes that do
not divide the head counts and intermediate sizes. The MTP layer is not part of the target:
it is the draft model of speculative method ``mtp`` (:mod:`glm5next_plugin.mtp`).
``Glm5NextForCausalLM`` (flat text-only checkpoints) maps names and runs the same modules;
``tie_word_embeddings=True`` shares ``lm_head`` with the embeddings, as transformers does.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from . import mamba_cpu
from .blocks import MLP, HyperConnection, MoE, RMSNorm
from .kda_layer import KDAProjections, KDAStateLayer, kda_state_dtype, kda_state_shape
from .mla_layer import CACHE_ROW_FORMAT, FP8_KV_CACHE_DTYPES, SparseMLALayer, SparseMLAProjections, kv_cache_refusal
from .tp import TP1, TPInfo, tp_info
from .vision import VisionTower
from .weight_loading import cast_for_inference, load_by_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.glm5next_plugin.model")


def text_config_of(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The text sub-config of a ``Glm5NextConfig`` (or the config itself if flat)."""
    return getattr(hf_config, "text_config", None) or hf_config


def check_supported(hf_config: PretrainedConfig, vllm_config: VllmConfig | None = None) -> None:
    """Fail with a clear message on what this plugin does not implement yet."""
    text = text_config_of(hf_config)
    quant = getattr(hf_config, "quantization_config", None) or getattr(text, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise NotImplementedError(
            f"glm5next plugin: quantized checkpoints ({method}) are not supported yet (FP8/NVFP4 come later); "
            "use a bf16/fp32 checkpoint or vLLM's native implementation on CUDA (GLM5NEXT_IMPL=native)"
        )
    if getattr(text, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"glm5next plugin: hidden_act={text.hidden_act!r} is not supported (only 'silu')")
    shared = [i for i, t in enumerate(getattr(text, "indexer_types", None) or []) if t == "shared"]
    shared = [i for i in shared if text.layer_types[i] == "indexed_attention"]
    if shared:
        raise NotImplementedError(f"glm5next plugin: 'shared' indexer layers {shared} are not supported yet")
    if vllm_config is not None:
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "glm5next plugin: pipeline parallelism is not supported; "
                "run with --pipeline-parallel-size 1 (tensor parallelism is) or use GLM5NEXT_IMPL=native on CUDA"
            )
        check_tp_divides(text, par.tensor_parallel_size)
        refusal = kv_cache_refusal(str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")))
        if refusal is not None:  # before the weights load, not at the first cache spec
            raise NotImplementedError(refusal)


def check_tp_divides(text: PretrainedConfig, tp_size: int) -> None:
    """Every dimension the plugin splits across ranks must divide by the TP size."""
    split = {
        "linear_num_heads": text.linear_num_heads,
        "num_attention_heads": text.num_attention_heads,
        "intermediate_size": text.intermediate_size,
        "moe_intermediate_size": text.moe_intermediate_size,
    }
    bad = {k: v for k, v in split.items() if v % tp_size}
    if bad:
        raise NotImplementedError(
            f"glm5next plugin: tensor parallel size {tp_size} does not divide {bad}; "
            "these are split across ranks"
        )


class DecoderLayer(nn.Module):
    """One layer: mHC around (attention or KDA), mHC around (dense MLP or MoE)."""

    def __init__(self, config: PretrainedConfig, idx: int, vllm_config: VllmConfig | None, prefix: str, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        self.kind = config.layer_types[idx]
        if self.kind == "linear_attention":
            self.self_attn = (
                KDAStateLayer(config, vllm_config, f"{prefix}.self_attn")
                if vllm_config is not None
                else KDAProjections(config, tp)
            )
        elif self.kind == "indexed_attention":
            self.self_attn = (
                SparseMLALayer(config, vllm_config, f"{prefix}.self_attn")
                if vllm_config is not None
                else SparseMLAProjections(config, tp)
            )
        else:
            raise NotImplementedError(f"glm5next plugin: layer type {self.kind!r} (layer {idx}) is not supported")
        if config.mlp_layer_types[idx] == "sparse":
            self.mlp = MoE(config, tp)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        post, comb, h = self.attn_hc(streams)
        # under TP both blocks return this rank's partial sum (row-parallel outputs)
        h = self.tp.all_reduce(self.self_attn(self.input_layernorm(h)))
        streams = HyperConnection.merge(post, comb, h, streams)
        post, comb, h = self.ffn_hc(streams)
        h = self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))
        return HyperConnection.merge(post, comb, h, streams)


class TextModel(nn.Module):
    """Embeddings, the layer stack on ``hc_mult`` streams, stream mean, final norm."""

    def __init__(
        self, config: PretrainedConfig, vllm_config: VllmConfig | None = None, prefix: str = "model.language_model", tp: TPInfo | None = None
    ) -> None:
        super().__init__()
        self.config = config
        tp = tp_info(vllm_config) if tp is None else tp
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}", tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams)
        return self.norm(streams.mean(dim=1))


class Glm5NextModel(nn.Module):
    """Container matching the checkpoint's ``model.`` prefix: ``language_model`` and, given
    ``vision_config``, the vision tower ``visual`` (replicated under TP).
    ``tp`` builds one rank's shard without vLLM (tests); with ``vllm_config`` the rank
    comes from vLLM's TP group."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig | None = None, tp: TPInfo | None = None,
                 vision_config: PretrainedConfig | None = None) -> None:
        super().__init__()
        if vision_config is not None:
            self.visual = VisionTower(vision_config)
        self.language_model = TextModel(config, vllm_config, tp=tp)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding, where vLLM's speculative proposer looks for it
        (``target.model.embed_tokens``) to share it with an MTP draft. A property, not a
        second registration, so the parameter keeps its one checkpoint name."""
        return self.language_model.embed_tokens


def _vllm_interfaces() -> tuple[type, type]:
    from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

    return HasInnerState, IsHybrid


def _vllm_multimodal() -> type:
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    return SupportsMultiModal


class Glm5NextHybridLM(nn.Module, *_vllm_interfaces()):
    """What both vLLM entry classes share: GLM-5.3-Flash's text model with KDA state layers
    and sparse MLA (``Glm5NextForConditionalGeneration`` adds the vision tower)."""

    has_inner_state: ClassVar[Literal[True]] = True
    is_hybrid: ClassVar[Literal[True]] = True
    supports_mamba_prefix_caching: ClassVar[Literal[True]] = True
    # What the bytes of this model's cache rows mean: part of the external cache's namespace
    # (connector.namespace.engine_fingerprint), so rows saved by another row format never load.
    kv_cache_row_format: ClassVar[str] = CACHE_ROW_FORMAT

    @classmethod
    def kv_cache_row_parts(cls, hf_config: PretrainedConfig) -> tuple[tuple[str, int], ...]:
        """The parts of one sparse-MLA cache row, in row order, as ``(object group,
        values)``: the external cache stores each part as its own object group (the MLA
        latent apart from the indexer cache, as vLLM's native layout keeps them in
        separate layers). See ``SparseMLAProjections.row_size``."""
        text = text_config_of(hf_config)
        return (("mla_latent", text.kv_lora_rank + text.qk_rope_head_dim),
                ("indexer_cache", 2 * text.index_head_dim))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        check_supported(hf_config, vllm_config)
        if vllm_config.speculative_config is not None:
            # drafts on a hybrid model in align mode move KDA state with two Triton-only
            # kernels; on CPU the plugin supplies them (mamba_cpu)
            mamba_cpu.register()
        self.config = text_config_of(hf_config)
        self.vllm_config = vllm_config
        self.tp = tp_info(vllm_config)
        dtype = vllm_config.model_config.dtype
        self.model = Glm5NextModel(self.config, vllm_config, vision_config=self._vision_config(vllm_config))
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(hf_config)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        cast_for_inference(self, dtype)
        conv_dtype, rec_dtype = kda_state_dtype(vllm_config)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        logger.info(
            "glm5next plugin: running the plugin's PyTorch implementation (%s); KDA state dtypes conv=%s "
            "recurrent=%s (mamba_ssm_cache_dtype=%s); sparse-MLA cache rows %s (kv_cache_dtype=%s); "
            "tie_word_embeddings=%s; tensor parallel rank %d of %d",
            type(self).__name__,
            conv_dtype,
            rec_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
            "float8_e4m3fn bytes, per-layer scale (1.0 unless the checkpoint has self_attn.k_scale)"
            if cache_dtype in FP8_KV_CACHE_DTYPES else dtype,
            cache_dtype,
            self.tie_word_embeddings,
            self.tp.rank,
            self.tp.size,
        )

    def _vision_config(self, vllm_config: VllmConfig) -> PretrainedConfig | None:
        """The vision sub-config to build a tower from, or None (text only)."""
        return None

    # --- vLLM model API -----------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.model.language_model(input_ids, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_by_name(
            self,
            weights,
            self.config.num_hidden_layers,
            self.config.n_routed_experts,
            tied_lm_head=self.tie_word_embeddings,
        )

    # --- hybrid-state declarations (what vLLM's cache manager sizes from) ------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return kda_state_shape(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtype(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Callable[..., Any], ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.kda_state_copy_func()


class Glm5NextForConditionalGeneration(Glm5NextHybridLM, _vllm_multimodal()):
    """vLLM entry class of GLM-5.3-Flash checkpoints: the hybrid text model and the vision
    tower. Images arrive as the processor's patches (``pixel_values``, ``image_grid_thw``;
    :mod:`glm5next_plugin.multimodal` registers the processor for this class); video is
    refused there. The tower is built unless the engine's image limit is 0."""

    supports_multimodal: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        self.image_token_id = int(hf_config.image_token_id)
        # vLLM's draft proposer reads the target's ``config.image_token_index`` on a
        # multimodal target (MTP drafts run on token ids; the attribute only has to exist):
        # a copy of the text config, so the engine's own config object is not changed
        self.config = copy.copy(self.config)
        self.config.image_token_index = self.image_token_id
        logger.info(
            "glm5next plugin: vision tower %s (image limit per prompt %s); video inputs are not supported",
            "built" if self.visual is not None else "not built, its tensors are skipped",
            _image_limit(vllm_config),
        )

    @property
    def visual(self) -> VisionTower | None:
        return getattr(self.model, "visual", None)

    def _vision_config(self, vllm_config: VllmConfig) -> PretrainedConfig | None:
        vision = getattr(vllm_config.model_config.hf_config, "vision_config", None)
        if vision is None or _image_limit(vllm_config) == 0:
            return None
        return vision

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            from .multimodal import IMAGE_PLACEHOLDER

            return IMAGE_PLACEHOLDER
        if modality.startswith("video"):
            from .multimodal import VIDEO_REFUSAL

            raise ValueError(VIDEO_REFUSAL)
        raise ValueError(f"glm5next plugin: modality {modality!r} is not supported (images are)")

    def get_language_model(self) -> nn.Module:
        # the module with ``model.embed_tokens`` and ``lm_head`` (what vLLM's draft
        # proposer shares with an MTP draft): this one
        return self

    def embed_multimodal(self, **kwargs: object) -> Sequence[torch.Tensor]:
        """One ``[tokens, hidden]`` tensor per image, in prompt order."""
        if kwargs.get("pixel_values_videos") is not None:
            from .multimodal import VIDEO_REFUSAL

            raise ValueError(VIDEO_REFUSAL)
        pixel_values = kwargs.get("pixel_values")
        if pixel_values is None:
            if kwargs.get("image_embeds") is not None:
                raise ValueError("glm5next plugin: precomputed image embeddings are not supported; send the image")
            return []
        if self.visual is None:
            raise ValueError("glm5next plugin: image input with an image limit of 0 (no vision tower built)")
        grid = kwargs["image_grid_thw"]
        grid = grid.tolist() if isinstance(grid, torch.Tensor) else [list(map(int, g)) for g in grid]
        if isinstance(pixel_values, (list, tuple)):
            pixel_values = torch.cat(list(pixel_values))
        embeds = self.visual(pixel_values.reshape(-1, pixel_values.shape[-1]), grid)
        return embeds.split(self.visual.tokens_per_item(grid))

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: torch.Tensor | Sequence[torch.Tensor] | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings, with the rows ``is_multimodal`` marks replaced, in order, by
        the rows of ``multimodal_embeddings`` (vLLM passes those of the scheduled positions
        only, so a prefill that starts or ends inside an image gets its part of it)."""
        embeds = self.model.language_model.embed_tokens(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        if is_multimodal is None:
            raise ValueError("glm5next plugin: multimodal embeddings without their positions (is_multimodal)")
        return merge_image_embeddings(embeds, multimodal_embeddings, is_multimodal)


def merge_image_embeddings(embeds: torch.Tensor, image_embeds: torch.Tensor | Sequence[torch.Tensor],
                           mask: torch.Tensor) -> torch.Tensor:
    """``embeds`` with the rows of ``mask`` replaced by ``image_embeds`` (a tensor or a list
    of tensors, concatenated) in order; the counts must agree."""
    rows = torch.cat(list(image_embeds)) if isinstance(image_embeds, (list, tuple)) else image_embeds
    mask = mask.to(embeds.device)
    if int(mask.sum()) != rows.shape[0]:
        raise ValueError(
            f"glm5next plugin: {int(mask.sum())} image placeholder positions but {rows.shape[0]} image embeddings"
        )
    out = embeds.clone()
    out[mask] = rows.to(device=embeds.device, dtype=embeds.dtype)
    return out


def _image_limit(vllm_config: VllmConfig) -> int:
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    return 1 if mm is None else int(mm.get_limit_per_prompt("image"))


class Glm5NextForCausalLM(Glm5NextHybridLM):
    """Text-only flat checkpoints (``architectures: ["Glm5NextForCausalLM"]``, model type
    ``glm5_next_text``): tensors named ``model.layers.*``, ``model.embed_tokens.*``,
    ``model.norm.*`` and ``lm_head.*``, as vLLM's native ``Glm5NextForCausalLM`` reads them.
    Same text modules as the multimodal entry class (no vision tower; not multimodal to
    vLLM); names are mapped on load."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(nest_flat_names(weights))


def nest_flat_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """``model.X`` -> ``model.language_model.X`` (flat text-only spelling to the nested one)."""
    for name, tensor in weights:
        if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            name = "model.language_model." + name[len("model.") :]
        yield name, tensor


def ties_word_embeddings(hf_config: PretrainedConfig) -> bool:
    """Whether ``lm_head`` shares the embedding matrix. transformers reads the flag on the
    top-level config (the one ``from_pretrained`` gets), so do we."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _register_processor() -> None:
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from .multimodal import Glm5NextDummyInputs, Glm5NextImageProcessing, Glm5NextProcessingInfo

    MULTIMODAL_REGISTRY.register_processor(
        Glm5NextImageProcessing, info=Glm5NextProcessingInfo, dummy_inputs=Glm5NextDummyInputs
    )(Glm5NextForConditionalGeneration)


_register_processor()
