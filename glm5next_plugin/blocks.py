"""Stateless building blocks of the GLM-5.3-Flash text model: norms, MLPs, MoE, mHC.

Parameter names are the checkpoint's (as transformers names them), so a tensor in the
safetensors file maps to a parameter here by name alone.

Tensor parallel (``tp``): MLPs and experts are cut along their intermediate dimension
(gate/up column-parallel, down row-parallel, as vLLM shards its MLPs); their outputs are
then partial sums that the decoder layer all-reduces. Norms, the router and mHC are
replicated. ``tp_shards`` names the sharded parameters for the loader
(:mod:`glm5next_plugin.tp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .tp import TP1, Shard, TPInfo

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in fp32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(gate) * up with GLM's clamps: gate from above, up on both sides."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """Dense SwiGLU MLP (also the shared expert of an MoE layer). Under TP each rank holds
    ``intermediate / size`` channels; the clamped SwiGLU is per channel, so the rank outputs
    sum to the full MLP's output."""

    tp_shards = {"gate_proj.weight": Shard(0), "up_proj.weight": Shard(0), "down_proj.weight": Shard(1)}

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        intermediate = tp.split(intermediate, "MLP intermediate size")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Router(nn.Module):
    """Sigmoid router with the score-correction bias (used for choosing only),
    group-limited choice, top-k normalisation and routed scaling."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights ``[T, top_k]`` fp32, expert ids ``[T, top_k]``)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n_exp = choice.shape[-1]
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, n_exp // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep_groups = group_score.topk(self.topk_group, dim=-1).indices
            group_ok = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_groups, True)
            expert_ok = group_ok.unsqueeze(-1).expand_as(grouped).reshape(-1, n_exp)
            choice = choice.masked_fill(~expert_ok, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class Experts(nn.Module):
    """Routed experts as the checkpoint stores them: fused ``gate_up_proj`` ``[E, 2I, H]``
    and ``down_proj`` ``[E, H, I]``. Under TP every rank holds every expert with
    ``I / size`` intermediate channels (gate and up cut alike, so they stay paired)."""

    tp_shards = {"gate_up_proj": Shard(1, parts=2), "down_proj": Shard(2)}

    def __init__(self, config: PretrainedConfig, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        e, h = config.n_routed_experts, config.hidden_size
        i = tp.split(config.moe_intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.swiglu_limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.swiglu_limit), self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """Routed experts plus the always-on shared expert(s). The router is replicated, so
    every rank picks the same experts; under TP the output is a partial sum."""

    def __init__(self, config: PretrainedConfig, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, tp)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit, tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class HyperConnection(nn.Module):
    """mHC: mixes ``hc_mult`` residual streams around one block (attention or MLP).

    From the streams it derives ``pre`` (collapse the streams into the block input),
    ``post`` (spread the block output back over the streams) and ``comb`` (a doubly
    stochastic stream-mixing matrix, by Sinkhorn iterations)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_mult = n
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams``: ``[T, n, H]``. Returns (post ``[T, n]``, comb ``[T, n, n]``, block input ``[T, H]``)."""
        n = self.hc_mult
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, block_input

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """New streams: ``post`` spreads the block output, ``comb^T`` mixes the residual streams."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )
