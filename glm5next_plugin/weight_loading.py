"""Loading checkpoint tensors into the plugin's modules by name, and the inference cast.

Checkpoint tensors carry transformers' names (``model.language_model.layers.{i}.*``,
``model.visual.*``, ``lm_head.*``; the on-disk GLM spellings are converted first, see
:mod:`glm5next_plugin.checkpoint_names`) and are always the full, unsharded ones: a module
that lists a parameter in its ``tp_shards`` table receives this rank's piece
(:mod:`glm5next_plugin.tp`). The target (:mod:`glm5next_plugin.model`), the MTP draft
(:mod:`glm5next_plugin.mtp`) and the standalone model (:mod:`glm5next_plugin.standalone`)
load through :func:`load_by_name`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from .checkpoint_names import canonical_names
from .tp import Shard, TPInfo, shard_tensor

logger = logging.getLogger("vllm.glm5next_plugin.weight_loading")

# The vision tower's tensors: loaded where the module has a tower, else skipped (logged).
_VISION_PREFIX = "model.visual."

# Kept in fp32 whatever the model dtype, as transformers does (_keep_in_fp32_modules_strict);
# and the sparse-MLA layers' fp8 KV cache scale.
FP32_TENSORS = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "self_attn.k_scale")
# Tensors a checkpoint may leave out, keeping the module's default: the sparse-MLA layers'
# fp8 KV cache scale (1.0, vLLM's for an uncalibrated fp8 cache; see glm5next_plugin.mla_layer).
OPTIONAL_TENSORS = ("self_attn.k_scale",)


def cast_for_inference(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast to ``dtype`` except the KDA gate/conv parameters and the router bias."""
    module.to(dtype)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name.endswith(FP32_TENSORS):
            t.data = t.data.float()
    return module


def load_by_name(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    num_layers: int,
    num_experts: int = 0,
    *,
    tied_lm_head: bool = False,
) -> set[str]:
    """Copy checkpoint tensors into ``module`` by name (transformers' names; with
    ``num_experts``, the on-disk GLM spellings are converted first, see
    :mod:`glm5next_plugin.checkpoint_names`).

    Vision-tower tensors load into ``model.visual`` where the module has one and are
    skipped (logged) where it has none; MTP tensors are skipped (logged); any other unknown tensor, a shape
    mismatch, or a parameter left without a tensor raises with the names involved. With
    ``tied_lm_head`` the module's ``lm_head`` is the embedding matrix: an ``lm_head.weight``
    in the checkpoint is ignored, as transformers ignores it for tied models.

    Checkpoint tensors are always the full (unsharded) ones; parameters a module lists in
    ``tp_shards`` receive this rank's piece (:func:`glm5next_plugin.tp.shard_tensor`).
    """
    if num_experts:
        weights = canonical_names(weights, num_experts)
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    shards = tp_shards_of(module)
    loaded: set[str] = set()
    unexpected: list[str] = []
    skipped = {"vision": 0, "mtp": 0}
    prefix = "model.language_model.layers."
    has_vision = any(p.startswith(_VISION_PREFIX) for p in params)
    for name, tensor in weights:
        if tied_lm_head and name == "lm_head.weight":
            continue
        if name.startswith(_VISION_PREFIX) and not has_vision:
            skipped["vision"] += 1
            continue
        if name.startswith(prefix) and int(name[len(prefix) :].split(".", 1)[0]) >= num_layers:
            skipped["mtp"] += 1
            continue
        target = params.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if name in shards:
            tensor = shard_tensor(tensor, *shards[name])
        if name.endswith(OPTIONAL_TENSORS) and tensor.numel() == 1:
            tensor = tensor.reshape(target.shape)  # a scale stored as [1] or []
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"glm5next plugin: {name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        loaded.add(name)
    if unexpected:
        raise ValueError(f"glm5next plugin: unexpected tensors in checkpoint: {sorted(unexpected)}")
    missing = sorted(n for n in set(params) - loaded if not n.endswith(OPTIONAL_TENSORS))
    if missing:
        raise ValueError(f"glm5next plugin: tensors missing from checkpoint: {missing}")
    loaded |= {n for n in params if n.endswith(OPTIONAL_TENSORS)}  # given, or their defaults kept
    if skipped["vision"]:
        logger.info(
            "glm5next plugin: skipped %d vision-tower tensors (no tower: text-only, or an image limit of 0)",
            skipped["vision"],
        )
    if skipped["mtp"]:
        logger.info("glm5next plugin: skipped %d MTP tensors (the MTP draft loads its own)", skipped["mtp"])
    return loaded


def tp_shards_of(module: nn.Module) -> dict[str, tuple[Shard, TPInfo]]:
    """``{full parameter name: (how it is cut, this module's rank)}`` for every sharded
    parameter under ``module`` (from the modules' ``tp_shards`` tables)."""
    out: dict[str, tuple[Shard, TPInfo]] = {}
    for mod_name, mod in module.named_modules():
        table = getattr(mod, "tp_shards", None)
        if not table:
            continue
        for param, shard in table.items():
            out[f"{mod_name}.{param}" if mod_name else param] = (shard, mod.tp)
    return out
