"""KDA layer as a vLLM state ("Mamba-like") layer.

vLLM owns the state: the hybrid cache manager allocates one (conv, recurrent) slot per
block of this layer's group, and with ``--enable-prefix-caching`` keeps align-mode
snapshots on the block grid. Each step the GDN metadata builder hands us, per request,
the slot holding the running state (already seeded from the resume snapshot by vLLM's
``preprocess_mamba``) and whether that state is live (``has_initial_state``). We read the
state, run the math in :mod:`glm5next_plugin.kda`, and write it back in place.

State layout, per slot (the same as vLLM's native GLM5-Next KDA layer):
conv ``(W - 1, 3 * H * D)`` in the model dtype ("SD" layout), recurrent ``(H, D, D)``
stored ``[H, V, K]`` in fp32 (``mamba_ssm_cache_dtype`` may make it bf16).

Tensor parallel: heads are split across ranks (``H / size`` per rank, rank ``r`` holding
heads ``[r * H / size, (r + 1) * H / size)``). Every per-head tensor is cut accordingly:
q/k/v, ``f_b_proj``, ``g_b_proj``, ``b_proj`` (column-parallel, by output rows), the conv
channels of each of q|k|v, ``dt_bias`` and ``A_log``; ``o_proj`` is row-parallel (its output
is a partial sum, all-reduced by the decoder layer). The low-rank ``f_a_proj`` /
``g_a_proj`` and the per-head-dim ``o_norm`` are replicated. The state slots hold this
rank's heads only; vLLM's calculator sizes them so (``kda_state_shape``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from . import kda
from .tp import TP1, Shard, TPInfo, tp_info
from .vllm_layer import register_layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


class ForgetGate(nn.Module):
    """Low-rank forget-gate projection plus the per-head decay rate (checkpoint names)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_heads * head_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the KDA output times ``sigmoid(gate)``, in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return xf * torch.sigmoid(gate.float())


