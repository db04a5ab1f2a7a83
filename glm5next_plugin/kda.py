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


# Chosen by measurement (validation/bench_plugin.py --kda; 64 heads x 128, fp32, one
# CPU thread): see the README's KDA table. Also bounded by _MAX_CHUNK_DECAY below.
DEFAULT_CHUNK = 32
# Largest cumulative log-decay a chunk may span per channel: factors exp(+-span/2) stay
# inside float32 (exp(88) overflows); the real gate (lower bound -5) allows 32 tokens.
_MAX_CHUNK_DECAY = 160.0
# Chunks whose intra-chunk matrices are built at once (bounds their memory).
_SEGMENT_CHUNKS = 64


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, a chunk of ``C`` tokens at a time, from matmuls (prefill path).

    Inside a chunk, with ``G_t`` the cumulative log-decay from the chunk start and ``S0``
    the state entering it, unrolling the loop gives (per head, ``s < t``)::

        u_t + sum_{s<t} A[t,s] u_s = beta_t (v_t - S0 (k_t * exp(G_t)))
        A[t,s] = beta_t * sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])
        o_t    = S0 (q_t * exp(G_t)) + sum_{s<=t} B[t,s] u_s,
        B[t,s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])
        S_C    = S0 * exp(G_C) + sum_s outer(u_s, k_s * exp(G_C - G_s))

    With ``T = (I + A)^-1`` (unit lower triangular) the state-free parts are
    ``U = T (beta v)`` and ``W = T (beta k exp(G))`` (the WY / UT form), so only
    ``u = U - W S0^T``, the output and the state update run chunk after chunk; ``A``,
    ``B``, ``U`` and ``W`` are computed for many chunks in one batch. ``A`` and ``B`` are
    products of ``k_t exp(G_t - m)`` and ``k_s exp(m - G_s)`` with ``m`` the middle of the
    chunk's decay range, so the factors stay within ``exp(+-span/2)``; a gate steeper
    than the chunk allows (span over ``_MAX_CHUNK_DECAY``) shrinks the chunk. Everything
    is float32. Returns outputs ``[T, H, D]`` and the final state ``[H, V, K]``.
    """
    t_len, h, d = q.shape
    dev = q.device
    s = torch.zeros(h, d, d, device=dev) if state is None else state.float().clone()
    if t_len == 0:
        return torch.empty(0, h, d, device=dev), s
    if t_len == 1:  # one token: the recurrence step itself is the cheapest exact form
        out, s = kda_decode_step(q, k, v, g, beta, s.unsqueeze(0))
        return out, s[0]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    steepest = float(-g.min()) if g.numel() else 0.0
    if steepest > 0:
        chunk_size = max(1, min(chunk_size, int(_MAX_CHUNK_DECAY / steepest)))
    c = min(chunk_size, t_len)
    n_chunks = -(-t_len // c)
    pad = n_chunks * c - t_len
    if pad:
        # padded tokens write nothing (beta 0, k 0) and do not decay (g 0)
        q, k, v, g = (torch.cat([x, x.new_zeros(pad, h, d)]) for x in (q, k, v, g))
        beta = torch.cat([beta, beta.new_zeros(pad, h)])
    # [H, N, C, D] / [H, N, C], contiguous once so the batched matmuls copy nothing
    q, k, v, g = (x.view(n_chunks, c, h, d).permute(2, 0, 1, 3).contiguous() for x in (q, k, v, g))
    beta = beta.view(n_chunks, c, h).permute(2, 0, 1).unsqueeze(-1)
    out = torch.empty(h, n_chunks, c, d, device=dev)
    strict = torch.ones(c, c, dtype=torch.bool, device=dev).tril(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(c, device=dev)
    for seg in range(0, n_chunks, _SEGMENT_CHUNKS):
        sl = slice(seg, min(seg + _SEGMENT_CHUNKS, n_chunks))
        ks, bs = k[:, sl], beta[:, sl]
        big_g = g[:, sl].cumsum(dim=2)  # G_t, [H, n, C, D]
        g_last = big_g[:, :, -1:, :]  # G_C
        mid = 0.5 * g_last  # G_0 = 0 >= G_t >= G_C
        grow = torch.exp(big_g - mid)  # exp(G_t - m), within exp(+-span/2)
        k_in = ks * grow
        k_out = ks / grow  # k_s exp(m - G_s)
        q_in = q[:, sl] * grow
        a = (k_in @ k_out.transpose(-1, -2)).masked_fill_(~strict, 0.0).mul_(bs)
        b = (q_in @ k_out.transpose(-1, -2)).masked_fill_(~causal, 0.0)
        at_mid = torch.exp(mid)
        rhs = torch.cat([v[:, sl], k_in.mul_(at_mid)], dim=-1).mul_(bs)  # beta [v | k exp(G)]
        uw = torch.linalg.solve_triangular(a.add_(eye), rhs, upper=False, unitriangular=True)
        u_free, w = uw[..., :d], uw[..., d:]
        q_dec = q_in.mul_(at_mid)  # q exp(G_t)
        k_tail = k_out.mul_(torch.exp(g_last - mid))  # k_s exp(G_C - G_s)
        state_decay = torch.exp(g_last)  # [H, n, 1, D]
        for i in range(uw.shape[1]):
            st = s.transpose(1, 2)  # [H, K, V]
            u = torch.baddbmm(u_free[:, i], w[:, i], st, alpha=-1.0)  # [H, C, V]
            out[:, seg + i] = torch.baddbmm(torch.bmm(b[:, i], u), q_dec[:, i], st)
            s = torch.baddbmm(s * state_decay[:, i], u.transpose(1, 2), k_tail[:, i])
    return out.permute(1, 2, 0, 3).reshape(n_chunks * c, h, d)[:t_len], s
