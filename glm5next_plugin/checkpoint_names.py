"""Map GLM-5.3-Flash's on-disk tensor names to the names transformers (and we) use.

Published checkpoints store some tensors the way the training code laid them out;
transformers renames and fuses them on load (its ``conversion_mapping`` for
``glm5_next``). We accept both spellings and apply the same conversion:

- ``self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}``  -> ``self_attn.forget_gate.*``
- ``hc_{attn,ffn}_{fn,base,scale}``               -> ``{attn,ffn}_hc.{fn,base,scale}``
- ``mlp.experts.{e}.{gate,up}_proj.weight``       -> ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
- ``mlp.experts.{e}.down_proj.weight``            -> ``mlp.experts.down_proj`` ``[E, H, I]``
- ``self_attn.{q,k,v}_conv1d.weight``             -> ``self_attn.conv1d.weight`` (concatenated)

Names already in transformers' form pass through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_RENAMES = [
    (re.compile(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b"), r"self_attn.forget_gate.\1"),
    (re.compile(r"\bhc_(attn|ffn)_(fn|base|scale)\b"), r"\1_hc.\2"),
]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^(.*\.self_attn)\.(q|k|v)_conv1d\.weight$")


def canonical_names(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(transformers_name, tensor)``; per-expert and per-q/k/v pieces are held
    until their fused tensor is complete."""
    experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        if m := _EXPERT.match(name):
            prefix, idx, kind = m.group(1), int(m.group(2)), m.group(3)
            parts = experts.setdefault(prefix, {})
            parts[(kind, idx)] = tensor
            if len(parts) == 3 * num_experts:
                del experts[prefix]
                yield from _fuse_experts(prefix, parts, num_experts)
            continue
        if m := _CONV.match(name):
            prefix, which = m.group(1), m.group(2)
            parts = convs.setdefault(prefix, {})
            parts[which] = tensor
            if len(parts) == 3:
                del convs[prefix]
                w = torch.cat([parts[c].reshape(parts[c].shape[0], -1) for c in "qkv"], dim=0)
                yield f"{prefix}.conv1d.weight", w.unsqueeze(1)
            continue
        yield name, tensor
    incomplete = [f"{p}.* ({len(v)} of {3 * num_experts})" for p, v in experts.items()]
    incomplete += [f"{p}.{{q,k,v}}_conv1d ({sorted(v)})" for p, v in convs.items()]
    if incomplete:
        raise ValueError(f"glm5next plugin: incomplete fused tensors in checkpoint: {incomplete}")


def _fuse_experts(prefix: str, parts: dict, n: int) -> Iterator[tuple[str, torch.Tensor]]:
    gate_up = torch.stack([torch.cat([parts[("gate_proj", e)], parts[("up_proj", e)]], dim=0) for e in range(n)])
    down = torch.stack([parts[("down_proj", e)] for e in range(n)])
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.down_proj", down
