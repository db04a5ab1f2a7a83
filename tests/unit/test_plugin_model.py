"""The plugin's PyTorch model against the transformers reference, without vLLM."""

from __future__ import annotations

import pytest
import torch

from glm5next_plugin import kda, sparse_mla
from glm5next_plugin.model import check_supported
from glm5next_plugin.standalone import StandaloneLM as _Standalone
from glm5next_plugin.standalone import load_standalone
from glm5next_plugin.weight_loading import cast_for_inference, load_by_name

# fp32 on both sides; the residual difference is summation order over 5 layers with
# unit-scale random weights and 20 Sinkhorn iterations per mHC.
FP32_LOGPROB_TOL = 2e-3
# bf16: on a random-weight toy model, bf16 rounding flips discrete choices (MoE experts,
# indexer top-k) in *both* implementations, so per-position maxima are large even for
# transformers-bf16 vs transformers-fp32 (up to ~14 nats). What is stated instead: our
# bf16 log-probs are, on average over positions and vocabulary, no further from the fp32
# reference than transformers' own bf16 run is (factor BF16_MEAN_RATIO).
BF16_MEAN_RATIO = 2.0


def _kda_inputs(t: int, h: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = kda.l2_normalize(torch.randn(t, h, d, generator=g)) * d**-0.5
    k = kda.l2_normalize(torch.randn(t, h, d, generator=g))
    v = torch.randn(t, h, d, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, d, generator=g))
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    state = torch.randn(h, d, d, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("t_len,chunk", [(1, 32), (31, 32), (70, 32), (130, 64)])
def test_kda_chunked_prefill_matches_reference_recurrence(t_len, chunk):
    q, k, v, g, beta, s0 = _kda_inputs(t_len)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, s0)
    out, state = kda.kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-5)


def test_kda_decode_steps_continue_a_chunked_prefill_exactly():
    q, k, v, g, beta, s0 = _kda_inputs(40, seed=3)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, s0)
    out, state = kda.kda_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], s0)
    outs = [out]
    for t in range(37, 40):
        o, st = kda.kda_decode_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state[None])
        state = st[0]
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-5)


