"""Images in the chunk keys: what an image request's cached bytes depend on, and how the
keys name it.

A chunk an image reaches holds KV computed from the image's embeddings, which depend on
the pixels after processing, the processor's settings and the vision tower's weights (the
weights are in the namespace already, :mod:`connector.identity`). vLLM's block hashes (the
``vllm`` key scheme) add ``("mm", identifier, offset)`` to every block an image overlaps,
and chain it forward, so a key at a chunk's end names every image before it and where it
sits. The identifier is a digest of the media bytes and the processor's per-request
options, except that a client-supplied ``multi_modal_uuids`` entry is used verbatim: with
a cache shared by replicas and tenants, a client that sends another client's media id with
its own image would resume from the other's KV. So, unless the operator says the fleet's
clients are trusted (``trust_media_ids``), the connector names each image by what the
encoder reads, its processed tensors (``pixel_values`` and grid), with its own digest, and
mixes those digests into the key of every chunk at or after the image's first placeholder
(:func:`cache_server.chunk_keys.media_keys`). A request whose processed tensors are not on the scheduler (vLLM's
``shm`` processor cache keeps them on the workers only) is not cached.

The token-chain scheme (``chunk_keys: lmcache``) hashes token ids only, in which every
image's placeholders are the same tokens: image requests are not cached there.

What else the bytes depend on joins the namespace for a multimodal model
(:func:`media_identity`): vLLM's multimodal hash algorithm, the engine's
``--mm-processor-kwargs``, the checkpoint's processor configuration files and the
transformers version whose processor code ran.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

# Processor configuration a checkpoint ships (transformers' file names).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


class MediaUnnamed(Exception):
    """A request's media cannot be named (its processed tensors are not here)."""


def media_identity(model_config: Any, trust_media_ids: bool) -> dict[str, Any] | None:
    """The namespace's part for images: None for a model without multimodal inputs (its
    namespace is what it was). Raises nothing: files that are not there count as absent."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None or not getattr(model_config, "is_multimodal_model", False):
        return None
    import transformers

    from connector.identity import UnnamedWeights, model_dir

    files: dict[str, str | None] = {}
    try:
        directory = model_dir(model_config)
    except UnnamedWeights:
        directory = None
    for name in PROCESSOR_FILES:
        path = None if directory is None else directory / name
        files[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path and path.is_file() else None
    return {
        "hasher": str(getattr(mm, "mm_hasher_algorithm", None)),
        "mm_processor_kwargs": json.dumps(getattr(mm, "mm_processor_kwargs", None), sort_keys=True, default=str),
        "processor_files": files,
        "transformers": transformers.__version__,
        # keys of trusted and untrusted engines differ anyway; named so an operator sees it
        "media_ids": "trusted" if trust_media_ids else "content",
    }


def _tensor_bytes(value: Any, h: Any) -> None:
    """Feed a processed field (a tensor, or nested lists/tuples of them) to ``h`` with its
    structure, dtype and shape, so distinct values never serialize alike."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        meta = f"T{t.dtype}{tuple(t.shape)}".encode()
        h.update(len(meta).to_bytes(4, "big") + meta)
        raw = t.view(torch.uint8).numpy() if t.numel() else b""
        h.update(len(raw).to_bytes(8, "big"))
        h.update(raw)
    elif isinstance(value, (list, tuple)):
        h.update(b"L" + len(value).to_bytes(4, "big"))
        for v in value:
            _tensor_bytes(v, h)
    else:
        text = repr(value).encode()
        h.update(b"V" + len(text).to_bytes(4, "big") + text)


def feature_digest(feature: Any) -> bytes:
    """The digest of one multimodal item as the encoder reads it: its modality and every
    processed field (name, dtype, shape, bytes). Raises :class:`MediaUnnamed` where the
    scheduler does not hold the item's data."""
    item = getattr(feature, "data", None)
    if item is None:
        raise MediaUnnamed("its processed tensors are not on the scheduler (mm_processor_cache_type shm?)")
    h = blake3()
    modality = str(feature.modality).encode()
    h.update(len(modality).to_bytes(4, "big") + modality)
    for key in sorted(item.keys()):
        data = item[key].data
        if data is None:
            raise MediaUnnamed(f"its processed field {key!r} is not on the scheduler")
        name = key.encode()
        h.update(len(name).to_bytes(4, "big") + name)
        _tensor_bytes(data, h)
    return h.digest()


