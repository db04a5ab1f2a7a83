"""Generate a tiny GLM-5.3-Flash-architecture checkpoint (random weights, real names).

No GLM weights can be downloaded here, so tests and demos use a checkpoint this module
writes: ``config.json`` from transformers' ``Glm5NextConfig`` (architecture
``Glm5NextForConditionalGeneration``), ``model.safetensors`` with random weights under the
tensor names the transformers model uses (fused expert tensors included), and a small
byte-level BPE tokenizer trained offline with ``tokenizers``, with a GLM-style chat
template, so ``AutoTokenizer``, ``vllm serve`` and chat requests work.

The defaults keep it small enough for a 2-core CPU while exercising every path:
3 KDA + 2 sparse-MLA layers, MoE layers, pools of 4 tokens per indexer slot as in the
served GLM-5.3-Flash checkpoint (``index_kpool`` 4), and ``index_topk`` small enough that
prompts longer than 131 tokens take the sparse top-k path (a query keeps 32 pools).

One multi-token-prediction (MTP) layer follows the target layers, as in GLM-5.3-Flash
(``num_nextn_predict_layers`` 1, tensors ``model.language_model.layers.{N}.*`` with ``N =
num_hidden_layers``), so ``--speculative-config '{"method":"mtp",...}'`` has a draft to run.
transformers has no MTP module and reports those tensors as unexpected on load (its ignore
list names the served checkpoint's layer 45 only). Random MTP weights would propose almost
no token the target accepts. The default seed-3 checkpoint (the tests' and
``validation/bench_drafts.py``'s) gets a layer trained on its target's own greedy outputs,
shipped as ``tiny_mtp_seed3.safetensors`` (:func:`trained_mtp_state`,
``validation/train_tiny_mtp.py``); every other checkpoint gets one derived from its target
(:func:`mtp_state`). The target's tensors are the same either way.

The vision tower's tensors are random too (the merger's output scaled so image embeddings
are about as large as token embeddings), and ``preprocessor_config.json`` configures
transformers' PIL image processor with small token bounds (:func:`image_processor`); the chat
template renders an image part as ``<|begin_of_image|><|image|><|end_of_image|>``.

``qk_rope_head_dim`` above 0 writes a checkpoint whose MLA keys have a rope part
(transformers' ``k_rot``; GLM-5.3-Flash itself has none). transformers' attention computes
it, but its ``Glm5NextTextConfig`` validator refuses such a config ("Expecting NoPE"), so
loading that checkpoint through ``AutoConfig`` needs the check lifted, as
``validation/parity_sweep.py`` does to compare the plugin with transformers.

CLI::

    glm5next-tiny OUT_DIR [--seed 0] [--dtype float32] [--hidden-size 64] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import Glm5NextConfig, Glm5NextImageProcessorPil, PretrainedConfig, PreTrainedTokenizerFast

# Tokens with a fixed meaning in the GLM chat format, plus the multimodal markers the
# config refers to (kept inside the small vocabulary so every config id is valid).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|pad|>",
]

# One image part ({"type": "image"} / {"type": "image_url"}) renders as the image's markers
# around one <|image|>, which vLLM's processor expands to the image's token count
# (glm5next_plugin.multimodal); text renders as before (string content or text parts).
IMAGE_PART = "<|begin_of_image|><|image|><|end_of_image|>"
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>\n"
    # no whitespace control from here to the end of the message: the newline above stays
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}" + IMAGE_PART + ""
    "{% endif %}{% endfor %}{% endif %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{% endif -%}"
)

# What the checkpoint's image processor (transformers' Glm5NextImageProcessorPil, read from
# preprocessor_config.json) is told: GLM's patch geometry and normalisation, with small token
# bounds so images stay cheap on a CPU: a 112x112 image is 8x8 patches, 16 tokens (the
# minimum); the largest is 256 tokens (a 448x448 canvas).
MIN_IMAGE_TOKENS = 16
MAX_IMAGE_TOKENS = 256
# Gain on the vision merger's output projection, so image embeddings are about as large as
# token embeddings (std ~1) instead of ~0.27 at the plain 1/sqrt(fan_in) scale.
VISION_MERGER_GAIN = 4.0

_WORDS = (
    "the a cache state token prompt model layer block chunk server engine request reply "
    "vector latent pool index sparse dense expert router shared stream gate decay value "
    "key query memory host device prefix suffix resume snapshot boundary hash group "
    "hello world how are you today what is this please tell me about it thank yes no "
    "one two three four five six seven eight nine ten red green blue fast slow small big"
).split()


def _training_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Generated text for the tokenizer: words, numbers, punctuation and chat markup."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(3, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":"])
        lines.append(line)
    return lines


def build_tokenizer(seed: int, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline and wrap it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|pad|>")],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    dtype: str = "float32",
    hidden_size: int = 64,
    layer_types: str = "LLILI",
    dense_layers: int = 1,
    index_topk: int = 128,
    index_kpool: int = 4,
    index_n_heads: int = 16,
    index_head_dim: int = 16,
    qk_rope_head_dim: int = 0,
    linear_num_heads: int = 2,
    linear_head_dim: int = 16,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_position_embeddings: int = 8192,
    mtp_layers: int = 1,
) -> Glm5NextConfig:
    """A ``Glm5NextConfig`` with GLM-5.3-Flash's structure at toy sizes.

    ``layer_types`` is a string over ``L`` (KDA, ``linear_attention``) and ``I`` (sparse
    MLA, ``indexed_attention``); the first ``dense_layers`` layers get a dense MLP, the
    rest MoE, like the real model. ``mtp_layers`` is ``num_nextn_predict_layers``.
    """
    from transformers import Glm5NextConfig

    types = {"L": "linear_attention", "I": "indexed_attention"}
    layers = [types[c] for c in layer_types.upper()]
    n = len(layers)
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        pad_token_id=ids("<|pad|>"),
        eos_token_id=[ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")],
        mlp_layer_types=["dense"] * min(dense_layers, n) + ["sparse"] * max(n - dense_layers, 0),
        layer_types=layers,
        index_topk=index_topk,
        index_head_dim=index_head_dim,
        index_n_heads=index_n_heads,
        index_kpool=index_kpool,
        index_kpool_always_select_tail=True,
        swiglu_limit=10.0,
        linear_head_dim=linear_head_dim,
        linear_num_heads=linear_num_heads,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        hc_mult=4,
        hc_eps=1e-6,
        hc_sinkhorn_iters=20,
        num_nextn_predict_layers=mtp_layers,
        dtype=dtype,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=hidden_size,
        projection_intermediate_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Glm5NextConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image|>"),
        video_token_id=ids("<|image|>"),
        image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"),
        tie_word_embeddings=False,
    )
    config.architectures = ["Glm5NextForConditionalGeneration"]
    config.dtype = dtype
    if qk_rope_head_dim:
        _set_rope_dim(config.text_config, qk_rope_head_dim)
    return config


def _set_rope_dim(text_config: PretrainedConfig, rope_dim: int) -> None:
    """Give a validated (NoPE) text config a rope part. Class validators run only when a
    config is built, so setting the field afterwards passes; the derived fields follow as
    ``Glm5NextTextConfig.__post_init__`` would set them."""
    text_config.qk_rope_head_dim = rope_dim
    text_config.head_dim = rope_dim
    text_config.qk_head_dim = text_config.qk_nope_head_dim + rope_dim


def _random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with unit-scale activations so outputs depend on every tensor.

    transformers' own init (std 0.02) gives a nearly uniform next-token distribution on
    a toy model, which would let a broken layer pass a log-prob comparison.
    """
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        shape = tensor.shape

        def randn(std: float, mean: float = 0.0) -> torch.Tensor:
            return torch.randn(shape, generator=gen) * std + mean

        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            value = randn(1.0)
        elif name.endswith("lm_head.weight"):
            value = randn(3.0 / math.sqrt(shape[-1]))
        elif "norm" in name and leaf in ("weight",):
            value = randn(0.1, 1.0)
        elif leaf == "bias":
            value = randn(0.02)
        elif leaf == "A_log":
            value = randn(0.5)
        elif leaf == "dt_bias":
            value = randn(1.0)
        elif leaf == "e_score_correction_bias":
            value = randn(0.1)
        elif leaf == "index_kpool_compress_ape":
            value = randn(1.0)
        elif leaf == "base":  # mHC biases
            value = randn(0.5)
        elif leaf == "scale":  # mHC per-output scales
            value = randn(0.2, 1.0)
        elif leaf == "fn":  # mHC projection over hc_mult * hidden inputs
            value = randn(1.0 / math.sqrt(shape[-1]))
        elif leaf == "conv1d" or name.endswith("conv1d.weight"):
            value = randn(0.5)
        elif leaf in ("gate_up_proj", "down_proj") and tensor.dim() == 3:
            value = randn(1.0 / math.sqrt(shape[-1]))
        elif name == "model.visual.merger.down_proj.weight":
            value = randn(VISION_MERGER_GAIN / math.sqrt(shape[-1]))
        elif tensor.dim() >= 2:
            fan_in = math.prod(shape[1:])
            value = randn(1.0 / math.sqrt(fan_in))
        else:
            value = randn(0.1, 1.0 if "norm" in name else 0.0)
        state[name] = value.to(tensor.dtype).contiguous()
    return state


