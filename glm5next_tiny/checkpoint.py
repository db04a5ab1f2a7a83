"""Writing a tiny checkpoint (:func:`write_checkpoint`), and the default one the demo, the
notebooks and the benchmarks share, rewritten when the generator changed
(:func:`ensure_checkpoint`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import mtp_layer
from .config import build_config, image_processor
from .tokenizer import CHAT_TEMPLATE, build_tokenizer
from .weights import random_state

STAMP = ".tiny_checkpoint"  # in the checkpoint: the digest of the code that wrote it


def _code_digest() -> str:
    """The bytes of this package's modules and of the trained MTP layers': a change to any
    rewrites the default checkpoint."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for path in mtp_layer.trained_mtp_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def ensure_checkpoint(out_dir: str | Path, log: Callable[[str], object] = print) -> Path:
    """The default tiny checkpoint at ``out_dir`` (the demo's, the notebooks', the
    benchmarks'): written when missing, and written again when this package changed since
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

    The MTP layer is the trained one (:func:`glm5next_tiny.mtp_layer.trained_mtp_state`) where it was trained on
    this target and ``trained_mtp`` is set, otherwise derived (:func:`glm5next_tiny.mtp_layer.mtp_state`)."""
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
    state = random_state(skeleton, seed)
    state = {k: v.to(torch_dtype) for k, v in state.items()}
    # fp32-only tensors in the reference (kept in fp32 by transformers on load too).
    for name in state:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("e_score_correction_bias", "A_log", "dt_bias") or "conv1d" in name:
            state[name] = state[name].float()
    # after the target's tensors and from them: the target's bytes do not depend on it
    trained = mtp_layer.trained_mtp_state(state, config.text_config) if trained_mtp else None
    state.update(trained if trained is not None else mtp_layer.mtp_state(state, config.text_config))
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
