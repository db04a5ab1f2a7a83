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

In-place changes at run time (vLLM's weight transfer API, ``reload_weights``, sleep level 2)
move the namespace: the workers name the weights they compute with by their content
(:class:`LiveWeights`), the scheduler side follows (:class:`WeightsView`). What vLLM 0.32
lets a connector see of each path, and what it does not, is in ``docs/design.md`` ("Keys
and namespaces").

Speculative decoding: a drafter whose layers write cache rows (EAGLE, MTP, a draft model)
joins the identity with its method, draft length, lookahead and weights (the target's, for
MTP layers shipped in its checkpoint; otherwise the draft's own, named the same way), and
its lookahead joins the chunk keys. Drafters that cache nothing (n-gram, suffix) leave the
namespace as it is without drafts; the rest is refused (:func:`check_nameable`).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import re
import struct
import time
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


def _padded_rows_exact(vllm_config: Any) -> bool:
    """Whether vLLM's padded drafter batch writes the draft row at a partial prefill's end
    from the next prompt token here (GLM-5.3-Flash with the plugin's fix installed)."""
    try:
        from glm5next_plugin.draft_rows import exact_rows
    except ImportError:
        return False
    return exact_rows(vllm_config)


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
    names; SGLang fixed the same defect in its EAGLE worker (sgl-project/sglang#26329). For
    GLM-5.3-Flash the plugin gives the padded path that token too
    (:mod:`glm5next_plugin.draft_rows`), so there vLLM's default batch is cached as well."""
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
    if not getattr(spec, "disable_padded_drafter_batch", False) and not _padded_rows_exact(vllm_config):
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


def engine_identity(model_config: ModelConfig, drafts: Drafts = NO_DRAFTS,
                    load_config: Any = None) -> dict[str, Any]:
    """Everything besides the geometry that the cached bytes depend on, for the namespace:
    with ``drafts`` that write cache rows, the draft too (:func:`draft_identity`). Raises
    :class:`UnnamedWeights` where the weights cannot be named, among them weights that are
    not the model's files (``load_config``: vLLM's, :func:`check_weights_source`)."""
    import vllm
    from vllm.platforms import current_platform

    check_weights_source(model_config, load_config)
    directory = model_dir(model_config, getattr(load_config, "download_dir", None))
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


# Weights at run time ------------------------------------------------------------------------
#
# vLLM 0.32 changes weights in place by three paths, and tells a KV connector of none of them
# directly (docs/design.md, "Keys and namespaces", has the table): the weight transfer API
# (start_weight_update / update_weights / finish_weight_update, collective RPCs to the
# workers), reload_weights (a collective RPC), and sleep level 2 (weights dropped, then
# reloaded by one of the other two). The scheduler side hears only reset_cache, when a pause
# or a sleep clears vLLM's caches; the worker side, nothing. So the workers watch the
# weights themselves: each names the weights it computes with by their content
# (live_digest), computes that once at start-up, again whenever the model's load_weights
# was called since the last step (every path above that goes through vLLM's loaders:
# reload_weights, the NCCL / IPC / sparse-patch engines, the layerwise reload after level
# 2) and whenever the scheduler asks after a reset (which also covers what writes weight
# storage directly, as long as a pause or sleep with cleared caches surrounds it). Each
# step's plan names the weights it was made for; a worker whose weights are other loads
# and saves nothing of it, and the scheduler moves to the namespace of the weights the
# workers report.

UNNAMED = "unnamed"  # a worker that cannot read its weights' content
UNVERIFIED = "unverified"  # the scheduler does not know the weights (after a reset)

# Words (16 bits) summed per checksum row: each row's sum is exact in int64 (|word| < 2^15,
# multipliers < 2^31, 2^16 of them), so the sum is the same on every device and in any
# reduction order, and a change of any single word always changes it.
_ROW_WORDS = 1 << 16
_ROWS_PER_PASS = 64  # rows converted to int64 at once (64 MiB of temporaries: fits beside the KV cache)
_MIXERS: dict[Any, Any] = {}


def _mixers(device: Any) -> Any:
    import torch

    mix = _MIXERS.get(device)
    if mix is None:
        i = torch.arange(_ROW_WORDS, dtype=torch.int64, device=device)
        mix = _MIXERS[device] = ((i * 2654435761) % 2147483647) | 1  # odd, below 2^31
    return mix


def tensor_checksum(t: Any) -> Any:
    """An int64 vector naming every byte of tensor ``t`` (on its device): the tensor read
    as 16-bit words, in rows of :data:`_ROW_WORDS`, each row's sum of word times an odd
    position multiplier, then the tail's sum and the byte count. One read of the tensor;
    nothing leaves the device."""
    import torch

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    n = raw.numel()
    even = raw[: n - n % 2]
    words = even.view(torch.int16) if even.numel() else even.to(torch.int16)
    mix = _mixers(raw.device)
    rows = words.numel() // _ROW_WORDS
    parts = []
    body = words[: rows * _ROW_WORDS].view(rows, _ROW_WORDS)
    for r in range(0, rows, _ROWS_PER_PASS):
        block = body[r : r + _ROWS_PER_PASS].to(torch.int64)
        parts.append((block * mix).sum(dim=1))
    tail = words[rows * _ROW_WORDS :].to(torch.int64)
    last = raw[n - n % 2 :].to(torch.int64)
    parts.append(torch.stack([(tail * mix[: tail.numel()]).sum(), last.sum(), torch.tensor(n, device=raw.device)]))
    return torch.cat(parts)


def _parameters(module: Any) -> Any:
    """``(name, tensor)`` for every tensor holding a parameter's bytes: vLLM's own walk for
    its weight checksums where it has one (it opens shared-weight parameters and tensor
    subclasses such as TorchAO's into their inner tensors), else ``named_parameters``."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import _weights

        return _weights(module)
    except ImportError:
        return module.named_parameters()


def live_digest(modules: list[Any]) -> str:
    """The content digest of every parameter of ``modules`` (the model and its drafter, as
    they are in memory now): names, dtypes, shapes and :func:`tensor_checksum` of each,
    hashed on the host. Parameters only: buffers hold derived values (rope caches) and, in
    some models, statistics that change as the model runs."""
    import torch

    h = blake3()
    sums: dict[Any, list[Any]] = {}  # per device, in parameter order
    order: list[Any] = []
    seen: set[int] = set()
    for m, module in enumerate(modules):
        for name, p in _parameters(module):
            if id(p) in seen:
                continue
            seen.add(id(p))
            h.update(f"{m}:{name}:{p.dtype}:{tuple(p.shape)}:{p.device.type}\0".encode())
            if p.device not in sums:
                sums[p.device] = []
                order.append(p.device)
            sums[p.device].append(tensor_checksum(p))
    for device in order:  # one transfer per device
        h.update(torch.cat(sums[device]).cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _engine_model_classes(vllm_config: Any) -> tuple[type, ...]:
    """The classes vLLM instantiates for the model and, where one caches rows, its drafter."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    classes = [get_model_cls(vllm_config.model_config)]
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    if draft is not None:
        try:
            classes.append(get_model_cls(draft))
        except Exception:  # noqa: BLE001 (a drafter vLLM builds without a registered class: not watched)
            pass
    return tuple(dict.fromkeys(classes))


def _candidates() -> Any:
    """Modules that may be a model: those vLLM recorded for in-place reloading (every module
    of every model its loader built in this process: ``initialize_model`` calls
    ``record_metadata_for_reloading``), else every object the garbage collector tracks."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        modules = list(LAYERWISE_INFO.keys())
        if modules:
            return modules
    except ImportError:
        pass
    return gc.get_objects()


def find_engine_models(classes: tuple[type, ...]) -> list[Any] | None:
    """The model (and drafter) objects of this worker process: every live instance of
    ``classes``, in the order vLLM built them (a draft model of the target's own class is
    one more instance). vLLM 0.32 hands a KV connector no reference to the model (its
    worker hooks get the KV cache tensors and the step's plan), so they are found once, at
    start-up (:func:`_candidates`). None where there is no instance of the target's class."""
    found = [obj for obj in _candidates() if isinstance(obj, classes)]
    if not any(isinstance(obj, classes[0]) for obj in found):
        return None
    return found


class LiveWeights:
    """The weights one worker computes with, named by their content.

    ``token`` is None while the weights are those loaded at start-up (their digest equals
    the one taken then: the namespace is the one the files name), else the digest of what
    is in memory now, or :data:`UNNAMED` where the weights cannot be read (no model found).
    Each ``modules`` object's ``load_weights`` is wrapped (on the object, not its class) to
    count calls: every in-place load vLLM runs goes through it (``reload_weights``, the
    weight transfer engines, sparse patches), so a step that starts after one names the
    weights again."""

    def __init__(self, modules: list[Any] | None, rank: int = 0) -> None:
        self._modules = list(modules or [])
        self._rank = rank
        self.loads = 0  # load_weights calls (entries and exits) since start-up
        self._seen_loads = 0
        for module in self._modules:
            self._watch(module)
        t0 = time.perf_counter()
        self.baseline = self._digest()
        self.baseline_s = time.perf_counter() - t0
        self.token: str | None = None
        self.answered = 0  # the last weights_seq answered

    @classmethod
    def of_engine(cls, vllm_config: Any, rank: int, log: Any) -> LiveWeights | None:
        """This worker's watcher; None off a real engine (configs vLLM did not build)."""
        try:
            classes = _engine_model_classes(vllm_config)
        except Exception:  # noqa: BLE001 (not an engine's config: tests, benchmarks)
            return None
        t0 = time.perf_counter()
        modules = find_engine_models(classes)
        found_s = time.perf_counter() - t0
        if modules is None:
            log.error("GlmCacheConnector worker rank %d: cannot find the model (%s) in this process: in-place "
                      "weight changes are not seen, and after a reset the external cache is not used",
                      rank, classes[0].__name__)
        live = cls(modules, rank)
        if live.baseline is not None:
            log.info("GlmCacheConnector worker rank %d: weights content digest %s (%d tensors; found in %.2f s, "
                     "read in %.2f s); in-place changes move the namespace", rank, live.baseline,
                     sum(1 for m in live._modules for _ in m.parameters()), found_s, live.baseline_s)
        return live

    def _watch(self, module: Any) -> None:
        original = getattr(module, "load_weights", None)
        if original is None or getattr(original, "_glm_live_weights", None) is self:
            return  # no loader (a drafter built from the target's modules), or watched already

        @functools.wraps(original)
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            self.loads += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.loads += 1

        load_weights._glm_live_weights = self  # type: ignore[attr-defined]
        module.load_weights = load_weights

    def _digest(self) -> str | None:
        """:func:`live_digest` of the modules; None where they cannot be read (no model
        found, a tensor that cannot be viewed as bytes)."""
        if not self._modules:
            return None
        try:
            return live_digest(self._modules)
        except Exception as e:  # noqa: BLE001 (any failure: the weights are not named, never a crash)
            from connector.config import logger

            logger.error("GlmCacheConnector worker rank %d: cannot read the weights' content (%s: %s); after "
                         "an in-place change or a reset the engine serves without the external cache",
                         self._rank, type(e).__name__, e)
            self._modules = []
            return None

    def recheck(self) -> None:
        """Name the weights again at the next step even if ``load_weights`` did not run (the
        worker woke from a sleep: vLLM 0.33's ``restore_kv_caches``)."""
        self._seen_loads = -1

    def current(self) -> str | None:
        """The token of the weights in memory now (reads them all)."""
        digest = self._digest()
        if digest is None or self.baseline is None:
            return UNNAMED
        return None if digest == self.baseline else digest

    def check(self, seq: int, expected: str | None) -> tuple[int, str | None] | None:
        """At the start of a step whose plan was made for weights ``expected`` (this rank's
        token in it) and reset count ``seq``: name the weights again if ``load_weights`` ran
        since the last step or the scheduler asks (a new ``seq``), and return the report for
        the scheduler, ``(seq, token)``: sent when the token changed, to answer a new
        ``seq``, and while the plan names other weights than these (until the scheduler
        has it)."""
        asked = seq != self.answered
        if self.loads != self._seen_loads or asked:
            self._seen_loads = self.loads
            self.token = self.current()
            self.answered = seq
            return seq, self.token
        if expected != self.token and expected != UNVERIFIED:
            return self.answered, self.token
        return None


def expected_token(weights: tuple[str | None, ...] | str | None, rank: int) -> str | None:
    """What a step's plan (``GlmConnectorMetadata.weights``) says rank ``rank``'s weights
    are: None (as loaded at start-up), a digest, or :data:`UNVERIFIED` (not known)."""
    if weights is None:
        return None
    if isinstance(weights, str) or rank >= len(weights):
        return UNVERIFIED
    return weights[rank]


class WeightsView:
    """What the scheduler side knows of its workers' weights: one token per rank (None:
    as loaded at start-up), and whether it knows them at all (``verified``: False from a
    reset until every rank answered it)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tokens: tuple[str | None, ...] = (None,) * world_size
        self.seq = 0
        self.verified = True
        self._answers: dict[int, tuple[int, str | None]] = {}

    def expected(self) -> tuple[str | None, ...] | str | None:
        """The plan's ``weights``: None while every rank has its start-up weights."""
        if not self.verified:
            return UNVERIFIED
        return None if all(t is None for t in self.tokens) else self.tokens

    def reset(self) -> None:
        """vLLM cleared its caches (a sleep, a pause before a weight update): the weights
        may change before the next step; ask every rank."""
        self.seq += 1
        self.verified = False

    def report(self, reports: dict[int, tuple[int, str | None]]) -> tuple[tuple, tuple, bool] | None:
        """Take the workers' reports; ``(old tokens, new tokens, answered a reset)`` when
        the scheduler learned something (the weights changed, or every rank answered the
        outstanding reset), else None."""
        for rank, (seq, token) in reports.items():
            if 0 <= rank < self.world_size:
                self._answers[rank] = (seq, token)
        latest = tuple(self._answers.get(r, (0, self.tokens[r]))[1] for r in range(self.world_size))
        if not self.verified:
            if any(self._answers.get(r, (-1, None))[0] != self.seq for r in range(self.world_size)):
                return None
            self.verified = True
            old, self.tokens = self.tokens, latest
            return old, latest, True
        if latest == self.tokens:
            return None
        old, self.tokens = self.tokens, latest
        return old, latest, False


def runtime_identity(identity: dict[str, Any] | None, tokens: tuple[str | None, ...]) -> dict[str, Any] | None:
    """The identity for weights ``tokens``: the start-up one while every rank has its
    start-up weights; else the same with the weights named by every rank's content digest
    (replicas updated in place to the same weights, on the same layout, share this
    namespace); None where a rank cannot name its weights."""
    if identity is None or any(t == UNNAMED for t in tokens):
        return None
    if all(t is None for t in tokens):
        return identity
    startup = f"files:{identity.get('weights')}"  # a rank still on its start-up weights: the files' digest
    live = blake3("|".join(startup if t is None else t for t in tokens).encode()).hexdigest()[:32]
    changed = {**identity, "weights": f"live:{live}", "snapshot": None}
    if isinstance(changed.get("draft"), dict):  # the live digest covers the drafter's parameters too
        changed["draft"] = {**changed["draft"], "weights": "live"}
    return changed