def test_kda_reference_matches_transformers_recurrence():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    q, k, v, g, beta, s0 = _kda_inputs(20, seed=5)
    ours, ours_state = kda.kda_reference(q, k, v, g, beta, s0)
    # transformers: unscaled q, state [B, H, K, V]
    theirs, theirs_state = hf.recurrent_kimi_delta_attention(
        (q / 16**-0.5)[None], k[None], v[None], g[None], beta[None], s0.transpose(-1, -2)[None], True
    )
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, theirs_state[0].transpose(-1, -2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_forget_gate_matches_transformers_safe_and_softplus_variants(lower_bound):
    from types import SimpleNamespace

    from transformers.models.glm5_next import modeling_glm5_next as hf

    cfg = SimpleNamespace(linear_head_dim=8, linear_num_heads=3, hidden_size=16, linear_lower_bound=lower_bound)
    theirs = hf.Glm5NextTextForgetGate(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(1, 5, 16, generator=g)
    raw = theirs.f_b_proj(theirs.f_a_proj(x[0])).view(5, 3, 8)
    if lower_bound is None:
        ours = kda.softplus_gate(raw, theirs.dt_bias, theirs.A_log)
    else:
        ours = kda.safe_gate(raw, theirs.dt_bias, theirs.A_log, lower_bound)
    torch.testing.assert_close(ours, theirs(x)[0].detach())


def test_select_tokens_is_causal_below_budget_and_sparse_above():
    g = torch.Generator().manual_seed(0)
    kpool, topk, s = 4, 8, 40
    keys, gates = torch.randn(s, 8, generator=g), torch.randn(s, 8, generator=g)
    pooled = sparse_mla.pool_keys(keys, gates, torch.randn(kpool, 8, generator=g))
    assert pooled.shape == (10, 8)
    positions = torch.arange(s)
    mask = sparse_mla.select_tokens(
        torch.randn(s, 2, 8, generator=g), torch.randn(s, 2, generator=g), pooled, positions, s, kpool, topk
    )
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    assert not (mask & ~causal).any()
    # up to 2 complete visible pools + tail: everything causal is kept
    assert torch.equal(mask[:11], causal[:11])
    # later queries keep exactly 2 pools (8 tokens) plus their tail
    for i in range(11, s):
        assert mask[i].sum().item() == topk + (i + 1) % kpool
        if (i + 1) % kpool:  # own incomplete pool: always attended
            assert mask[i, i - (i + 1) % kpool + 1 : i + 1].all()


def test_tied_pool_scores_pick_the_lower_pool_index_whatever_the_step_split():
    """Exact ties (all indexer heads ReLU'd to 0) resolve to the lower pool index, so a
    query picks the same pools whether later pools are in the tensor (one-shot prefill,
    masked as not yet visible) or not (chunked prefill, resumed from a checkpoint)."""
    scores = torch.tensor([[0.0, 0.5, 0.0, 0.0, -0.3, 0.0]])
    assert sparse_mla.top_pools(scores, 3).tolist() == [[1, 0, 2]]
    hidden = torch.finfo(torch.float32).min
    wider = torch.cat([scores, torch.full((1, 40), hidden)], dim=1)
    assert sparse_mla.top_pools(wider, 3).tolist() == [[1, 0, 2]]
    # the whole mask: 2 indexer heads, signed weights, every dot product negative => all
    # scores tie at 0; one query at position 47 sees pools 0-2 of a longer sequence
    kpool, topk, dk = 4, 8, 8
    pooled = torch.ones(12, dk)
    q = -torch.ones(1, 2, dk)
    w = torch.tensor([[1.0, -1.0]])
    short = sparse_mla.select_tokens(q, w, pooled[:3], torch.tensor([13]), 14, kpool, topk)
    long = sparse_mla.select_tokens(q, w, pooled, torch.tensor([13]), 48, kpool, topk)
    assert torch.equal(long[:, :14], short) and not long[:, 14:].any()
    assert short[0, :8].all() and not short[0, 8:12].any()  # pools 0 and 1, not 2


TINY_CHECKPOINT_ARGS = ("--seed", "2")  # the ckpt fixture's (conftest.py)


@pytest.fixture(scope="module")
def both_models(ckpt):
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return load_standalone(ckpt), ref


@pytest.mark.parametrize("t_len", [20, 150, 700])
def test_standalone_model_logprobs_match_transformers(both_models, t_len):
    ours, ref = both_models
    ids = torch.randint(16, 512, (t_len,), generator=torch.Generator().manual_seed(t_len))
    with torch.no_grad():
        a = ours.logprobs(ids)
        b = ref(input_ids=ids[None]).logits[0].log_softmax(-1)
    assert (a - b).abs().max().item() < FP32_LOGPROB_TOL


@pytest.mark.parametrize("t_len", [150, 700])
def test_bf16_logprobs_stay_as_close_to_fp32_reference_as_transformers_bf16(ckpt, both_models, t_len):
    import copy

    from transformers import Glm5NextForConditionalGeneration

    ours32, ref32 = both_models
    ours = cast_for_inference(copy.deepcopy(ours32), torch.bfloat16)
    ref16 = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    ids = torch.randint(16, 512, (t_len,), generator=torch.Generator().manual_seed(t_len))
    with torch.no_grad():
        exact = ref32(input_ids=ids[None]).logits[0].log_softmax(-1)
        ours_err = (ours.logprobs(ids).float() - exact).abs().mean().item()
        ref_err = (ref16(input_ids=ids[None]).logits[0].float().log_softmax(-1) - exact).abs().mean().item()
    assert ours_err < BF16_MEAN_RATIO * ref_err + 0.02


def test_weight_loading_names_missing_and_unexpected_tensors(ckpt):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    n = cfg.text_config.num_hidden_layers
    weights = load_file(str(ckpt / "model.safetensors"))
    missing_name = "model.language_model.layers.0.self_attn.forget_gate.A_log"
    partial = {k: v for k, v in weights.items() if k != missing_name}
    with pytest.raises(ValueError, match="missing.*forget_gate.A_log"):
        load_by_name(_Standalone(cfg.text_config), partial.items(), n)
    extra = dict(weights)
    extra["model.language_model.layers.0.self_attn.q_conv1d.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected.*q_conv1d"):
        load_by_name(_Standalone(cfg.text_config), extra.items(), n)


def _on_disk_spelling(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny checkpoint re-spelled the way published GLM checkpoints store tensors."""
    out = {}
    for name, t in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        elif name.endswith("self_attn.conv1d.weight"):
            prefix = name[: -len(".conv1d.weight")]
            for c, part in zip("qkv", t.squeeze(1).chunk(3, dim=0)):
                out[f"{prefix}.{c}_conv1d.weight"] = part.clone()
        else:
            name = name.replace("self_attn.forget_gate.", "self_attn.")
            for block in ("attn", "ffn"):
                for leaf in ("fn", "base", "scale"):
                    name = name.replace(f"{block}_hc.{leaf}", f"hc_{block}_{leaf}")
            out[name] = t
    return out


def test_on_disk_glm_tensor_names_load_to_the_same_parameters(ckpt):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt).text_config
    weights = load_file(str(ckpt / "model.safetensors"))
    disk = _on_disk_spelling(weights)
    assert "model.language_model.layers.1.mlp.experts.7.up_proj.weight" in disk
    assert "model.language_model.layers.0.hc_attn_fn" in disk
    a, b = _Standalone(cfg), _Standalone(cfg)
    load_by_name(a, weights.items(), cfg.num_hidden_layers, cfg.n_routed_experts)
    load_by_name(b, disk.items(), cfg.num_hidden_layers, cfg.n_routed_experts)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # an expert piece missing is named
    del disk["model.language_model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match="incomplete fused tensors.*layers.1.mlp.experts"):
        load_by_name(_Standalone(cfg), disk.items(), cfg.num_hidden_layers, cfg.n_routed_experts)


def test_quantized_checkpoints_are_refused_clearly(ckpt):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(NotImplementedError, match="fp8"):
        check_supported(cfg)


def test_tied_word_embeddings_match_transformers(ckpt, tmp_path):
    """A checkpoint with ``tie_word_embeddings=True`` and no ``lm_head.weight``: the plugin's
    lm_head is the embedding matrix, as in transformers (log-probs within tolerance)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    from glm5next_plugin.model import ties_word_embeddings

    tied = tmp_path / "tied"
    shutil.copytree(ckpt, tied)
    weights = load_file(str(tied / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    cfg = AutoConfig.from_pretrained(tied)
    cfg.tie_word_embeddings = True
    cfg.save_pretrained(tied)
    cfg = AutoConfig.from_pretrained(tied)
    assert ties_word_embeddings(cfg)
    ours = _Standalone(cfg.text_config, tie_word_embeddings=True)
    n = cfg.text_config.num_hidden_layers
    load_by_name(ours, weights.items(), n, tied_lm_head=True)
    # a tied checkpoint that also stores lm_head.weight loads the same way
    load_by_name(ours, {**weights, "lm_head.weight": torch.zeros(1)}.items(), n, tied_lm_head=True)
    ref = Glm5NextForConditionalGeneration.from_pretrained(tied, dtype=torch.float32).eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.language_model.embed_tokens.weight.data_ptr()
    ids = torch.randint(16, 512, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours.eval().logprobs(ids) - ref(input_ids=ids[None]).logits[0].log_softmax(-1)).abs().max()
    assert diff < FP32_LOGPROB_TOL
    # untied loading of the same tensors names the missing lm_head
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        load_by_name(_Standalone(cfg.text_config), weights.items(), n)


def test_flat_text_only_names_load_to_the_same_parameters(ckpt):
    """``Glm5NextForCausalLM`` checkpoints spell tensors ``model.layers.*`` (vLLM's native
    flat layout); they map onto the same modules as the nested ``model.language_model.*``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from glm5next_plugin.model import nest_flat_names

    cfg = AutoConfig.from_pretrained(ckpt).text_config
    weights = load_file(str(ckpt / "model.safetensors"))
    flat = {k.replace("model.language_model.", "model."): v for k, v in weights.items()}
    assert "model.layers.0.input_layernorm.weight" in flat and "model.embed_tokens.weight" in flat
    a, b = _Standalone(cfg), _Standalone(cfg)
    load_by_name(a, weights.items(), cfg.num_hidden_layers)
    load_by_name(b, nest_flat_names(flat.items()), cfg.num_hidden_layers)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
