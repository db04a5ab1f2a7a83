"""GLM-5.3-Flash's vision tower (``model.visual``) in plain PyTorch.

It turns the image processor's flat patches (``pixel_values`` ``[patches, C * T * P * P]``
and ``grid_thw`` ``[images, 3]`` in patch units) into one embedding per image token,
``grid_t * grid_h * grid_w / merge_size**2`` rows of the text model's hidden size, in the
order the placeholder tokens take in the prompt.

The steps, as the checkpoint's tensor names spell them:

- ``patch_embed.proj``: a Conv3d whose kernel equals its stride and covers one patch, so it
  is one matrix product per patch (computed as such);
- ``blocks.{i}``: pre-norm blocks (RMSNorm ``norm1``/``norm2``); attention with one fused
  ``qkv`` projection, an RMSNorm per head on queries and keys (``q_norm``/``k_norm``), a
  2-D axial rotary embedding and full (non-causal) attention inside each frame of each image,
  never across; a SwiGLU MLP with GLM's clamps;
- ``post_layernorm``, then ``downsample``: a Conv2d with kernel = stride =
  ``spatial_merge_size`` over each ``merge x merge`` group of neighbouring patches (the
  processor emits each group's patches consecutively), to ``out_hidden_size``;
- ``merger``: linear ``proj``, LayerNorm, GELU, clamped SwiGLU back to ``out_hidden_size``.

Axial rotary: a head of ``d`` channels rotates pairs ``(j, j + d/2)``; the first quarter of
the frequencies turns with the patch's row, the second with its column (the same ``d/4``
inverse frequencies ``theta ** (-4k/d)`` for both), and the second half of the head repeats
that layout. Attention runs through ``torch.nn.functional.scaled_dot_product_attention``,
one call per frame; nothing here needs Triton or a vLLM kernel, so it runs on CPU and CUDA.

The tower is replicated under tensor parallelism (it is small next to the text model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import RMSNorm, clamped_swiglu

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def patch_positions(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) of every patch, in the processor's patch order: within
    a frame, ``merge x merge`` groups row-major over the group grid, each group row-major;
    frames repeat the same positions."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        # group-major: (group row, group col, row in group, col in group)
        rc = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def frame_lengths(grid_thw: list[list[int]]) -> list[int]:
    """Patches per attention segment: one segment per frame of each image or video."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


class AxialRotary(nn.Module):
    """cos/sin ``[patches, head_dim]`` of the 2-D axial rotary embedding."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"glm5next plugin: vision head_dim {head_dim} must divide by 4 (axial rotary)")
        self.quarter = head_dim // 4
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # not a buffer: no checkpoint tensor, and always fp32 whatever the model dtype
        exponents = torch.arange(self.quarter, dtype=torch.float64, device=positions.device) / self.quarter
        inv_freq = (self.theta**-exponents).float()
        angles = positions.float()[:, :, None] * inv_freq  # [N, 2 (row, col), d/4]
        half = angles.flatten(1)  # row freqs then column freqs: [N, d/2]
        full = torch.cat([half, half], dim=-1)
        return full.cos(), full.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(j, j + d/2)`` of ``x`` ``[N, heads, d]`` by the angles (fp32)."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    swapped = torch.cat([-b, a], dim=-1)
    return (xf * cos[:, None] + swapped * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q = rotate(self.q_norm(q), *rope)
        k = rotate(self.k_norm(k), *rope)
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            # [heads, len, d]; every patch sees every patch of its own frame
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            outs.append(o.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.attention_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.attention_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class VisionBlock(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``proj`` -> LayerNorm -> GELU -> clamped SwiGLU (``gate``/``up`` to the projection
    width, ``down`` back), all at ``out_hidden_size``."""

    def __init__(self, dim: int, inner: int, limit: float) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # kernel == stride == the whole patch: one dot product per output channel
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionTower(nn.Module):
    """``model.visual``: patches in, image-token embeddings (text hidden size) out."""

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        check_vision_supported(cfg)
        self.merge = cfg.spatial_merge_size
        self.out_hidden_size = cfg.out_hidden_size
        self.patch_embed = PatchEmbed(cfg)
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.rotary = AxialRotary(cfg.hidden_size // cfg.num_heads, float(rope.get("rope_theta", 10000.0)))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=self.merge, stride=self.merge)
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.projection_intermediate_size, cfg.swiglu_limit)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def tokens_per_item(self, grid_thw: list[list[int]]) -> list[int]:
        return [t * h * w // self.merge**2 for t, h, w in grid_thw]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        """``[sum of tokens_per_item, out_hidden_size]`` for the images of ``grid_thw``."""
        grid = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
        for t, h, w in grid:
            if h % self.merge or w % self.merge:
                raise ValueError(f"glm5next plugin: image grid {t}x{h}x{w} does not divide by merge size {self.merge}")
        x = self.patch_embed(pixel_values)
        if x.shape[0] != sum(t * h * w for t, h, w in grid):
            raise ValueError(f"glm5next plugin: {x.shape[0]} patches for image grids {grid}")
        rope = self.rotary(patch_positions(grid, self.merge).to(x.device))
        segments = frame_lengths(grid)
        for block in self.blocks:
            x = block(x, rope, segments)
        x = self.post_layernorm(x)
        # each merge x merge group is consecutive: [groups, m*m, C] -> conv input [groups, C, m, m]
        groups = x.view(-1, self.merge * self.merge, x.shape[-1]).transpose(1, 2)
        w = self.downsample.weight
        x = F.linear(groups.reshape(groups.shape[0], -1), w.reshape(w.shape[0], -1), self.downsample.bias)
        return self.merger(x)


def check_vision_supported(cfg: PretrainedConfig) -> None:
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise NotImplementedError(f"glm5next plugin: vision rope_type {rope_type!r} is not supported (only 'axial')")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"glm5next plugin: vision hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
