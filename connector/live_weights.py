"""Worker side: the weights one worker computes with, named by their content at run time
(:class:`LiveWeights`), and what a step's plan says they should be (:func:`expected_token`).
The scheduler side's half is :mod:`connector.weights_view`; the weights as loaded at
start-up are named by their files (:mod:`connector.identity`).

vLLM 0.32 changes weights in place by three paths, and tells a KV connector of none of
them directly (``docs/design.md``, "Keys and namespaces", has the table): the weight transfer
API (start_weight_update / update_weights / finish_weight_update, collective RPCs to the
workers), reload_weights (a collective RPC), and sleep level 2 (weights dropped, then
reloaded by one of the other two). The scheduler side hears only reset_cache, when a pause
or a sleep clears vLLM's caches; the worker side, nothing. So the workers watch the
weights themselves: each names the weights it computes with by their content
(:func:`live_digest`), computes that once at start-up, again whenever the model's load_weights was
called since the last step (every path above that goes through vLLM's loaders:
reload_weights, the NCCL / IPC / sparse-patch engines, the layerwise reload after level 2)
and whenever the scheduler asks after a reset (which also covers what writes weight
storage directly, as long as a pause or sleep with cleared caches surrounds it). Each
step's plan names the weights it was made for; a worker whose weights are other loads and
saves nothing of it, and the scheduler moves to the namespace of the weights the workers
report.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

from blake3 import blake3

from connector.metadata import UNNAMED, UNVERIFIED

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

