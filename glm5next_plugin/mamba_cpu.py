"""CPU stand-ins for the two Triton kernels vLLM runs to move state snapshots when speculative
decoding meets a hybrid model in align mode.

With drafts on, every decode step may accept a different number of tokens, so the running
KDA state of a request sits at a per-request offset: the recurrent state in the block
column of the last accepted token, the conv window shifted by the accepted count. vLLM's
model runner (``v1/worker/mamba_utils.py``, ``MambaSpecDecodeGPUContext``) then moves state
with ``precopy_mamba_align_fused_kernel`` before a step (the previous running block into the
new one when a block boundary is crossed) and ``postprocess_mamba_fused_kernel`` after it
(the accepted state into the block-aligned column the prefix cache snapshots). Both are
Triton only; vLLM 0.32's CPU build has no Triton backend and its CPU platform replaces only
``batch_memcpy_kernel``, so without these an engine with drafts stops at its first step.

The functions below follow the kernels' decision logic and copy semantics, one request and
one state tensor at a time, on raw addresses (the kernels get ``data_ptr`` tables):

- conv state (``conv_width > 0``, the token axis length): drop ``token_bias`` leading
  tokens, ``state[src][bias:] -> state[dst][:width - bias]`` (``memmove``: the same block
  may shift onto itself);
- temporal (recurrent) state: the accepted column's block,
  ``state[bt[src + bias]] -> state[bt[dst]]``.

They are installed by :func:`register`, only on CPU.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

_U64 = (1 << 64) - 1
POSTPROCESS = "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel"
PRECOPY = "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"


def _ints(t: Any) -> list[int]:
    return [] if t is None else [int(v) for v in t.tolist()]


class _Layout:
    """The flattened per-(layer, state) metadata the kernels receive, read once per launch."""

    def __init__(self, block_table_ptrs, block_table_stride_req, base, strides, elem, inner, conv_widths,
                 groups, dim_rows, dim_row_stride, dim_first: bool) -> None:
        self.tables = [p & _U64 for p in _ints(block_table_ptrs)]
        self.table_stride = int(block_table_stride_req)
        self.base = [p & _U64 for p in _ints(base)]
        self.strides, self.elem, self.inner = _ints(strides), _ints(elem), _ints(inner)
        self.conv_widths, self.groups = _ints(conv_widths), _ints(groups)
        self.dim_rows, self.dim_row_stride = _ints(dim_rows), _ints(dim_row_stride)
        self.dim_first = bool(dim_first)

    def block_id(self, state: int, row: int, col: int) -> int:
        table = self.tables[self.groups[state]]
        return ctypes.c_int32.from_address(table + 4 * (row * self.table_stride + col)).value

    def copy(self, state: int, row: int, src_col: int, dst_col: int, bias: int) -> None:
        """One (layer, state type) block copy, as the kernels' ``_copy_mamba_state_block``."""
        base, stride, elem = self.base[state], self.strides[state], self.elem[state]
        width = self.conv_widths[state]
        dst = base + self.block_id(state, row, dst_col) * stride
        if width > 0:  # conv window: drop the first `bias` tokens
            src = base + self.block_id(state, row, src_col) * stride
            keep = width - bias
            if self.dim_first:  # [dim, state_len]: tokens contiguous within each dim row
                rs = self.dim_row_stride[state]
                for r in range(self.dim_rows[state]):
                    ctypes.memmove(dst + r * rs, src + r * rs + bias * elem, keep * elem)
            else:  # [state_len, dim]
                token = self.inner[state] * elem  # inner: elements per token row (stride(1))
                ctypes.memmove(dst, src + bias * token, keep * token)
            return
        src = base + self.block_id(state, row, src_col + bias) * stride
        ctypes.memmove(dst, src, self.inner[state] * elem)

    @property
    def num_states(self) -> int:
        return len(self.base)