# How the derived MTP layer mixes its inputs and blocks (see mtp_state): measured on the seed-3
# checkpoint, these give the most accepted drafts among the settings tried while the draft
# still depends on the target's hidden state, the attention and the MLP (each changes the
# drafted token at 13-35% of positions).
MTP_HIDDEN_SCALE = 0.1
MTP_BLOCK_SCALE = 0.2


def mtp_state(state: dict[str, torch.Tensor], text_config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors ``model.language_model.layers.{N + i}.*``, derived from the
    target's ``state`` so that drafts are accepted now and then: the layer of every
    checkpoint without a trained one (:func:`trained_mtp_state`), and the trained one's
    starting point.

    A random toy target is chaotic: its next token depends on several tokens of context,
    which one extra layer cannot learn without training. What a closed form can give is a
    draft led by the embedding of the token it reads (the one after the target's hidden
    state), with the target's hidden state, one attention and one MLP mixed in:

    - ``eh_proj`` ``[I | MTP_HIDDEN_SCALE * I]``: ``x = enorm(e) + 0.1 * hnorm(h)``;
      ``enorm``, ``hnorm`` ones;
    - ``self_attn.*`` and ``input_layernorm`` copied from the last sparse-MLA layer, MLP and
      ``post_attention_layernorm`` from the last layer (the MTP MLP has the last layer's
      type); the attention's ``o_proj`` and the MLP's down projections scaled by
      ``MTP_BLOCK_SCALE``, so the blocks shift the residual instead of replacing it;
    - ``shared_head.norm`` is the target's final norm (the head is the target's
      ``lm_head``).

    Measured on the seed-3 target (which ships a trained layer instead): 2.5-5% of first
    drafts are accepted under greedy decoding (vLLM with two drafts: 7 of 278 verify steps
    over 3 random prompts, 9 of 180 over ``validation/bench_drafts.py``'s demo chat turns,
    none at position 2) and 4% of positions agree teacher-forced; random MTP weights agree
    at chance (2 of 1020, vocab 512).
    """
    n_layers = text_config.num_hidden_layers
    n_mtp = int(getattr(text_config, "num_nextn_predict_layers", 0) or 0)
    if n_mtp == 0:
        return {}
    hidden = text_config.hidden_size
    mla = [i for i, t in enumerate(text_config.layer_types) if t == "indexed_attention"]
    if not mla:
        raise ValueError("the MTP layer copies its attention from a sparse-MLA layer and there is none "
                         "(layer types without 'I'): write the checkpoint with --mtp-layers 0")
    layers = "model.language_model.layers."
    attn_from, mlp_from = f"{layers}{mla[-1]}.", f"{layers}{n_layers - 1}."
    block = {}
    for name, t in state.items():
        if name.startswith(attn_from) and name[len(attn_from) :].startswith(("self_attn.", "input_layernorm.")):
            block[name[len(attn_from) :]] = t
        if name.startswith(mlp_from) and name[len(mlp_from) :].startswith(("mlp.", "post_attention_layernorm.")):
            block[name[len(mlp_from) :]] = t
    for name, t in block.items():
        if name.startswith("self_attn.o_proj.") or name.endswith(("down_proj", "down_proj.weight")):
            block[name] = t * MTP_BLOCK_SCALE
    final_norm = state["model.language_model.norm.weight"]
    eye = torch.eye(hidden, dtype=final_norm.dtype)
    block["enorm.weight"] = torch.ones_like(final_norm)
    block["hnorm.weight"] = torch.ones_like(final_norm)
    block["eh_proj.weight"] = torch.cat([eye, MTP_HIDDEN_SCALE * eye], dim=1)
    block["shared_head.norm.weight"] = final_norm
    out = {}
    for i in range(n_layers, n_layers + n_mtp):
        for name, t in block.items():  # copies keep their dtype (the router bias stays fp32)
            out[f"{layers}{i}.{name}"] = t.clone().contiguous()
    return out


# MTP layers trained for a checkpoint's target (validation/train_tiny_mtp.py writes them),
# one file per target: the layer's tensors under their names inside layers.{N}
# ("eh_proj.weight", ...), and in the file's metadata the digest of the target it was
# trained on (target_digest). The seed-3 checkpoint's is shipped.
TRAINED_MTP_GLOB = "tiny_mtp_seed*.safetensors"
TRAINED_MTP = Path(__file__).with_name("tiny_mtp_seed3.safetensors")


def trained_mtp_files() -> list[Path]:
    return sorted(Path(__file__).parent.glob(TRAINED_MTP_GLOB))


def target_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the target's tensors (every tensor but the MTP layers', by name: name,
    dtype, shape and bytes): what a trained MTP layer was trained against."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained_mtp_state(state: dict[str, torch.Tensor], text_config: PretrainedConfig,
                      paths: list[Path] | None = None) -> dict[str, torch.Tensor] | None:
    """The MTP layers' tensors (one copy per MTP layer) from the trained layer among
    ``paths`` (default :func:`trained_mtp_files`) whose target is ``state``'s, or None where
    none was trained on this target (another seed, size or dtype)."""
    n_mtp = int(getattr(text_config, "num_nextn_predict_layers", 0) or 0)
    paths = trained_mtp_files() if paths is None else paths
    if n_mtp == 0 or not paths:
        return None
    from safetensors import safe_open

    digest = target_digest(state)
    layer = None
    for path in paths:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("target_digest") == digest:
                layer = {name: f.get_tensor(name) for name in f.keys()}
                break
    if layer is None:
        return None
    n_layers = text_config.num_hidden_layers
    return {f"model.language_model.layers.{i}.{name}": t.clone().contiguous()
            for i in range(n_layers, n_layers + n_mtp) for name, t in layer.items()}


STAMP = ".tiny_checkpoint"  # in the checkpoint: the digest of the code that wrote it


def _code_digest() -> str:
    """This module's bytes and the trained MTP layers': a change to any rewrites the
    default checkpoint."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for path in trained_mtp_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def ensure_checkpoint(out_dir: str | Path, log: Callable[[str], object] = print) -> Path:
    """The default tiny checkpoint at ``out_dir`` (the demo's, the notebooks', the
    benchmarks'): written when missing, and written again when this module changed since
    (a checkpoint from older code lacks what newer tests and demos use, e.g. the image
    processor's config). Returns the path."""
    out = Path(out_dir)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == _code_digest():
        log(f"checkpoint: {out} (already there)")
        return out
    log(f"generating the tiny GLM-5.3-Flash checkpoint into {out} ...")
    write_checkpoint(out)
    stamp.write_text(_code_digest() + "\n")
    return out


