"""Generate a tiny random Qwen3-Next checkpoint that vLLM's CPU build runs natively.

Three Gated-DeltaNet (linear-attention, recurrent state) layers and one full-attention
layer, dense MLPs (one small MoE), bfloat16, random weights, and a small byte-level BPE tokenizer trained
here on local text. It gives the connector's end-to-end tests a hybrid model (state
groups and an attention group) that vLLM runs natively, independent of the GLM-5.3-Flash
plugin.

vLLM's CPU GDN kernel wants linear head dims of 128 and bfloat16. With two value heads
(float32 SSM state on CPU) one GDN state page is ~131 tokens of attention KV (2 KV heads
of 128), which vLLM rounds up to a 256-token block on CPUs with AVX-512; on an AVX2-only
CPU (AMD EPYC without AVX-512, measured) its CPU attention pages differ and vLLM picks a
128-token block, which with the server's 256-token minimum chunk leaves C > N (states only
where prefill steps end: no hits). Engines of this model therefore set ``block_size``
:data:`BLOCK_SIZE` (vLLM keeps a user's block size that holds the state page), so the
negotiated chunk equals the scheduler block (C == N == 256) on every x86 CPU, as in the
reference GLM deployment (1152 at TP 4).

Usage: python testing/tiny_qwen3_next.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 2048
BLOCK_SIZE = 256  # vLLM's block for this model's engines, on every CPU (see above)


def _training_text() -> list[str]:
    """Local text to train the tokenizer on: the Python standard library's sources."""
    import glob
    import os

    stdlib = os.path.dirname(os.__file__)
    texts = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py")))[:120]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
    return texts


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def make_tiny_qwen3_next(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint to ``out_dir`` (skipped when it is already there)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)
    eos_id = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]

    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        # vLLM's Qwen3-Next wants at least one MoE layer; the others stay dense.
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1, 2],
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    # A larger init spread than the default 0.02 keeps random logits from being flat,
    # so greedy continuations and log-probs actually depend on the cached state.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


if __name__ == "__main__":
    print(make_tiny_qwen3_next(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-qwen3-next"))