def postprocess_mamba_fused(
    num_accepted_tokens_ptr: Tensor, mamba_state_idx_ptr: Tensor, num_scheduled_tokens_ptr: Tensor,
    num_computed_tokens_ptr: Tensor, num_draft_tokens_ptr: Tensor, block_table_ptrs_ptr: Tensor,
    block_table_stride_req: int, state_base_addrs_ptr: Tensor, state_block_strides_ptr: Tensor,
    state_elem_sizes_ptr: Tensor, state_inner_sizes_ptr: Tensor, state_conv_widths_ptr: Tensor,
    state_group_indices_ptr: Tensor, state_dim_row_count_ptr: Tensor, state_dim_row_stride_ptr: Tensor,
    num_accepted_tokens_out_ptr: Tensor, idx_mapping_ptr: Tensor | None, num_reqs: int, block_size: int,
    COPY_BLOCK_SIZE: int | None = None, CONV_STATE_DIM_FIRST: bool = False, HAS_IDX_MAPPING: bool = False,
    PRECOMPUTED_NEW_COMPUTED: bool = False, TEMPORAL_TILES: int = 1,
) -> None:
    """After a step: copy each request's accepted state to the block-aligned column when the
    accepted tokens reach a block boundary (the prefix cache's snapshot), and reset the
    accepted count to 1 where the state stays in its block column."""
    layout = _Layout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                     state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                     state_dim_row_count_ptr, state_dim_row_stride_ptr, CONV_STATE_DIM_FIRST)
    accepted = _ints(num_accepted_tokens_ptr)
    state_idx = _ints(mamba_state_idx_ptr)
    computed = _ints(num_computed_tokens_ptr)
    scheduled, drafts = _ints(num_scheduled_tokens_ptr), _ints(num_draft_tokens_ptr)
    mapping = _ints(idx_mapping_ptr) if HAS_IDX_MAPPING else None
    for batch in range(int(num_reqs)):
        req = mapping[batch] if mapping is not None else batch
        if req < 0:
            continue
        a, src = accepted[req], state_idx[req]
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[req]
            running = new_computed - a + 1
        else:
            running = computed[req] + scheduled[req] - drafts[req]
            new_computed = running + a - 1
        aligned = new_computed // block_size * block_size
        if aligned < running:
            continue
        bias = aligned - running
        dst = aligned // block_size - 1
        if src == dst:
            num_accepted_tokens_out_ptr[req] = 1
            if bias == 0:
                continue
        for s in range(layout.num_states):
            layout.copy(s, req, src, dst, bias)


def precopy_mamba_align_fused(
    mamba_state_idx_ptr: Tensor, src_col_ptr: Tensor, token_bias_ptr: Tensor, block_table_ptrs_ptr: Tensor,
    block_table_stride_req: int, state_base_addrs_ptr: Tensor, state_block_strides_ptr: Tensor,
    state_elem_sizes_ptr: Tensor, state_inner_sizes_ptr: Tensor, state_conv_widths_ptr: Tensor,
    state_group_indices_ptr: Tensor, state_dim_row_count_ptr: Tensor, state_dim_row_stride_ptr: Tensor,
    idx_mapping_ptr: Tensor | None, num_reqs: int, COPY_BLOCK_SIZE: int | None = None,
    CONV_STATE_DIM_FIRST: bool = False, HAS_IDX_MAPPING: bool = True, TEMPORAL_TILES: int = 1,
) -> None:
    """Before a step: move each request's running state from its previous block column into
    the new one when the step crosses a block boundary (nothing for fresh requests)."""
    layout = _Layout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                     state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                     state_dim_row_count_ptr, state_dim_row_stride_ptr, CONV_STATE_DIM_FIRST)
    dst_cols, src_cols, biases = _ints(mamba_state_idx_ptr), _ints(src_col_ptr), _ints(token_bias_ptr)
    mapping = _ints(idx_mapping_ptr) if HAS_IDX_MAPPING else None
    for batch in range(int(num_reqs)):
        req = mapping[batch] if mapping is not None else batch
        if req < 0:
            continue
        src, dst = src_cols[req], dst_cols[req]
        if src < 0 or src == dst:
            continue
        for s in range(layout.num_states):
            layout.copy(s, req, src, dst, biases[req])


_registered = False


def register() -> None:
    """Install both stand-ins on CPU only (CUDA keeps Triton's); idempotent.

    They are bound where vLLM launches them, ``vllm.v1.worker.mamba_utils`` (nothing else in
    vLLM 0.32 imports either kernel), wrapped in the dispatcher's ``KernelOverride`` so the
    ``kernel[grid](...)`` launches reach them. ``register_kernels`` itself is not used: its
    scan of every loaded module fails once the model's modules are loaded (an object whose
    ``vars()`` is not a dict, ``_lib_fn_wrapper``), which is when the model knows it needs
    them."""
    global _registered
    if _registered:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.worker import mamba_utils

    for name, impl in ((POSTPROCESS, postprocess_mamba_fused), (PRECOPY, precopy_mamba_align_fused)):
        attr = name.rsplit(".", 1)[1]
        original = getattr(mamba_utils, attr)
        if not isinstance(original, KernelOverride):
            setattr(mamba_utils, attr, KernelOverride(original, impl))
    _registered = True
