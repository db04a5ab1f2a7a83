"""The tiny checkpoint's target weights: random, at scales that keep every layer's output
significant (:func:`random_state`)."""

from __future__ import annotations

import math

import torch

# Gain on the vision merger's output projection, so image embeddings are about as large as
# token embeddings (std ~1) instead of ~0.27 at the plain 1/sqrt(fan_in) scale.
VISION_MERGER_GAIN = 4.0


def random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with unit-scale activations so outputs depend on every tensor.

    transformers' own init (std 0.02) gives a nearly uniform next-token distribution on
    a toy model, which would let a broken layer pass a log-prob comparison.
    """
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        shape = tensor.shape

        def randn(std: float, mean: float = 0.0) -> torch.Tensor:
            return torch.randn(shape, generator=gen) * std + mean

        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            value = randn(1.0)
        elif name.endswith("lm_head.weight"):
            value = randn(3.0 / math.sqrt(shape[-1]))
        elif "norm" in name and leaf in ("weight",):
            value = randn(0.1, 1.0)
        elif leaf == "bias":
            value = randn(0.02)
        elif leaf == "A_log":
            value = randn(0.5)
        elif leaf == "dt_bias":
            value = randn(1.0)
        elif leaf == "e_score_correction_bias":
            value = randn(0.1)
        elif leaf == "index_kpool_compress_ape":
            value = randn(1.0)
        elif leaf == "base":  # mHC biases
            value = randn(0.5)
        elif leaf == "scale":  # mHC per-output scales
            value = randn(0.2, 1.0)
        elif leaf == "fn":  # mHC projection over hc_mult * hidden inputs
            value = randn(1.0 / math.sqrt(shape[-1]))
        elif leaf == "conv1d" or name.endswith("conv1d.weight"):
            value = randn(0.5)
        elif leaf in ("gate_up_proj", "down_proj") and tensor.dim() == 3:
            value = randn(1.0 / math.sqrt(shape[-1]))
        elif name == "model.visual.merger.down_proj.weight":
            value = randn(VISION_MERGER_GAIN / math.sqrt(shape[-1]))
        elif tensor.dim() >= 2:
            fan_in = math.prod(shape[1:])
            value = randn(1.0 / math.sqrt(fan_in))
        else:
            value = randn(0.1, 1.0 if "norm" in name else 0.0)
        state[name] = value.to(tensor.dtype).contiguous()
    return state
