"""The generated tiny checkpoint: real GLM-5.3-Flash structure, names and tokenizer."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

TINY_CHECKPOINT_ARGS = ("--seed", "1")  # the ckpt fixture's (conftest.py)


def test_config_declares_glm5next_architecture_and_layer_mix(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert cfg["model_type"] == "glm5_next"
    text = cfg["text_config"]
    assert text["layer_types"].count("linear_attention") >= 3
    assert text["layer_types"].count("indexed_attention") >= 2
    assert "sparse" in text["mlp_layer_types"] and "dense" in text["mlp_layer_types"]
    # a 2k-token prompt must take the sparse path
    assert text["index_topk"] + text["index_kpool"] < 2048
    assert text["index_topk"] % text["index_kpool"] == 0


def test_safetensors_use_the_transformers_tensor_names(ckpt):
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # the MTP layer follows the target's layers (transformers has no module for it)
    mtp = f"model.language_model.layers.{config.text_config.num_hidden_layers}."
    assert {k: v for k, v in got.items() if not k.startswith(mtp)} == expected
    assert got[mtp + "eh_proj.weight"] == (64, 128) and got[mtp + "shared_head.norm.weight"] == (64,)
    # fused expert tensors, as transformers names them
    experts = "model.language_model.layers.1.mlp.experts."
    n_exp, hidden, inter = 8, 64, 32
    assert got[experts + "gate_up_proj"] == (n_exp, 2 * inter, hidden)
    assert got[experts + "down_proj"] == (n_exp, hidden, inter)
    assert "model.language_model.layers.0.self_attn.forget_gate.A_log" in got
    assert "model.language_model.layers.2.self_attn.indexer.index_kpool_compress_ape" in got


def test_tokenizer_loads_and_renders_the_chat_template(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == 512
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "[gMASK]<sop><|user|>\nhello world<|assistant|>\n"
    ids = tok("the cache state resumes at a block boundary")["input_ids"]
    assert tok.decode(ids) == "the cache state resumes at a block boundary"
    assert len(ids) < 20  # trained merges, not bytes


def test_reference_model_loads_without_missing_tensors_and_runs(ckpt):
    from transformers import Glm5NextForConditionalGeneration

    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"]
    # only the MTP layer's tensors, which transformers does not run (it ignores shared_head)
    assert info["unexpected_keys"] and all(k.startswith("model.language_model.layers.5.") for k in info["unexpected_keys"])
    ids = torch.randint(16, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 64, 512)
    assert torch.isfinite(logits).all()
    # random weights are scaled so the next-token distribution is far from uniform
    assert logits.log_softmax(-1).max(-1).values.mean() > -3.0
