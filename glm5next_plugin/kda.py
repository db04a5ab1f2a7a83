"""Kimi Delta Attention (KDA) math: gate, short convolution and the delta-rule recurrence.

Shapes, per sequence: ``T`` tokens, ``H`` heads, head dim ``D`` (keys and values share it).
The recurrent state of one head is a ``D x D`` matrix. We keep it as ``[H, V, K]`` (value
rows, key columns), the layout vLLM's KDA kernels use for their state cache, so the bytes
in a state slot mean the same thing whichever implementation wrote them.

One token of the recurrence, per head (``q`` and ``k`` l2-normalised, ``q`` scaled by
``D ** -0.5``, ``g`` the log-decay per key channel, ``beta`` the write strength)::

    S <- S * exp(g)[None, :]          # decay each key column
    u <- beta * (v - S @ k)           # delta rule: write what the state mispredicts
    S <- S + outer(u, k)
    o <- S @ q

:func:`kda_reference` is exactly that loop; :func:`kda_chunked` (prefill) and
:func:`kda_decode_step` (one token per sequence) are the fast paths tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (eps inside the root, as FLA does)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def safe_gate(raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Log-decay per (token, head, key channel), bounded to ``(lower_bound, 0)``.

    ``raw``: ``[T, H, D]`` (the forget-gate projection), ``dt_bias``: ``[H * D]``,
    ``a_log``: ``[H]``. Computed in fp32.
    """
    t, h, d = raw.shape
    g = raw.float() + dt_bias.float().view(1, h, d)
    return lower_bound * torch.sigmoid(torch.exp(a_log.float()).view(1, h, 1) * g)


def softplus_gate(raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """The unbounded variant (``linear_lower_bound`` = None): ``-exp(A) * softplus(raw + bias)``."""
    t, h, d = raw.shape
    g = raw.float() + dt_bias.float().view(1, h, d)
    return -torch.exp(a_log.float()).view(1, h, 1) * F.softplus(g, threshold=20.0)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over one sequence.

    ``x``: ``[T, C]`` new inputs, ``weight``: ``[C, W]``, ``state``: ``[W - 1, C]`` the
    raw inputs before ``x`` (zeros for a fresh sequence). Returns the activated outputs
    ``[T, C]`` and the new state: the last ``W - 1`` raw inputs.
    """
    width = weight.shape[-1]
    if state is None:
        state = x.new_zeros(width - 1, x.shape[-1])
    full = torch.cat([state.to(x.dtype), x], dim=0)  # [W - 1 + T, C]
    windows = full.unfold(0, width, 1)  # [T, C, W]: window t covers full[t : t + W]
    # in the weight's dtype (fp32 in the checkpoint), like the reference
    out = (windows.to(weight.dtype) * weight.unsqueeze(0)).sum(-1)
    return F.silu(out).to(x.dtype), full[-(width - 1):].clone()


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence one token at a time (the readable reference).

    ``q, k, v, g``: ``[T, H, D]`` (q, k already normalised, q scaled), ``beta``: ``[T, H]``,
    ``state``: ``[H, V, K]`` or None. Returns outputs ``[T, H, D]`` and the final state,
    all fp32.
    """
    t_len, h, d = q.shape
    dev = q.device
    s = torch.zeros(h, d, d, device=dev) if state is None else state.float().clone()
    out = torch.empty(t_len, h, d, device=dev)
    for t in range(t_len):
        s = s * torch.exp(g[t].float()).unsqueeze(1)  # [H, V, K] * [H, 1, K]
        pred = torch.einsum("hvk,hk->hv", s, k[t].float())
        u = beta[t].float().unsqueeze(-1) * (v[t].float() - pred)
        s = s + u.unsqueeze(-1) * k[t].float().unsqueeze(1)
        out[t] = torch.einsum("hvk,hk->hv", s, q[t].float())
    return out, s


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``B`` sequences at once.

    ``q, k, v, g``: ``[B, H, D]``, ``beta``: ``[B, H]``, ``state``: ``[B, H, V, K]``.
    Returns ``[B, H, D]`` outputs and the new ``[B, H, V, K]`` states (fp32).
    """
    s = state.float() * torch.exp(g.float()).unsqueeze(2)
    pred = torch.einsum("bhvk,bhk->bhv", s, k.float())
    u = beta.float().unsqueeze(-1) * (v.float() - pred)
    s = s + u.unsqueeze(-1) * k.float().unsqueeze(2)
    return torch.einsum("bhvk,bhk->bhv", s, q.float()), s


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, a chunk of ``C`` tokens at a time (prefill path).

    Inside a chunk, with ``G_t`` the cumulative log-decay and ``S0`` the state entering
    the chunk, unrolling the loop gives (per head, ``s <= t``)::

        u_t + sum_{s<t} A[t,s] u_s = beta_t (v_t - S0 (k_t * exp(G_t)))
        A[t,s] = beta_t * sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])
        o_t    = S0 (q_t * exp(G_t)) + sum_{s<=t} B[t,s] u_s,
        B[t,s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])
        S_C    = S0 * exp(G_C) + sum_s outer(u_s, k_s * exp(G_C - G_s))

    so each chunk is one unit-lower-triangular solve plus matmuls. Only differences
    ``G_t - G_s <= 0`` are exponentiated, so nothing overflows however long the chunk.
    """
    t_len, h, d = q.shape
    dev = q.device
    s = torch.zeros(h, d, d, device=dev) if state is None else state.float().clone()
    out = torch.empty(t_len, h, d, device=dev)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    for start in range(0, t_len, chunk_size):
        end = min(start + chunk_size, t_len)
        c = end - start
        # head-major: [H, C, D]
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        gc = g[start:end].transpose(0, 1).cumsum(dim=1)  # G_t, [H, C, D]
        bc = beta[start:end].transpose(0, 1)  # [H, C]
        causal = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
        diff = gc.unsqueeze(2) - gc.unsqueeze(1)  # [H, t, s, D] = G_t - G_s
        decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        kk = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay)
        qk = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)
        strict = torch.ones(c, c, dtype=torch.bool, device=dev).tril(-1)
        a = (bc.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
        eye = torch.eye(c, device=dev).expand(h, c, c)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("hvk,htk->htv", s, kc * torch.exp(gc)))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        o = torch.einsum("hvk,htk->htv", s, qc * torch.exp(gc)) + torch.einsum("hts,hsv->htv", qk, u)
        out[start:end] = o.transpose(0, 1)
        g_last = gc[:, -1:, :]  # [H, 1, D]
        k_tail = kc * torch.exp(g_last - gc)  # k_s * exp(G_C - G_s)
        s = s * torch.exp(g_last) + torch.einsum("hsv,hsk->hvk", u, k_tail)
    return out, s