class KDAProjections(nn.Module):
    """The KDA layer's weights and its per-sequence math, free of vLLM (this rank's heads;
    under TP, :meth:`forward_sequence` returns this rank's partial sum of the output)."""

    tp_shards = {
        "q_proj.weight": Shard(0),
        "k_proj.weight": Shard(0),
        "v_proj.weight": Shard(0),
        "conv1d.weight": Shard(0, parts=3),  # channels q|k|v, each by heads
        "forget_gate.f_b_proj.weight": Shard(0),
        "forget_gate.dt_bias": Shard(0),
        "forget_gate.A_log": Shard(0),
        "b_proj.weight": Shard(0),
        "g_b_proj.weight": Shard(0),
        "o_proj.weight": Shard(1),
    }

    def __init__(self, config: PretrainedConfig, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        h = tp.split(config.linear_num_heads, "linear_num_heads")
        d, hidden = config.linear_head_dim, config.hidden_size
        self.num_heads, self.head_dim = h, d
        self.conv_dim = 3 * h * d
        self.lower_bound = config.linear_lower_bound
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, h * d, bias=False)
        self.v_proj = nn.Linear(hidden, h * d, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, config.linear_conv_kernel_dim, groups=self.conv_dim, bias=False
        )
        self.forget_gate = ForgetGate(hidden, h, d)
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, h * d, bias=False)
        self.o_norm = GatedRMSNorm(d, config.rms_norm_eps)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.conv_dim, -1)

    def token_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token parts that need no state: pre-conv q|k|v, log-decay, beta, output gate."""
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        raw = self.forget_gate.f_b_proj(self.forget_gate.f_a_proj(x)).view(t, self.num_heads, self.head_dim)
        fg = self.forget_gate
        if self.lower_bound is not None:
            g = kda.safe_gate(raw, fg.dt_bias, fg.A_log, self.lower_bound)
        else:
            g = kda.softplus_gate(raw, fg.dt_bias, fg.A_log)
        beta = torch.sigmoid(self.b_proj(x)).float()  # in the model dtype, as the reference
        out_gate = self.g_b_proj(self.g_a_proj(x)).view(t, self.num_heads, self.head_dim)
        return mixed, g, beta, out_gate

    def split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lead = conv_out.shape[:-1]
        q, k, v = conv_out.float().split(self.num_heads * self.head_dim, dim=-1)
        q, k, v = (t.reshape(*lead, self.num_heads, self.head_dim) for t in (q, k, v))
        q = kda.l2_normalize(q) * self.head_dim**-0.5
        return q, kda.l2_normalize(k), v

    def output(self, core: torch.Tensor, out_gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        o = self.o_norm(core.to(dtype), out_gate).to(dtype)
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_sequence(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        recurrent_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence chunk ``x`` ``[T, hidden]`` from the given states (None = fresh).

        Returns the layer output and the new (conv, recurrent) states.
        """
        mixed, g, beta, out_gate = self.token_inputs(x)
        conv_out, conv_state = kda.causal_conv(mixed, self.conv_weight, conv_state)
        q, k, v = self.split_qkv(conv_out)
        if x.shape[0] == 1 and recurrent_state is not None:
            core, state = kda.kda_decode_step(q, k, v, g, beta, recurrent_state.unsqueeze(0))
            state = state[0]
        else:
            core, state = kda.kda_chunked(q, k, v, g, beta, recurrent_state)
        return self.output(core, out_gate, x.dtype), conv_state, state


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standalone: ``x`` is one whole fresh sequence."""
        return self.forward_sequence(x)[0]


def _vllm_state_layer_base() -> type:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return MambaBase


class KDAStateLayer(KDAProjections, _vllm_state_layer_base()):
    """KDA with its state in vLLM's cache (registered in the static forward context)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig, prefix: str, tp: TPInfo | None = None) -> None:
        # ``tp`` given: this rank's place without asking vLLM's process groups (a layer
        # built only for its cache spec, e.g. by testing/glm_flash_kv_layouts.py).
        super().__init__(config, tp or tp_info(vllm_config))
        self.prefix = prefix
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache: tuple[torch.Tensor, ...] = (torch.tensor([]), torch.tensor([]))
        register_layer(self, vllm_config, prefix)

    # --- what vLLM asks of a state layer ---------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        # The GDN metadata builder gives exactly what KDA needs (per-request state
        # slot, has-initial-state, query ranges); the math is ours.
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return kda_state_shape(self.vllm_config)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return kda_state_dtype(self.vllm_config)

    # --- forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.forward_sequence(x)[0]  # standalone use: one fresh sequence
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # profiling / dummy run: no cache bound yet
            return torch.zeros_like(x)
        md = metadata[self.prefix]
        out = torch.zeros_like(x)
        if md.num_actual_tokens == 0:
            return out
        spec_rows, plain_rows = _token_rows(md, x.device)
        if md.num_spec_decodes > 0:
            self._forward_spec(x, spec_rows, md, out)
        xs = x if plain_rows is None else x[plain_rows]
        if xs.shape[0] == 0:
            return out
        ys = self._forward_plain(xs, md)
        if plain_rows is None:
            out[: ys.shape[0]] = ys
        else:
            out[plain_rows] = ys
        return out

    def _window(self, conv_cache: torch.Tensor, idx, first: int | torch.Tensor = 0) -> torch.Tensor:
        """The ``W - 1`` raw inputs a sequence's conv starts from, ``[..., W - 1, C]``, from
        row ``first`` of its slot (the slot holds ``W - 1 + k`` rows with k draft tokens)."""
        state = conv_cache[idx]
        if _conv_dim_first():
            state = state.transpose(-1, -2)
        w = self.conv_weight.shape[-1] - 1
        if isinstance(first, int):
            return state[..., first : first + w, :]
        rows = first.view(-1, 1) + torch.arange(w, device=state.device)  # [B, W - 1]
        return state.gather(1, rows.unsqueeze(-1).expand(-1, -1, state.shape[-1]))

    def _store_conv(self, conv_cache: torch.Tensor, idx, new: torch.Tensor) -> None:
        """Write ``new`` (``[..., n, C]``) into the first ``n`` rows of the slots ``idx``."""
        n = new.shape[-2]
        if _conv_dim_first():
            conv_cache[idx, :, :n] = new.transpose(-1, -2).to(conv_cache.dtype)
        else:
            conv_cache[idx, :n] = new.to(conv_cache.dtype)

    def _forward_plain(self, x: torch.Tensor, md) -> torch.Tensor:
        """Prefill chunks and one-token decodes that carry no drafts (``x``: their tokens,
        decodes first, as the metadata orders them)."""
        conv_cache, rec_cache = self.kv_cache
        out = torch.zeros_like(x)
        qsl = md.non_spec_query_start_loc.tolist()
        slots = md.non_spec_state_indices_tensor.tolist()
        has_init = md.has_initial_state.tolist() if md.has_initial_state is not None else None
        nd = md.num_decodes
        if nd > 0:
            # decodes come first, one token each: batch them
            idx = torch.tensor(slots[:nd], dtype=torch.long, device=x.device)
            xd = x[:nd]
            mixed, g, beta, out_gate = self.token_inputs(xd)
            full = torch.cat([self._window(conv_cache, idx).to(mixed.dtype), mixed.unsqueeze(1)], dim=1)  # [B, W, C]
            w = self.conv_weight
            conv_out = torch.nn.functional.silu((full.to(w.dtype) * w.t()).sum(1)).to(mixed.dtype)
            self._store_conv(conv_cache, idx, full[:, 1:])
            q, k, v = self.split_qkv(conv_out)
            core, state = kda.kda_decode_step(q, k, v, g, beta, rec_cache[idx])
            rec_cache[idx] = state.to(rec_cache.dtype)
            out[:nd] = self.output(core, out_gate, x.dtype)
        for i in range(nd, md.num_decodes + md.num_prefills):
            start, end = qsl[i], qsl[i + 1]
            slot = slots[i]
            live = has_init[i] if has_init is not None else True
            conv_state = rec_state = None
            if live:
                conv_state = self._window(conv_cache, slot)
                rec_state = rec_cache[slot]
            y, new_conv, new_rec = self.forward_sequence(x[start:end], conv_state, rec_state)
            self._store_conv(conv_cache, slot, new_conv)
            rec_cache[slot] = new_rec.to(rec_cache.dtype)
            out[start:end] = y
        return out

    def _forward_spec(self, x: torch.Tensor, rows: torch.Tensor | None, md, out: torch.Tensor) -> None:
        """Verify steps: each sequence's last token plus its drafts (up to ``k + 1`` tokens).

        vLLM's contract for these rows (the GDN backend's, which its Triton kernels keep):
        ``spec_state_indices_tensor[b]`` lists ``k + 1`` state slots; the state after the
        last accepted token of the previous step is in slot ``[b, a - 1]`` (``a`` =
        ``num_accepted_tokens[b]``), and the state after this step's token ``t`` goes to
        slot ``[b, t]``, so the next step starts from whichever draft was accepted. The
        conv slot (column 0's) holds ``W - 1 + k`` raw inputs; the window to start from
        begins at row ``a - 1``; afterwards the slot holds the ``W - 2`` inputs after that
        row followed by this step's inputs, so any accepted count finds its window.
        """
        conv_cache, rec_cache = self.kv_cache
        n = md.num_spec_decodes
        qsl = md.spec_query_start_loc[: n + 1].tolist()
        slots = md.spec_state_indices_tensor[:n].tolist()
        accepted = md.num_accepted_tokens[:n].tolist()
        xs = x[: qsl[-1]] if rows is None else x[rows]
        mixed, g, beta, out_gate = self.token_inputs(xs)
        w = self.conv_weight
        width = w.shape[-1]
        core = torch.empty(xs.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        for b in range(n):
            start, end = qsl[b], qsl[b + 1]
            if end == start or slots[b][0] <= 0:  # padding / null block
                continue
            a = accepted[b]
            window = self._window(conv_cache, slots[b][0], a - 1)
            conv_out, _ = kda.causal_conv(mixed[start:end], w, window)
            tail = self._window(conv_cache, slots[b][0], a)[: width - 2]
            self._store_conv(conv_cache, slots[b][0], torch.cat([tail.to(mixed.dtype), mixed[start:end]]))
            q, k, v = self.split_qkv(conv_out)
            state = rec_cache[slots[b][a - 1]].float().unsqueeze(0)
            for t in range(end - start):
                o, state = kda.kda_decode_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[start + t : start + t + 1],
                                               beta[start + t : start + t + 1], state)
                core[start + t] = o[0]
                if slots[b][t] > 0:
                    rec_cache[slots[b][t]] = state[0].to(rec_cache.dtype)
        ys = self.output(core, out_gate, x.dtype)
        if rows is None:
            out[: ys.shape[0]] = ys
        else:
            out[rows] = ys


