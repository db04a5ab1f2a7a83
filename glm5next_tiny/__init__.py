"""Generate a tiny GLM-5.3-Flash-architecture checkpoint (random weights, real names).

No GLM weights can be downloaded here, so tests and demos use a checkpoint this package
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
shipped as ``glm5next_tiny/tiny_mtp_seed3.safetensors`` (:func:`trained_mtp_state`,
``validation/train_tiny_mtp.py``); every other checkpoint gets one derived from its target
(:func:`mtp_state`). The target's tensors are the same either way.

The vision tower's tensors are random too (the merger's output scaled so image embeddings
are about as large as token embeddings), and ``preprocessor_config.json`` configures
transformers' PIL image processor with small token bounds (:func:`image_processor`); the chat
template renders an image part as ``<|begin_of_image|><|image|><|end_of_image|>``.

A developer and test tool, not part of the served product: nothing in ``glm5next_plugin``,
``connector`` or ``cache_server`` imports it. Modules, one concept each:

- :mod:`glm5next_tiny.tokenizer`: the special tokens, the chat template, the BPE tokenizer;
- :mod:`glm5next_tiny.config`: the ``Glm5NextConfig`` at toy sizes and the image processor;
- :mod:`glm5next_tiny.weights`: the target's random weights;
- :mod:`glm5next_tiny.mtp_layer`: the MTP layer, derived from the target or the shipped trained one;
- :mod:`glm5next_tiny.checkpoint`: writing a checkpoint, and the stamped default one;
- :mod:`glm5next_tiny.cli`: the ``glm5next-tiny`` command.

CLI::

    glm5next-tiny OUT_DIR [--seed 0] [--dtype float32] [--hidden-size 64] ...
"""

from __future__ import annotations

from .checkpoint import STAMP, ensure_checkpoint, write_checkpoint
from .cli import main
from .config import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, build_config, image_processor
from .mtp_layer import (
    MTP_BLOCK_SCALE,
    MTP_HIDDEN_SCALE,
    TRAINED_MTP,
    TRAINED_MTP_GLOB,
    mtp_state,
    target_digest,
    trained_mtp_files,
    trained_mtp_path,
    trained_mtp_state,
)
from .tokenizer import CHAT_TEMPLATE, IMAGE_PART, SPECIAL_TOKENS, build_tokenizer
from .weights import VISION_MERGER_GAIN, random_state

__all__ = [
    "CHAT_TEMPLATE",
    "IMAGE_PART",
    "MAX_IMAGE_TOKENS",
    "MIN_IMAGE_TOKENS",
    "MTP_BLOCK_SCALE",
    "MTP_HIDDEN_SCALE",
    "SPECIAL_TOKENS",
    "STAMP",
    "TRAINED_MTP",
    "TRAINED_MTP_GLOB",
    "VISION_MERGER_GAIN",
    "build_config",
    "build_tokenizer",
    "ensure_checkpoint",
    "image_processor",
    "main",
    "mtp_state",
    "random_state",
    "target_digest",
    "trained_mtp_files",
    "trained_mtp_path",
    "trained_mtp_state",
    "write_checkpoint",
]