def write_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    trained_mtp: bool = True,
    **sizes: Any,
) -> Path:
    """Write config, random weights and tokenizer to ``out_dir``; return the path.

    The MTP layer is the trained one (:func:`trained_mtp_state`) where it was trained on
    this target and ``trained_mtp`` is set, otherwise derived (:func:`mtp_state`)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Glm5NextForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = sizes.pop("vocab_size", 512)
    tokenizer = build_tokenizer(seed, vocab_size)
    config = build_config(tokenizer, dtype=dtype, **sizes)

    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        skeleton = Glm5NextForConditionalGeneration(config)
    state = _random_state(skeleton, seed)
    state = {k: v.to(torch_dtype) for k, v in state.items()}
    # fp32-only tensors in the reference (kept in fp32 by transformers on load too).
    for name in state:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("e_score_correction_bias", "A_log", "dt_bias") or "conv1d" in name:
            state[name] = state[name].float()
    # after the target's tensors and from them: the target's bytes do not depend on it
    trained = trained_mtp_state(state, config.text_config) if trained_mtp else None
    state.update(trained if trained is not None else mtp_state(state, config.text_config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor(config).save_pretrained(out)
    eos = config.text_config.eos_token_id
    GenerationConfig(eos_token_id=eos, pad_token_id=config.text_config.pad_token_id).save_pretrained(out)
    # Keep the chat template in tokenizer_config.json too: older loaders read it there.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.setdefault("chat_template", CHAT_TEMPLATE)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out


def image_processor(config: Glm5NextConfig) -> Glm5NextImageProcessorPil:
    """The checkpoint's image processor (``preprocessor_config.json``): the vision config's
    patch, temporal patch and merge sizes, CLIP mean/std, token bounds
    ``MIN_IMAGE_TOKENS``..``MAX_IMAGE_TOKENS``."""
    from transformers import Glm5NextImageProcessorPil

    vision = config.vision_config
    return Glm5NextImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        patch_expand_factor=1,
        min_image_tokens=MIN_IMAGE_TOKENS,
        max_image_tokens=MAX_IMAGE_TOKENS,
    )


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (``glm5next-tiny``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument(
        "--layer-types",
        default="LLILI",
        help="one letter per layer: L = KDA (linear_attention), I = sparse MLA (indexed_attention)",
    )
    p.add_argument("--dense-layers", type=int, default=1, help="leading layers with a dense MLP")
    p.add_argument("--index-topk", type=int, default=128)
    p.add_argument("--index-kpool", type=int, default=4, help="tokens per indexer pool (GLM-5.3-Flash: 4)")
    p.add_argument(
        "--index-n-heads",
        type=int,
        default=16,
        help="indexer heads; with few heads (2) many pools score exactly 0 (a tie-heavy checkpoint)",
    )
    p.add_argument("--index-head-dim", type=int, default=16)
    p.add_argument(
        "--qk-rope-head-dim",
        type=int,
        default=0,
        help="rope key part per MLA head (GLM-5.3-Flash: 0); transformers' config class refuses a value above 0 on "
        "load (see the module docstring)",
    )
    p.add_argument("--linear-num-heads", type=int, default=2)
    p.add_argument("--linear-head-dim", type=int, default=16)
    p.add_argument("--n-routed-experts", type=int, default=8)
    p.add_argument("--num-experts-per-tok", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=1,
        help="num_nextn_predict_layers: MTP layers after the target's (GLM-5.3-Flash: 1; 0 writes none)",
    )
    p.add_argument(
        "--derived-mtp",
        dest="trained_mtp",
        action="store_false",
        help="the MTP layer derived from the target (mtp_state) even where a trained one fits (seed 3, default sizes)",
    )
    args = vars(p.parse_args(argv))  # option names are write_checkpoint's keyword names
    path = write_checkpoint(args.pop("out_dir"), **args)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
