"""What an object's bytes depend on beyond the cache geometry: the weights, the model's
configuration (quantization and overrides included), and the engine that computed them
(vLLM's version, the device family its kernels ran on). All of it joins the namespace
(:func:`connector.keys.engine_fingerprint`), so objects computed by other weights or
another engine are never found.

The weights are named by their content, sampled: a checkpoint replaced at the same path (a
fine-tune of the same shape, a re-pushed revision) has the same path, config, index and
safetensors headers, but other tensor bytes. For every tensor of every ``*.safetensors``
file we read :data:`SAMPLE_BYTES` bytes at its start, middle and end (three small reads a
tensor, never the tensor), and hash them with the headers and file sizes. Any training
step changes nearly every element of the tensors it touches, so a fine-tune of any tensor
is seen. What it misses: an edit confined to elements between the samples of a tensor
(a hand-patched row, an added token's embedding row away from the samples). Other weight
formats are sampled per file (:data:`FILE_SAMPLES` windows). A hub snapshot's commit is
added where the path names one.

Speculative decoding: a drafter whose layers write cache rows (EAGLE, MTP, a draft model)
joins the identity with its method, draft length, lookahead and weights (the target's, for
MTP layers shipped in its checkpoint; otherwise the draft's own, named the same way), and
its lookahead joins the chunk keys. Drafters that cache nothing (n-gram, suffix) leave the
namespace as it is without drafts; the rest is refused (:func:`check_nameable`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blake3 import blake3

if TYPE_CHECKING:
    from vllm.config import ModelConfig

SAMPLE_BYTES = 64  # per tensor, at its start, middle and end
FILE_SAMPLES = 64  # windows of SAMPLE_BYTES per weight file in a format without a tensor index
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


class Unnameable(RuntimeError):
    """Something the cached bytes depend on that the namespace cannot name: the engine
    serves without the external cache (what identity cannot name is not cached)."""


class UnnamedWeights(Unnameable):
    """The weights cannot be named (no weight files found for the model): nothing the
    engine computes may be shared."""


# How far a drafter's cache rows look past their own position (the lookahead L), by
# ``--speculative-config`` method. The hidden-state drafters (EAGLE, EAGLE-3, MTP) compute
# their row at position p from the target's hidden state at p and the embedding of token
# p + 1 (vLLM shifts the draft's input ids by one: ``SpecDecodeBaseProposer
# .set_inputs_first_pass``), and vLLM puts a draft layer whose cache spec equals the
# target's in the target's KV group, so its rows are in our attention objects. A separate
# draft model (``draft_model``) reads unshifted ids, so its prompt rows depend on tokens up
# to p only; it is given L = 1 anyway, which never shares a row wrongly (it only keeps
# prompts that fork exactly at a chunk boundary apart) and, like every drafter with rows,
# refuses decode-time saves (its decode rows are written from draft tokens).
_LOOKAHEAD_DRAFTERS = {"eagle": 1, "eagle3": 1, "mtp": 1, "draft_model": 1}
# Drafters that write nothing into the KV cache: the cached bytes are the target's alone,
# exactly as with drafts off, so neither the keys nor the namespace change.
_CACHELESS_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})
# Everything else is refused (not cached): ``custom_class`` (arbitrary proposer code),
# ``extract_hidden_states``, ``dflash`` and ``dspark`` (fill-in drafting: rows at slots
# written from mask tokens, a lookahead not analysed here), and any method vLLM adds later.


@dataclass(frozen=True)
class Drafts:
    """What the engine's speculative decoding puts into the cached bytes.

    ``lookahead`` (L) is how many tokens after its position a draft row depends on: chunk
    keys then cover the L tokens after each chunk (:class:`connector.keys.ChunkKeys`).
    ``draft_model`` is the draft's model config where its weights are not the target's
    (None: no draft model, or the target's own MTP layers)."""

    method: str | None = None
    num_speculative_tokens: int = 0
    lookahead: int = 0
    writes_rows: bool = False  # draft rows land in the cached groups
    draft_model: Any = None


NO_DRAFTS = Drafts()


def _mtp_lookahead(spec: Any, k: int) -> int:
    """One MTP module reads the next token; a chain of several (``num_nextn_predict_layers``
    > 1, used up to k deep) reads up to k tokens ahead, as vLLM's
    ``num_prefill_lookahead_tokens`` says."""
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    modules = int(getattr(hf, "num_nextn_predict_layers", 1) or 1)
    return k if min(modules, k) > 1 else 1


def _is_target(draft: Any, target: Any) -> bool:
    """The draft model config names the target's own checkpoint (MTP layers shipped in it)."""
    if draft is None:
        return True
    if target is None:
        return False
    if (str(draft.model), getattr(draft, "revision", None)) == (str(target.model), getattr(target, "revision", None)):
        return True
    try:
        return model_dir(draft) == model_dir(target)
    except UnnamedWeights:
        return False


def check_nameable(vllm_config: Any) -> Drafts:
    """What speculative decoding puts into the cached bytes (:class:`Drafts`); raises
    :class:`Unnameable` for what the namespace cannot name: the methods listed above as
    refused, a hidden-state drafter with a separate model that has no config, EAGLE/MTP
    with ``disable_eagle_block_drop`` (vLLM's local hits then keep blocks whose last draft
    row came from another continuation, and the connector would save those rows under keys
    that claim this request's next token), and a lookahead drafter on vLLM's padded drafter
    batch (its default). There, for a request whose prompt is still being prefilled, the
    drafter's input at the step's last position is the request's last known token
    (``prepare_next_token_ids_padded``: ``get_token_id(num_tokens_no_spec - 1)``, the
    prompt's last token), not the token after the step, so the draft row at every partial
    prefill's end depends on how the prompt that computed it ends. Measured on the tiny
    checkpoint: two prompts equal for 2 chunks stored different MTP rows at position 127
    (up to 2.8 apart), and a prompt resumed from the other's chunk drafted differently from
    its cold run at step 54 of 64. ``disable_padded_drafter_batch`` takes vLLM's other path
    (``prepare_next_token_ids_cpu``: the next prompt token), whose rows the lookahead key
    names; SGLang fixed the same defect in its EAGLE worker (sgl-project/sglang#26329)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return NO_DRAFTS
    method = getattr(spec, "method", None) or type(spec).__name__
    k = int(getattr(spec, "num_speculative_tokens", None) or 0)
    if method in _CACHELESS_DRAFTERS:
        return Drafts(method, k)
    if method not in _LOOKAHEAD_DRAFTERS:
        raise Unnameable(f"speculative decoding ({method}) is not in the cache identity (its draft rows' "
                         f"dependence on later tokens is not known; named: {sorted(_LOOKAHEAD_DRAFTERS)} "
                         f"and, with nothing cached, {sorted(_CACHELESS_DRAFTERS)})")
    if method != "draft_model" and getattr(spec, "disable_eagle_block_drop", False):
        raise Unnameable(f"speculative decoding ({method}) with disable_eagle_block_drop: vLLM's local prefix "
                         "hits keep draft rows computed from another continuation")
    if not getattr(spec, "disable_padded_drafter_batch", False):
        raise Unnameable(
            f"speculative decoding ({method}) with vLLM's padded drafter batch: the draft row at the end of "
            "each partial prefill step is computed from the prompt's last token, not the next one "
            "(prepare_next_token_ids_padded's backup token), so a chunk's rows depend on the rest of the "
            "prompt that computed them; add \"disable_padded_drafter_batch\": true to --speculative-config")
    draft = getattr(spec, "draft_model_config", None)
    target = getattr(vllm_config, "model_config", None)
    if method == "mtp":
        draft = None if _is_target(draft, target) else draft
        lookahead = _mtp_lookahead(spec, k)
    else:
        if draft is None:
            raise Unnameable(f"speculative decoding ({method}) without a draft model config: its weights "
                             "cannot be named")
        draft = None if _is_target(draft, target) else draft
        lookahead = _LOOKAHEAD_DRAFTERS[method]
    return Drafts(method, k, lookahead, True, draft)


def draft_identity(drafts: Drafts) -> dict[str, Any] | None:
    """The namespace's part for the draft: None where nothing of it is cached (drafts off,
    n-gram and other cacheless drafters: the same namespace as without drafts). Raises
    :class:`UnnamedWeights` where a separate draft model's weights cannot be named."""
    if not drafts.writes_rows:
        return None
    draft = drafts.draft_model
    return {
        "method": drafts.method,
        "num_speculative_tokens": drafts.num_speculative_tokens,
        "lookahead": drafts.lookahead,
        # MTP layers in the target's checkpoint: named by the target's weights already
        "weights": "target" if draft is None else weights_digest(model_dir(draft)),
        "config": None if draft is None else _config_digest(draft),
        "quantization": None if draft is None else str(getattr(draft, "quantization", None)),
        "hf_overrides": None if draft is None else _overrides(getattr(draft, "hf_overrides", None)),
    }


