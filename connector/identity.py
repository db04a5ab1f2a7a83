"""What an object's bytes depend on beyond the cache geometry: the weights, the model's
configuration (quantization and overrides included), and the engine that computed them
(vLLM's version, the device family its kernels ran on). All of it joins the namespace
(:func:`connector.namespace.engine_fingerprint`), so objects computed by other weights or
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

Only weights that are those files are named so: a ``--load-format`` whose weights come
from elsewhere (``dummy``'s random ones, a tensorizer URI, object storage, a peer) is
refused (:func:`check_weights_source`), and the engine serves without the external cache.

The rest of the identity has its own modules: a drafter that writes cache rows
(:mod:`connector.drafts`, joined by :class:`connector.namespace.Namespace`), and weights
changed in place at run time, which move the namespace: the workers name the weights they
compute with by their content (:mod:`connector.live_weights`), the scheduler side follows
(:mod:`connector.weights_view`). What vLLM 0.32 lets a connector see of each path, and
what it does not, is in ``docs/design.md`` ("Keys and namespaces").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
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


def model_dir(model_config: ModelConfig, download_dir: str | None = None) -> Path:
    """The local directory holding the model's weights: the path given, or the hub cache's
    snapshot of a model named by id (never downloaded here; ``download_dir``: vLLM's
    ``--download-dir``, where it put them instead of the default hub cache)."""
    path = Path(str(model_config.model))
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model_config.model), revision=model_config.revision,
                                      cache_dir=download_dir or None, local_files_only=True))
    except Exception as e:  # noqa: BLE001 (any failure means: not found locally)
        raise UnnamedWeights(f"cannot find the weights of {model_config.model!r} locally: {e}") from None


def config_digest(model_config: ModelConfig) -> str | None:
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    desc = hf_config.to_dict() if hasattr(hf_config, "to_dict") else vars(hf_config)
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def overrides_text(overrides: Any) -> str:
    """``--hf-overrides`` as the same text in every process (a callable by its name)."""
    if callable(overrides):
        return f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides, sort_keys=True, default=str)


# vLLM 0.32's --load-format values (vllm/model_executor/model_loader/__init__.py) whose
# weights are the files under the model directory, which weights_digest reads: the default
# loader's formats (auto, hf, safetensors and its fastsafetensors / instanttensor readers,
# mistral's consolidated files, pt, npcache's numpy copies of the .bin files) and
# sharded_state (pre-sharded files saved there by save_sharded_state); and, in vLLM versions
# that register them, bitsandbytes (the directory's files, quantized as they load: the
# quantization is in the identity) and gguf (the directory's .gguf file).
FILE_LOAD_FORMATS = frozenset({"auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "mistral",
                               "pt", "npcache", "sharded_state", "bitsandbytes", "gguf"})
# The others, and where their weights come from. Any format not in FILE_LOAD_FORMATS (these,
# a loader registered by a plugin, one vLLM adds later) is refused.
_OTHER_SOURCES = {
    "dummy": "random weights, not the files on disk",
    "tensorizer": "tensors deserialized from the tensorizer URI, not the model directory's files",
    "runai_streamer": "weights streamed from object storage",
    "runai_streamer_sharded": "pre-sharded weights streamed from object storage",
    "modelexpress": "weights received from a ModelExpress peer",
    "ipc_cache": "weights received over IPC from another process",
}


def load_format(load_config: Any) -> str:
    """vLLM's ``--load-format`` as a string (``auto`` when there is no load config)."""
    fmt = getattr(load_config, "load_format", None) if load_config is not None else None
    fmt = getattr(fmt, "value", fmt)  # an enum member in some vLLM versions
    return str(fmt or "auto")


def check_weights_source(model_config: Any, load_config: Any) -> None:
    """Raise :class:`UnnamedWeights` unless the engine computes with the files under the
    model directory, the only weights :func:`weights_digest` names: a ``--load-format``
    outside :data:`FILE_LOAD_FORMATS` (``dummy``: a benchmark engine with random weights
    pointed at a production server would save random-weight KV under the production
    namespace), or weights pulled from object storage (``model_weights``)."""
    fmt = load_format(load_config)
    if fmt not in FILE_LOAD_FORMATS:
        why = _OTHER_SOURCES.get(fmt, "a loader whose weights the connector cannot tell from the files on disk")
        raise UnnamedWeights(f"--load-format {fmt}: {why}; its weights cannot be named by the model's files "
                             f"(named: {', '.join(sorted(FILE_LOAD_FORMATS))})")
    source = getattr(model_config, "model_weights", "") or ""
    if source:
        raise UnnamedWeights(f"weights loaded from {source!r}, not from the files under {model_config.model!r}")


def engine_identity(model_config: ModelConfig, load_config: Any = None) -> dict[str, Any]:
    """Everything besides the geometry and a drafter that the cached bytes depend on, for
    the namespace (:class:`connector.namespace.Namespace` adds a drafter that writes cache
    rows under ``draft``: :func:`connector.drafts.draft_identity`). Raises
    :class:`UnnamedWeights` where the weights cannot be named, among them weights that are
    not the model's files (``load_config``: vLLM's, :func:`check_weights_source`)."""
    import vllm
    from vllm.platforms import current_platform

    check_weights_source(model_config, load_config)
    directory = model_dir(model_config, getattr(load_config, "download_dir", None))
    snapshot = _SNAPSHOT.search(str(directory))
    capability = current_platform.get_device_capability()
    return {
        "weights": weights_digest(directory),
        "snapshot": snapshot.group(1) if snapshot else None,
        # the config as vLLM resolved it: quantization_config, rope and every
        # --hf-overrides field included
        "config": config_digest(model_config),
        "quantization": str(getattr(model_config, "quantization", None)),
        "hf_overrides": overrides_text(getattr(model_config, "hf_overrides", None)),
        "code_revision": getattr(model_config, "code_revision", None),
        "vllm": vllm.__version__,
        "device": [current_platform.device_type, None if capability is None else capability.to_int()],
    }