def _token_rows(md, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which rows of the layer input are verify (draft) tokens and which are plain ones,
    as index tensors, or None where the batch is all of one kind in order."""
    if md.num_spec_decodes == 0 or md.spec_sequence_masks is None:
        return None, None
    if md.num_prefills == 0 and md.num_decodes == 0:
        return None, torch.empty(0, dtype=torch.long, device=device)
    return md.spec_token_indx.long(), md.non_spec_token_indx.long()


def _conv_dim_first() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()


def kda_state_shape(vllm_config: VllmConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, recurrent) state shapes per slot, via vLLM's KDA calculator."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    cfg = vllm_config.model_config.hf_text_config
    spec = vllm_config.speculative_config
    return MambaStateShapeCalculator.kda_state_shape(
        vllm_config.parallel_config.tensor_parallel_size,
        cfg.linear_num_heads,
        cfg.linear_head_dim,
        conv_kernel_size=cfg.linear_conv_kernel_dim,
        num_spec=(spec.num_speculative_tokens if spec else 0) or 0,
    )


def kda_state_dtype(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv, recurrent) state dtypes: conv in the cache dtype, recurrent fp32 by default."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    return MambaStateDtypeCalculator.kda_state_dtype(
        vllm_config.model_config.dtype,
        vllm_config.cache_config.mamba_cache_dtype,
        vllm_config.cache_config.mamba_ssm_cache_dtype,
    )
