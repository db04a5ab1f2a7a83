"""Speculative decoding in the plugin's KDA layer and the CPU state-copy kernels.

- A verify step (a sequence's last token plus its drafts) reads the state the previous step
  left at the accepted position and writes the state after each of its tokens to that
  token's slot: whatever count the sampler accepts, the next step continues exactly as if
  only the accepted tokens had ever been run (checked against one sequential pass).
- The CPU stand-ins for vLLM's Triton state-copy kernels (``mamba_cpu``) move conv windows
  and recurrent states with the kernels' semantics: conv ``state[src][bias:] ->
  state[dst][:width - bias]``, recurrent ``state[bt[src + bias]] -> state[bt[dst]]``.
- The engine test (ngram drafts give the tokens of drafts off) shares ``test_plugin_mtp``'s
  drafts-off engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm5next_plugin import mamba_cpu
from glm5next_plugin.kda_layer import KDAStateLayer
from glm5next_plugin.tp import TP1

H, D, W, K = 2, 8, 4, 3  # heads, head dim, conv width, draft tokens


def _layer(seed: int = 0) -> KDAStateLayer:
    cfg = SimpleNamespace(linear_num_heads=H, linear_head_dim=D, hidden_size=32, linear_conv_kernel_dim=W,
                          linear_lower_bound=-5.0, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = KDAStateLayer(cfg, None, "probe", tp=TP1).float().requires_grad_(False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    slots = 8
    layer.kv_cache = (torch.zeros(slots, W - 1 + K, 3 * H * D), torch.zeros(slots, H, D, D))
    return layer


def _spec_md(slots: list[list[int]], accepted: list[int], lens: list[int]) -> SimpleNamespace:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return SimpleNamespace(num_spec_decodes=len(lens), spec_query_start_loc=torch.tensor(qsl),
                           spec_state_indices_tensor=torch.tensor(slots), num_accepted_tokens=torch.tensor(accepted),
                           num_prefills=0, num_decodes=0, spec_sequence_masks=torch.ones(len(lens), dtype=torch.bool))


def _prefill(layer: KDAStateLayer, x: torch.Tensor, slot: int) -> torch.Tensor:
    md = SimpleNamespace(non_spec_query_start_loc=torch.tensor([0, x.shape[0]]),
                         non_spec_state_indices_tensor=torch.tensor([slot]), has_initial_state=torch.tensor([False]),
                         num_decodes=0, num_prefills=1)
    return layer._forward_plain(x, md)


@pytest.mark.parametrize("accept", [[1, 1], [2, 1], [4, 3], [3, 4]])
def test_verify_steps_continue_from_the_accepted_draft(accept):
    """Two verify steps of K+1 tokens after a prefill. After step 1 accepts ``a`` tokens,
    step 2 (K+1 new tokens) must give the outputs one sequential pass gives over
    prompt + the ``a`` accepted tokens + step 2's tokens, for every a in 1..K+1."""
    layer = _layer()
    torch.manual_seed(1)
    prompt, step1, step2 = torch.randn(9, 32), torch.randn(K + 1, 32), torch.randn(K + 1, 32)
    slots = [1, 2, 3, 4]  # this sequence's K+1 state slots (column 0 holds the conv window)
    _prefill(layer, prompt, slots[0])
    out1 = torch.zeros(K + 1, 32)
    layer._forward_spec(step1, None, _spec_md([slots], [1], [K + 1]), out1)
    a1, a2 = accept
    out2 = torch.zeros(K + 1, 32)
    layer._forward_spec(step2, None, _spec_md([slots], [a1], [K + 1]), out2)

    ref = _layer()
    ref.kv_cache = tuple(torch.zeros_like(t) for t in layer.kv_cache)
    y = _prefill(ref, torch.cat([prompt, step1[:a1], step2]), 5)
    torch.testing.assert_close(out1, _prefill(_layer(), torch.cat([prompt, step1]), 5)[9:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out2, y[9 + a1:], rtol=1e-4, atol=1e-5)
    # the state after step 2's a2-th token is in slot a2 - 1: the next step starts there
    _, _, rec = ref.forward_sequence(torch.cat([prompt, step1[:a1], step2[:a2]]))
    torch.testing.assert_close(layer.kv_cache[1][slots[a2 - 1]], rec, rtol=1e-4, atol=1e-5)


def test_verify_rows_interleaved_with_prefill_rows_go_to_their_own_paths():
    """A batch with one prefill chunk and one verify step (vLLM's token indices pick each
    kind's rows) gives each the outputs it gets alone."""
    layer = _layer()
    torch.manual_seed(2)
    prompt_a, prompt_b, verify = torch.randn(6, 32), torch.randn(5, 32), torch.randn(K + 1, 32)
    _prefill(layer, prompt_a, 1)
    alone = torch.zeros(K + 1, 32)
    snapshot = tuple(t.clone() for t in layer.kv_cache)
    layer._forward_spec(verify, None, _spec_md([[1, 2, 3, 4]], [1], [K + 1]), alone)
    layer.kv_cache = snapshot
    x = torch.cat([verify, prompt_b])
    md = _spec_md([[1, 2, 3, 4]], [1], [K + 1])
    md.num_prefills = 1
    md.spec_token_indx = torch.arange(K + 1)
    md.non_spec_token_indx = torch.arange(K + 1, K + 6)
    md.non_spec_query_start_loc = torch.tensor([0, 5])
    md.non_spec_state_indices_tensor = torch.tensor([6])
    md.has_initial_state = torch.tensor([False])
    md.num_actual_tokens = x.shape[0]
    out = torch.zeros_like(x)
    from glm5next_plugin.kda_layer import _token_rows

    spec_rows, plain_rows = _token_rows(md, x.device)
    layer._forward_spec(x, spec_rows, md, out)
    out[plain_rows] = layer._forward_plain(x[plain_rows], md)
    torch.testing.assert_close(out[: K + 1], alone)
    torch.testing.assert_close(out[K + 1 :], _prefill(_layer(), prompt_b, 7))


def _copy_layout(conv: torch.Tensor, rec: torch.Tensor, table: torch.Tensor) -> dict:
    """The metadata vLLM's ``MambaSpecDecodeGPUContext`` builds, for one layer (SD conv)."""
    return dict(
        block_table_ptrs_ptr=torch.tensor([table.data_ptr()]), block_table_stride_req=table.stride(0),
        state_base_addrs_ptr=torch.tensor([conv.data_ptr(), rec.data_ptr()]),
        state_block_strides_ptr=torch.tensor([conv.stride(0) * 4, rec.stride(0) * 4]),
        state_elem_sizes_ptr=torch.tensor([4, 4]), state_inner_sizes_ptr=torch.tensor([conv.stride(1), rec[0].numel()]),
        state_conv_widths_ptr=torch.tensor([conv.shape[1], 0]), state_group_indices_ptr=torch.tensor([0, 0]),
        state_dim_row_count_ptr=torch.tensor([0, 0]), state_dim_row_stride_ptr=torch.tensor([0, 0]),
    )


def test_cpu_precopy_shifts_the_conv_window_and_takes_the_accepted_recurrent_state():
    conv = torch.arange(10 * 6 * 3, dtype=torch.float32).view(10, 6, 3)
    rec = torch.arange(10 * 2 * 2, dtype=torch.float32).view(10, 2, 2)
    table = torch.tensor([[4, 5, 6, 7, 8, 9], [1, 2, 3, 0, 0, 0]], dtype=torch.int32)
    before_conv, before_rec = conv.clone(), rec.clone()
    mamba_cpu.precopy_mamba_align_fused(
        mamba_state_idx_ptr=torch.tensor([3, 1]), src_col_ptr=torch.tensor([0, 1]), token_bias_ptr=torch.tensor([2, 0]),
        idx_mapping_ptr=None, num_reqs=2, HAS_IDX_MAPPING=False, **_copy_layout(conv, rec, table))
    # request 0: src col 0 (block 4), bias 2 -> dst col 3 (block 7)
    torch.testing.assert_close(conv[7, :4], before_conv[4, 2:])
    torch.testing.assert_close(conv[7, 4:], before_conv[7, 4:])
    torch.testing.assert_close(rec[7], before_rec[6])  # bt[src + bias] = bt[2] = block 6
    # request 1: src == dst, nothing moves
    torch.testing.assert_close(conv[1:4], before_conv[1:4])
    torch.testing.assert_close(rec[1:4], before_rec[1:4])


def test_cpu_postprocess_snapshots_at_the_block_boundary_the_accepted_tokens_reach():
    """Block size 4; request 0 had 6 computed, 3 scheduled (2 drafts), accepted 3: the running
    state covers 7 tokens, the accepted ones reach 9, so the state at token 8 (accepted bias
    1) goes to column 1; request 1 lands exactly on its own block's end (column 0, no
    bias): nothing moves, only its accepted count resets to 1."""
    conv = torch.arange(10 * 5 * 2, dtype=torch.float32).view(10, 5, 2)
    rec = torch.arange(10 * 2 * 2, dtype=torch.float32).view(10, 2, 2)
    table = torch.tensor([[4, 5, 6, 7], [1, 2, 3, 0]], dtype=torch.int32)
    before_conv, before_rec = conv.clone(), rec.clone()
    out = torch.tensor([3, 9])  # vLLM starts it from the accepted counts; 9 shows the write
    mamba_cpu.postprocess_mamba_fused(
        num_accepted_tokens_ptr=torch.tensor([3, 1]), mamba_state_idx_ptr=torch.tensor([2, 0]),
        num_scheduled_tokens_ptr=torch.tensor([3, 1]), num_computed_tokens_ptr=torch.tensor([6, 3]),
        num_draft_tokens_ptr=torch.tensor([2, 0]), num_accepted_tokens_out_ptr=out, idx_mapping_ptr=None,
        num_reqs=2, block_size=4, **_copy_layout(conv, rec, table))
    torch.testing.assert_close(conv[5, :4], before_conv[6, 1:])
    torch.testing.assert_close(rec[5], before_rec[7])  # bt[src 2 + bias 1]
    assert out.tolist() == [3, 1]
    torch.testing.assert_close(conv[1:4], before_conv[1:4])
    torch.testing.assert_close(rec[1:4], before_rec[1:4])
