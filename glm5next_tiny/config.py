"""The tiny checkpoint's configuration: a ``Glm5NextConfig`` with GLM-5.3-Flash's structure at
toy sizes (:func:`build_config`), and the image processor it is served with
(:func:`image_processor`, ``preprocessor_config.json``).

``qk_rope_head_dim`` above 0 writes a checkpoint whose MLA keys have a rope part
(transformers' ``k_rot``; GLM-5.3-Flash itself has none). transformers' attention computes
it, but its ``Glm5NextTextConfig`` validator refuses such a config ("Expecting NoPE"), so
loading that checkpoint through ``AutoConfig`` needs the check lifted, as
``validation/parity_sweep.py`` does to compare the plugin with transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Glm5NextConfig, Glm5NextImageProcessorPil, PretrainedConfig, PreTrainedTokenizerFast

# What the checkpoint's image processor (transformers' Glm5NextImageProcessorPil, read from
# preprocessor_config.json) is told: GLM's patch geometry and normalisation, with small token
# bounds so images stay cheap on a CPU: a 112x112 image is 8x8 patches, 16 tokens (the
# minimum); the largest is 256 tokens (a 448x448 canvas).
MIN_IMAGE_TOKENS = 16
MAX_IMAGE_TOKENS = 256


def build_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    dtype: str = "float32",
    hidden_size: int = 64,
    layer_types: str = "LLILI",
    dense_layers: int = 1,
    index_topk: int = 128,
    index_kpool: int = 4,
    index_n_heads: int = 16,
    index_head_dim: int = 16,
    qk_rope_head_dim: int = 0,
    linear_num_heads: int = 2,
    linear_head_dim: int = 16,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_position_embeddings: int = 8192,
    mtp_layers: int = 1,
) -> Glm5NextConfig:
    """A ``Glm5NextConfig`` with GLM-5.3-Flash's structure at toy sizes.

    ``layer_types`` is a string over ``L`` (KDA, ``linear_attention``) and ``I`` (sparse
    MLA, ``indexed_attention``); the first ``dense_layers`` layers get a dense MLP, the
    rest MoE, like the real model. ``mtp_layers`` is ``num_nextn_predict_layers``.
    """
    from transformers import Glm5NextConfig

    types = {"L": "linear_attention", "I": "indexed_attention"}
    layers = [types[c] for c in layer_types.upper()]
    n = len(layers)
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        pad_token_id=ids("<|pad|>"),
        eos_token_id=[ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")],
        mlp_layer_types=["dense"] * min(dense_layers, n) + ["sparse"] * max(n - dense_layers, 0),
        layer_types=layers,
        index_topk=index_topk,
        index_head_dim=index_head_dim,
        index_n_heads=index_n_heads,
        index_kpool=index_kpool,
        index_kpool_always_select_tail=True,
        swiglu_limit=10.0,
        linear_head_dim=linear_head_dim,
        linear_num_heads=linear_num_heads,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        hc_mult=4,
        hc_eps=1e-6,
        hc_sinkhorn_iters=20,
        num_nextn_predict_layers=mtp_layers,
        dtype=dtype,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=hidden_size,
        projection_intermediate_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Glm5NextConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image|>"),
        video_token_id=ids("<|image|>"),
        image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"),
        tie_word_embeddings=False,
    )
    config.architectures = ["Glm5NextForConditionalGeneration"]
    config.dtype = dtype
    if qk_rope_head_dim:
        _set_rope_dim(config.text_config, qk_rope_head_dim)
    return config


def _set_rope_dim(text_config: PretrainedConfig, rope_dim: int) -> None:
    """Give a validated (NoPE) text config a rope part. Class validators run only when a
    config is built, so setting the field afterwards passes; the derived fields follow as
    ``Glm5NextTextConfig.__post_init__`` would set them."""
    text_config.qk_rope_head_dim = rope_dim
    text_config.head_dim = rope_dim
    text_config.qk_head_dim = text_config.qk_nope_head_dim + rope_dim


def image_processor(config: Glm5NextConfig) -> Glm5NextImageProcessorPil:
    """The checkpoint's image processor (``preprocessor_config.json``): the vision config's
    patch, temporal patch and merge sizes, CLIP mean/std, token bounds
    ``MIN_IMAGE_TOKENS``..``MAX_IMAGE_TOKENS``."""
    from transformers import Glm5NextImageProcessorPil

    vision = config.vision_config
    return Glm5NextImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        patch_expand_factor=1,
        min_image_tokens=MIN_IMAGE_TOKENS,
        max_image_tokens=MAX_IMAGE_TOKENS,
    )
