"""The tiny checkpoint's MTP layer (``model.language_model.layers.{N}.*``, the draft of
speculative method ``mtp``): derived in closed form from the target (:func:`mtp_state`), or
the layer trained for the target by ``validation/train_tiny_mtp.py`` and shipped with this
package (:func:`trained_mtp_state`; the seed-3 checkpoint's, ``tiny_mtp_seed3.safetensors``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# How the derived MTP layer mixes its inputs and blocks (see mtp_state): measured on the seed-3
# checkpoint, these give the most accepted drafts among the settings tried while the draft
# still depends on the target's hidden state, the attention and the MLP (each changes the
# drafted token at 13-35% of positions).
MTP_HIDDEN_SCALE = 0.1
MTP_BLOCK_SCALE = 0.2


def mtp_state(state: dict[str, torch.Tensor], text_config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors ``model.language_model.layers.{N + i}.*``, derived from the
    target's ``state`` so that drafts are accepted now and then: the layer of every
    checkpoint without a trained one (:func:`trained_mtp_state`), and the trained one's
    starting point.

    A random toy target is chaotic: its next token depends on several tokens of context,
    which one extra layer cannot learn without training. What a closed form can give is a
    draft led by the embedding of the token it reads (the one after the target's hidden
    state), with the target's hidden state, one attention and one MLP mixed in:

    - ``eh_proj`` ``[I | MTP_HIDDEN_SCALE * I]``: ``x = enorm(e) + 0.1 * hnorm(h)``;
      ``enorm``, ``hnorm`` ones;
    - ``self_attn.*`` and ``input_layernorm`` copied from the last sparse-MLA layer, MLP and
      ``post_attention_layernorm`` from the last layer (the MTP MLP has the last layer's
      type); the attention's ``o_proj`` and the MLP's down projections scaled by
      ``MTP_BLOCK_SCALE``, so the blocks shift the residual instead of replacing it;
    - ``shared_head.norm`` is the target's final norm (the head is the target's
      ``lm_head``).

    Measured on the seed-3 target (which ships a trained layer instead): 2.5-5% of first
    drafts are accepted under greedy decoding (vLLM with two drafts: 7 of 278 verify steps
    over 3 random prompts, 9 of 180 over ``validation/bench_drafts.py``'s demo chat turns,
    none at position 2) and 4% of positions agree teacher-forced; random MTP weights agree
    at chance (2 of 1020, vocab 512).
    """
    n_layers = text_config.num_hidden_layers
    n_mtp = int(getattr(text_config, "num_nextn_predict_layers", 0) or 0)
    if n_mtp == 0:
        return {}
    hidden = text_config.hidden_size
    mla = [i for i, t in enumerate(text_config.layer_types) if t == "indexed_attention"]
    if not mla:
        raise ValueError("the MTP layer copies its attention from a sparse-MLA layer and there is none "
                         "(layer types without 'I'): write the checkpoint with --mtp-layers 0")
    layers = "model.language_model.layers."
    attn_from, mlp_from = f"{layers}{mla[-1]}.", f"{layers}{n_layers - 1}."
    block = {}
    for name, t in state.items():
        if name.startswith(attn_from) and name[len(attn_from) :].startswith(("self_attn.", "input_layernorm.")):
            block[name[len(attn_from) :]] = t
        if name.startswith(mlp_from) and name[len(mlp_from) :].startswith(("mlp.", "post_attention_layernorm.")):
            block[name[len(mlp_from) :]] = t
    for name, t in block.items():
        if name.startswith("self_attn.o_proj.") or name.endswith(("down_proj", "down_proj.weight")):
            block[name] = t * MTP_BLOCK_SCALE
    final_norm = state["model.language_model.norm.weight"]
    eye = torch.eye(hidden, dtype=final_norm.dtype)
    block["enorm.weight"] = torch.ones_like(final_norm)
    block["hnorm.weight"] = torch.ones_like(final_norm)
    block["eh_proj.weight"] = torch.cat([eye, MTP_HIDDEN_SCALE * eye], dim=1)
    block["shared_head.norm.weight"] = final_norm
    out = {}
    for i in range(n_layers, n_layers + n_mtp):
        for name, t in block.items():  # copies keep their dtype (the router bias stays fp32)
            out[f"{layers}{i}.{name}"] = t.clone().contiguous()
    return out


# MTP layers trained for a checkpoint's target (validation/train_tiny_mtp.py writes them
# here, into this package's data: pyproject.toml's package-data ships them), one file per
# target: the layer's tensors under their names inside layers.{N} ("eh_proj.weight", ...),
# and in the file's metadata the digest of the target it was trained on (target_digest).
# The seed-3 checkpoint's is shipped.
TRAINED_MTP_GLOB = "tiny_mtp_seed*.safetensors"


def trained_mtp_path(seed: int) -> Path:
    """Where the MTP layer trained for the seed-``seed`` checkpoint lives (in this package)."""
    return Path(__file__).with_name(f"tiny_mtp_seed{seed}.safetensors")


TRAINED_MTP = trained_mtp_path(3)


def trained_mtp_files() -> list[Path]:
    return sorted(Path(__file__).parent.glob(TRAINED_MTP_GLOB))


def target_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the target's tensors (every tensor but the MTP layers', by name: name,
    dtype, shape and bytes): what a trained MTP layer was trained against."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained_mtp_state(state: dict[str, torch.Tensor], text_config: PretrainedConfig,
                      paths: list[Path] | None = None) -> dict[str, torch.Tensor] | None:
    """The MTP layers' tensors (one copy per MTP layer) from the trained layer among
    ``paths`` (default :func:`trained_mtp_files`) whose target is ``state``'s, or None where
    none was trained on this target (another seed, size or dtype)."""
    n_mtp = int(getattr(text_config, "num_nextn_predict_layers", 0) or 0)
    paths = trained_mtp_files() if paths is None else paths
    if n_mtp == 0 or not paths:
        return None
    from safetensors import safe_open

    digest = target_digest(state)
    layer = None
    for path in paths:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("target_digest") == digest:
                layer = {name: f.get_tensor(name) for name in f.keys()}
                break
    if layer is None:
        return None
    n_layers = text_config.num_hidden_layers
    return {f"model.language_model.layers.{i}.{name}": t.clone().contiguous()
            for i in range(n_layers, n_layers + n_mtp) for name, t in layer.items()}