def _samples(fd: int, begin: int, end: int) -> bytes:
    """SAMPLE_BYTES at the start, middle and end of bytes [begin, end) of ``fd``."""
    n = end - begin
    if n <= 3 * SAMPLE_BYTES:
        return os.pread(fd, n, begin)
    mid = begin + (n - SAMPLE_BYTES) // 2
    return b"".join(os.pread(fd, SAMPLE_BYTES, at) for at in (begin, mid, end - SAMPLE_BYTES))


def _safetensors_digest(path: Path, h: Any) -> None:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > size - 8:
            raise UnnamedWeights(f"{path}: not a safetensors file (header of {n} bytes)")
        header = os.pread(fd, n, 8)
        h.update(struct.pack("<QQ", size, n) + header)
        base = 8 + n
        tensors = json.loads(header)
        for name in sorted(k for k in tensors if k != "__metadata__"):
            begin, end = tensors[name]["data_offsets"]
            h.update(_samples(fd, base + begin, base + end))
    finally:
        os.close(fd)


def _file_digest(path: Path, h: Any) -> None:
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    fd = os.open(path, os.O_RDONLY)
    try:
        step = max(1, size // FILE_SAMPLES)
        for at in range(0, size, step):
            h.update(os.pread(fd, SAMPLE_BYTES, at))
    finally:
        os.close(fd)


def weights_digest(model_dir: Path) -> str:
    """The sampled-content digest of the weight files under ``model_dir`` (see the module
    docstring); raises :class:`UnnamedWeights` where there are none."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise UnnamedWeights(f"no weight files under {model_dir}")
    h = blake3()
    for path in files:
        h.update(str(path.relative_to(model_dir)).encode() + b"\0")
        if path.name.endswith(".safetensors"):
            _safetensors_digest(path, h)
        else:
            _file_digest(path, h)
    return h.hexdigest()[:32]


def model_dir(model_config: ModelConfig) -> Path:
    """The local directory holding the model's weights: the path given, or the hub cache's
    snapshot of a model named by id (never downloaded here)."""
    path = Path(str(model_config.model))
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model_config.model), revision=model_config.revision,
                                      local_files_only=True))
    except Exception as e:  # noqa: BLE001 (any failure means: not found locally)
        raise UnnamedWeights(f"cannot find the weights of {model_config.model!r} locally: {e}") from None


def _config_digest(model_config: ModelConfig) -> str | None:
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    desc = hf_config.to_dict() if hasattr(hf_config, "to_dict") else vars(hf_config)
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _overrides(overrides: Any) -> str:
    """``--hf-overrides`` as the same text in every process (a callable by its name)."""
    if callable(overrides):
        return f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides, sort_keys=True, default=str)


def engine_identity(model_config: ModelConfig, drafts: Drafts = NO_DRAFTS) -> dict[str, Any]:
    """Everything besides the geometry that the cached bytes depend on, for the namespace:
    with ``drafts`` that write cache rows, the draft too (:func:`draft_identity`). Raises
    :class:`UnnamedWeights` where the weights cannot be named."""
    import vllm
    from vllm.platforms import current_platform

    directory = model_dir(model_config)
    snapshot = _SNAPSHOT.search(str(directory))
    capability = current_platform.get_device_capability()
    identity = {
        "weights": weights_digest(directory),
        "snapshot": snapshot.group(1) if snapshot else None,
        # the config as vLLM resolved it: quantization_config, rope and every
        # --hf-overrides field included
        "config": _config_digest(model_config),
        "quantization": str(getattr(model_config, "quantization", None)),
        "hf_overrides": _overrides(getattr(model_config, "hf_overrides", None)),
        "code_revision": getattr(model_config, "code_revision", None),
        "vllm": vllm.__version__,
        "device": [current_platform.device_type, None if capability is None else capability.to_int()],
    }
    draft = draft_identity(drafts)
    if draft is not None:  # absent otherwise: drafts-off namespaces stay what they were
        identity["draft"] = draft
    return identity