@dataclass(frozen=True)
class MediaItem:
    """One multimodal item of a request: where its placeholders lie, vLLM's identifier for
    it (what vLLM's prefix and encoder caches are keyed by: a client's uuid verbatim, or a
    digest of the media) and our digest of what the encoder reads."""

    index: int  # in request.mm_features
    offset: int
    length: int
    identifier: str
    digest: bytes


def request_items(request: Any) -> list[MediaItem]:
    """The request's media items in prompt order (empty for a text request); raises
    :class:`MediaUnnamed`."""
    items = []
    for i, f in enumerate(getattr(request, "mm_features", None) or ()):
        pos = f.mm_position
        items.append(MediaItem(i, int(pos.offset), int(pos.length), str(f.identifier), feature_digest(f)))
    return sorted(items, key=lambda it: it.offset)


def request_media(request: Any) -> list[tuple[int, bytes]]:
    """``(first placeholder position, digest)`` of each of the request's media items, in
    prompt order (empty for a text request); raises :class:`MediaUnnamed`."""
    return [(it.offset, it.digest) for it in request_items(request)]


class MediaLedger:
    """Which content vLLM's own caches may hold under each media identifier, as far as this
    engine's scheduler has seen.

    vLLM keys its prefix cache (block hashes carry ``("mm", identifier, offset)``) and its
    encoder cache by the item's identifier, which is a client's ``multi_modal_uuids`` entry
    verbatim when one is given. A client can therefore send image A under image B's
    identifier, and a later request for B (no uuid) then computes from A's embeddings or
    resumes from A's rows on this engine. Rows or embeddings enter those caches under an
    identifier only by an encoding the scheduler schedules (``scheduled_encoder_inputs``:
    the worker runs the vision tower on that request's own pixels) or by a load of ours;
    the ledger records the digest of the pixels behind each. An identifier seen with one
    digest only vouches for that digest; seen with two, or with pixels the scheduler could
    not read, it vouches for nothing, for good (a poisoned identifier costs caching on this
    engine, never correctness). Bounded: the least recently recorded identifiers are
    forgotten, and a forgotten identifier vouches for nothing."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[str, bytes | None] = OrderedDict()  # None: poisoned

    def record(self, identifier: str, digest: bytes | None) -> None:
        if identifier in self._seen:
            if self._seen[identifier] != digest:
                self._seen[identifier] = None
            self._seen.move_to_end(identifier)
            return
        self._seen[identifier] = digest
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def vouches(self, item: MediaItem) -> bool:
        return self._seen.get(item.identifier) == item.digest

    def record_load(self, items: Sequence[MediaItem], local_tokens: int, resume: int) -> None:
        """A load of tokens [``local_tokens``, ``resume``): rows under the identifiers of the
        items it reaches now come from the server's content, named by its digest."""
        for it in items:
            if it.offset < resume and it.offset + it.length > local_tokens:
                self.record(it.identifier, it.digest)

    def __len__(self) -> int:
        return len(self._seen)


def unvouched_from(items: Sequence[MediaItem], ledger: MediaLedger, reached: int, local_tokens: int,
                   loaded_tokens: int) -> int | None:
    """The first placeholder position of an item the request has reached (``reached``
    tokens computed) whose rows or embeddings may come from vLLM's caches under an
    identifier the ledger does not vouch for, or None. Items whose rows all came from the
    server (after vLLM's local hit, before the load's resume point) are the server's own,
    named by content: they need no voucher."""
    limit = None
    for it in items:
        if it.offset >= reached:
            break
        from_server = local_tokens <= it.offset and it.offset + it.length <= loaded_tokens
        if not from_server and not ledger.vouches(it):
            limit = it.offset if limit is None else min(limit, it.offset)
    return limit
