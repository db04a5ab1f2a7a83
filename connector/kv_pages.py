"""Worker side: vLLM's KV cache as byte pages, read into and written from cache objects.

vLLM allocates one flat backing buffer; ``KVCacheTensor`` says where block ``b`` of layer
``l`` starts (``offset + l * layer_stride + b * block_stride``). A cache object is the
concatenation, layer by layer, of an object group's pages for a list of blocks: the
attention object of a chunk covers that chunk's blocks; a state object is one block (the
state snapshot at the chunk's end). Each layer's page has its own size (one group may pack
pages of different sizes, e.g. the MLA latent and the kpool indexer). An object group of
one part of each row (``LayerPage.rows`` > 1) takes that part's columns of every row of
the page, row after row. Pages are opaque bytes: the connector never interprets them.
"""

from __future__ import annotations

import ctypes
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from connector.geometry import CacheGroup, LayerPage

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class _Placement:
    base: int  # byte offset of the layer's block 0 in the backing buffer
    block_stride: int


@dataclass(frozen=True)
class _Lane:
    """Pages of one group that one strided copy writes per block: ``count`` layers whose
    pages have the same size and block stride, lie ``dst_step`` bytes apart in the KV
    buffer, and one period of the group's layer list apart in the object."""

    dst_base: int  # byte offset of block 0's part of the lane's first layer
    dst_step: int  # bytes between the pages of consecutive layers of the lane, one block
    block_stride: int
    page_bytes: int
    count: int
    obj_offset: int  # bytes before the lane's first layer in a one-block object
    obj_period: int  # bytes of one period of layers in a one-block object
    rows: int  # rows of each page the lane takes a part of (1: whole pages)
    row_stride: int


VERIFY_PIECE_BYTES = 512 << 10  # hashed, then copied, while in cache (write_verified): within L2


def glibc_non_temporal_threshold(environ: Any = None) -> int | None:
    """The copy size from which this process's glibc ``memcpy`` stores past the cache, when
    ``GLIBC_TUNABLES`` sets it (``glibc.cpu.x86_non_temporal_threshold``; read at process
    start, so the environment it was started with); None when not set (glibc's default,
    0xf000000 = 240 MiB here: no page copy reaches it)."""
    import os

    for item in (environ if environ is not None else os.environ).get("GLIBC_TUNABLES", "").replace(":", ",").split(","):
        name, _, value = item.partition("=")
        if name.strip() == "glibc.cpu.x86_non_temporal_threshold":
            try:
                return int(value, 0)
            except ValueError:
                return None
    return None


try:  # built at install where a C compiler is (pyproject.toml's ext-modules)
    from connector import _streamcopy
except ImportError:
    _streamcopy = None

# On CPU a write is one table of copies run in C without the GIL (connector/_streamcopy.c):
# whole pages (1.18 MB for GLM-5.3-Flash's latent) with streaming stores (x86-64), which write
# past the cache, parts of rows with memcpy (a page of them one strided row of the table).
# Torch's strided copies (where it is not built) go through the cache and cost about 50 us
# of the GIL per object, which the model's thread waits for. Without it, glibc's memmove
# also streams where the engine runs with a low non-temporal threshold: whole pages are
# then copied one memmove each. Where pages stream, hashing on a second thread meanwhile
# costs nothing (write_verified's ``hasher``).
TABLE_COPIES = _streamcopy is not None
STREAMING_COPY = TABLE_COPIES and bool(_streamcopy.STREAMING)
NON_TEMPORAL_PAGES = STREAMING_COPY or (glibc_non_temporal_threshold() or 1 << 62) <= 1 << 20


def copy_table(table: np.ndarray, streaming: bool = True) -> None:
    """Run each ``(destination, source, bytes)`` row of ``table`` as a copy between
    addresses the caller vouches for: in C without the GIL where built (:data:`TABLE_COPIES`;
    streaming stores where asked and :data:`STREAMING_COPY`), else one glibc ``memmove`` each."""
    if TABLE_COPIES:
        _streamcopy.copy_pages(np.ascontiguousarray(table, dtype=np.uint64), streaming and STREAMING_COPY)
        return
    for dst, src, n in np.asarray(table, dtype=np.uint64).tolist():
        ctypes.memmove(dst, src, n)


def copy_rows(table: np.ndarray) -> None:
    """Run each ``(destination, source, bytes, pieces, destination stride, source stride)``
    row of ``table`` as that many copies of ``bytes``, the strides apart on either side
    (parts of rows: memcpy, not streaming stores, whose lines the next rows share); in C
    without the GIL where built, else as the :func:`copy_table` of every piece."""
    if TABLE_COPIES:
        _streamcopy.copy_rows(np.ascontiguousarray(table, dtype=np.uint64))
        return
    t = np.asarray(table, dtype=np.int64).reshape(-1, 6)
    pieces = [np.stack([d + np.arange(k) * ds, s + np.arange(k) * ss, np.full(k, n)], axis=1)
              for d, s, n, k, ds, ss in t.tolist()]
    if pieces:
        copy_table(np.concatenate(pieces), streaming=False)


def _digest(h: Any, data: memoryview) -> bytes:
    h.update(data)
    return h.digest()


def _bytes_view(payload: bytes | memoryview) -> memoryview:
    """``payload`` as a memoryview of bytes (format ``B``)."""
    view = memoryview(payload)
    return view if view.format == "B" else view.cast("B")


def _address(view: memoryview) -> int:
    """The address of a byte view's first byte (0 for an empty one)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _as_uint8(payload: bytes | memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only read from it
        return torch.frombuffer(payload, dtype=torch.uint8)


class PagedKVCache:
    """Byte-level reader/writer of the cached groups' pages in vLLM's KV buffer."""

    def __init__(
        self,
        kv_caches: dict[str, Any],
        kv_cache_config: KVCacheConfig,
        groups: tuple[CacheGroup, ...],
    ) -> None:
        self._groups = {g.group_id: g for g in groups}
        self._layers: dict[str, _Placement] = {}
        self._lanes: dict[int, tuple[_Lane, ...]] = {}
        self._row_shapes: dict[int, tuple[tuple[Any, ...], ...]] = {}
        if not groups:  # served without the external cache: nothing to read or write
            self._raw = torch.empty(0, dtype=torch.uint8)
            return
        any_cache = next(iter(kv_caches.values()))
        tensor = any_cache if isinstance(any_cache, torch.Tensor) else any_cache[0]
        storage = tensor.untyped_storage()
        # One uint8 view over the whole backing allocation (shared by every layer).
        self._raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        placements: dict[str, tuple[int, int, int]] = {}
        for t in kv_cache_config.kv_cache_tensors:
            for idx, name in enumerate(t.layers):
                placements[name] = (t.offset + idx * t.layer_stride, t.block_stride, t.size)
        missing = [n for g in groups for n in g.layer_names if n not in placements]
        if missing:
            raise ValueError(f"no KV cache tensor placement for layers {missing}")
        for g in groups:
            for p in g.layers:
                base, block_stride, _ = placements[p.name]
                self._layers[p.name] = _Placement(base, block_stride)
            self._check_disjoint(g, kv_cache_config.num_blocks, placements)
            self._lanes[g.group_id] = self._find_lanes(g)
            self._row_shapes[g.group_id] = self._group_row_shapes(g)
        self._check_views(kv_caches, groups)

    def _find_lanes(self, g: CacheGroup) -> tuple[_Lane, ...]:
        """The group's layers as few lanes as their placement allows: the shortest period
        P of the layer list such that layer i and layer i + P have the same page size and
        block stride, and the distance between their pages is the same all along each lane
        (and positive). GLM-5.3-Flash's attention group alternates an indexer page and a
        latent page per layer: P = 2, one copy for each kind instead of one per page. With
        no such P each layer is a lane of its own (one copy per page). Parts of rows
        (``LayerPage.rows`` > 1) are lanes of the same shape: one copy moves a part of every
        row of the lane's pages."""
        parts = g.layers
        lps = [self._layers[p.name] for p in parts]
        m = len(lps)
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + p.page_bytes)

        def shape(i: int) -> tuple[int, ...]:
            p = parts[i]
            return (p.page_bytes, p.rows, p.row_stride, p.row_offset, lps[i].block_stride)

        for period in range(1, m + 1):
            if m % period:
                continue
            steps = [lps[j + period].base - lps[j].base if period < m else parts[j].page_extent
                     for j in range(period)]
            if period < m and not all(
                shape(i) == shape(i - period) and lps[i].base - lps[i - period].base == steps[i % period] > 0
                for i in range(period, m)
            ):
                continue
            return tuple(_Lane(lps[j].base + parts[j].row_offset, steps[j], lps[j].block_stride, parts[j].page_bytes,
                               m // period, offsets[j], offsets[period], parts[j].rows, parts[j].row_stride)
                         for j in range(period))
        return ()  # a group without layers: nothing to copy

    def _check_disjoint(self, g: CacheGroup, num_blocks: int,
                        placements: dict[str, tuple[int, int, int]]) -> None:
        """Refuse page sizes that would reach into a neighbour: within one block the
        group's layers' pages must not overlap, a page must end before the layer's next
        block starts, and the last block must end inside the allocation. (Different
        groups may alias the same bytes: a block id belongs to one group at a time.)"""
        spans = []
        for p in g.layers:
            base, block_stride, size = placements[p.name]
            if p.rows > 1 and p.row_offset + p.row_width > p.row_stride:
                raise ValueError(f"layer {p.name}: row part at {p.row_offset} of {p.row_width} bytes exceeds "
                                 f"its row of {p.row_stride}")
            if num_blocks > 1 and p.page_extent > block_stride:
                raise ValueError(
                    f"layer {p.name}: page of {p.page_extent} bytes exceeds its block stride {block_stride}"
                )
            if base + (num_blocks - 1) * block_stride + p.page_extent > size:
                raise ValueError(f"layer {p.name}: pages run past the KV allocation of {size} bytes")
            spans.append((base, base + p.page_extent, p.name))
        spans.sort()
        for (_, end, name), (start, _, nxt) in zip(spans, spans[1:]):
            if end > start:
                raise ValueError(f"group {g.group_id}: pages of {name} and {nxt} overlap")

    def _check_views(self, kv_caches: dict[str, Any], groups: tuple[CacheGroup, ...]) -> None:
        """Verify the placement arithmetic against the views vLLM bound to the layers."""
        base_ptr = self._raw.data_ptr()
        for g in groups:
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if cache is None:
                    continue
                view = cache if isinstance(cache, torch.Tensor) else cache[0]
                if view.untyped_storage().data_ptr() != base_ptr:
                    raise ValueError(f"layer {name} is not in the shared KV buffer")
                if view.data_ptr() - base_ptr != self._layers[name].base:
                    raise ValueError(
                        f"layer {name}: view starts at byte {view.data_ptr() - base_ptr}, "
                        f"placement says {self._layers[name].base}"
                    )

    @property
    def device(self) -> torch.device:
        return self._raw.device

    def object_bytes(self, group_id: int, num_blocks: int) -> int:
        return self._groups[group_id].object_bytes(num_blocks)

    def _page(self, part: LayerPage, block_id: int) -> torch.Tensor:
        """``part``'s bytes of one block's page, as a ``[rows, row_width]`` view."""
        lp = self._layers[part.name]
        start = lp.base + block_id * lp.block_stride + part.row_offset
        return self._raw.as_strided((part.rows, part.row_width), (part.row_stride or part.row_width, 1), start)

    def read(self, group_id: int, block_ids: list[int]) -> memoryview:
        """The object for ``block_ids`` of one group: layer-major, then block order.

        Each page is copied once, straight into the object's host buffer; on an
        accelerator that buffer is pinned, the copies are asynchronous and one sync ends
        them. The view owns its buffer: nothing later overwrites it. Measured at the TP 4
        layouts (``validation/gpu_pages_check.py``): on an H200 40.6-44.1 GB/s, against
        10-11.6 for a gather-then-copy (and 48-52 for one pinned copy of the same
        bytes); on this machine's CPU 27-39 GB/s for state objects, against 0.1-10 for
        gather-then-``bytes``."""
        g = self._groups[group_id]
        device = self._raw.device
        on_device = device.type != "cpu"
        out = torch.empty(g.object_bytes(len(block_ids)), dtype=torch.uint8, pin_memory=on_device)
        pos = 0
        for part in g.layers:
            for b in block_ids:
                dst = out[pos : pos + part.page_bytes].view(part.rows, part.row_width)
                dst.copy_(self._page(part, b), non_blocking=on_device)
                pos += part.page_bytes
        self._synchronize()
        return memoryview(out.numpy())

    def _synchronize(self) -> None:
        """Wait for the copies queued on an accelerator (nothing to wait for on the CPU)."""
        device = self._raw.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type != "cpu":
            torch.accelerator.synchronize(device)

    def write(self, group_id: int, block_ids: list[int | None], payload: bytes | memoryview, wait: bool = True) -> None:
        """Scatter an object read by :meth:`read` back into ``block_ids``.

        ``None`` entries are blocks vLLM already holds (a local prefix hit inside the
        chunk): their pages in the object are skipped, the others land where they belong.
        One strided copy per lane (see :meth:`_find_lanes`) and block moves the pages of
        all the lane's layers at once, straight from ``payload`` (on CPU, a view of the
        client's shared-memory segment): a GLM-5.3-Flash attention object (22 pages per
        block) takes 2 copies, a KDA state object 1.
        """
        g = self._groups[group_id]
        expected = g.object_bytes(len(block_ids))
        if len(payload) != expected:
            raise ValueError(f"group {group_id}: object of {len(payload)} bytes, expected {expected}")
        if self._raw.device.type == "cpu" and (TABLE_COPIES or (
                NON_TEMPORAL_PAGES and all(part.rows == 1 for part in g.layers))):
            self._copy([(group_id, block_ids, _address(_bytes_view(payload)))])
            return
        src = _as_uint8(payload)
        if self._raw.device.type != "cpu":
            # from page-locked host memory an asynchronous DMA (waited for below, or by the
            # caller with ``wait=False``, which keeps ``payload`` alive until then)
            src = src.to(self._raw.device, non_blocking=src.is_pinned())
        n = len(block_ids)
        for lane in self._lanes[group_id]:
            width = lane.page_bytes // lane.rows
            rows = (lane.count, lane.rows, width)
            for t, b in enumerate(block_ids):
                if b is not None:
                    dst = self._raw.as_strided(rows, (lane.dst_step, lane.row_stride or width, 1),
                                               lane.dst_base + b * lane.block_stride)
                    dst.copy_(src.as_strided(rows, (n * lane.obj_period, width, 1),
                                             n * lane.obj_offset + t * lane.page_bytes))
        if wait:
            self._synchronize()

    def write_many(self, objects: list[tuple[int, list[int | None], bytes | memoryview]]) -> None:
        """:meth:`write` for each ``(group_id, block_ids, payload)``; on CPU with
        :data:`TABLE_COPIES` all of them as one table of copies, run without the GIL (a batch
        of a load: one C call and a few numpy operations per group and layer, not two torch
        calls per object)."""
        table = TABLE_COPIES and self._raw.device.type == "cpu"
        if table:  # every payload's address and bytes in one C call
            spans = np.frombuffer(_streamcopy.buffer_spans([payload for _, _, payload in objects]),
                                  dtype=np.uint64).reshape(-1, 2).tolist()
        else:
            spans = [(None, len(payload)) for _, _, payload in objects]
        for (group_id, block_ids, _), (_, size) in zip(objects, spans):  # all checked before any is written
            expected = self._groups[group_id].object_bytes(len(block_ids))
            if size != expected:
                raise ValueError(f"group {group_id}: object of {size} bytes, expected {expected}")
        if table:
            self._copy([(group_id, block_ids, addr) for (group_id, block_ids, _), (addr, _) in zip(objects, spans)])
            return
        for group_id, block_ids, payload in objects:
            self.write(group_id, block_ids, payload)

    def _copy(self, objects: list[tuple[int, list[int | None], int]]) -> None:
        """Copy objects of the sizes their groups say, each ``(group_id, block_ids, address)``
        (the group's layers in order, each its blocks' pages, parts of rows row after row),
        into their pages; None blocks skipped. Whole pages stream past the cache."""
        whole, parts = self._tables(objects)
        if len(whole):
            copy_table(whole, streaming=True)
        if len(parts):
            copy_rows(parts)

    def _tables(self, objects: list[tuple[int, list[int | None], int]]) -> tuple[np.ndarray, np.ndarray]:
        """The copies of :meth:`_copy`: whole pages as ``(destination, source, bytes)`` rows
        (:func:`copy_table`), then pages of parts of rows as one :func:`copy_rows` row each.
        Built with a few numpy operations per group, block count and row shape of its layers,
        over all the objects at once."""
        shapes: dict[tuple[int, int], list[tuple[list[int | None], int]]] = {}
        for group_id, block_ids, addr in objects:
            shapes.setdefault((group_id, len(block_ids)), []).append((block_ids, addr))
        raw_addr = self._raw.data_ptr()
        whole: list[np.ndarray] = []
        parts: list[np.ndarray] = []
        for (group_id, n), objs in shapes.items():
            try:  # no block skipped (the common case): one conversion
                blocks = np.array([ids for ids, _ in objs], dtype=np.int64)
            except TypeError:  # None: a block held locally, not written
                blocks = np.array([[-1 if b is None else b for b in ids] for ids, _ in objs], dtype=np.int64)
            blocks = blocks.reshape(-1, 1, n)  # (object, layer, block)
            addrs = np.array([addr for _, addr in objs], dtype=np.int64).reshape(-1, 1, 1)
            t = np.arange(n, dtype=np.int64)
            for rows, width, row_stride, page, base, stride, before in self._row_shapes[group_id]:
                held = np.broadcast_to(blocks >= 0, (blocks.shape[0], base.shape[1], n))
                dst = (raw_addr + base + blocks * stride)[held]
                src = (addrs + n * before + t * page)[held]
                if rows == 1:
                    whole.append(np.stack([dst, src, np.full_like(dst, page)], axis=1))
                else:  # the object holds the parts row after row
                    parts.append(np.stack([dst, src, *(np.full_like(dst, x) for x in (width, rows, row_stride, width))],
                                          axis=1))
        pages = (whole[0] if len(whole) == 1 else np.concatenate(whole)) if whole else np.empty((0, 3), dtype=np.int64)
        return pages, np.concatenate(parts) if parts else np.empty((0, 6), dtype=np.int64)

    def _group_row_shapes(self, g: CacheGroup) -> tuple[tuple[Any, ...], ...]:
        """The group's layers by row shape, for :meth:`_tables`: ``(rows, row_width,
        row_stride, page_bytes)`` and, per layer of that shape, as ``(1, layers, 1)`` arrays:
        the offset of its block 0's part in the KV buffer, its block stride, and the bytes
        before its pages in a one-block object (a layer's pages in an n-block object start
        n times that far in)."""
        by_shape: dict[tuple[int, int, int, int], list[tuple[int, int, int]]] = {}
        before = 0
        for part in g.layers:
            lp = self._layers[part.name]
            by_shape.setdefault((part.rows, part.row_width, part.row_stride, part.page_bytes), []).append(
                (lp.base + part.row_offset, lp.block_stride, before))
            before += part.page_bytes
        return tuple((*shape, *(np.array(col, dtype=np.int64).reshape(1, -1, 1) for col in zip(*layers)))
                     for shape, layers in by_shape.items())

    def write_verified(self, group_id: int, block_ids: list[int | None], payload: bytes | memoryview,
                       prefix: bytes, expected: bytes, hasher: Executor | None = None) -> bool:
        """:meth:`write`, verifying the object's checksum in the same pass: whether the
        XXH3-128 of ``prefix`` then ``payload`` (:func:`cache_server.protocol.checksum`) is
        ``expected``. On a mismatch the pages written hold bytes that are not the object's:
        the caller must fail the load (vLLM then recomputes them).

        For a payload read in place that the server did not check when it placed it (the
        server's arena, :mod:`cache_server.arena`; checked ones are copied with :meth:`write`)
        this is the only pass over its bytes: the object is walked in its own order in pieces of
        :data:`VERIFY_PIECE_BYTES` (small pages gathered, large ones split), each hashed and
        then copied to its pages while it is in cache (:func:`copy_table`: one copy per page or
        part of one). Measured here (2 loaded cores, 1 MiB of L2 per core): 512 KiB pieces 7-8 GB/s
        against 5-7 for 128 KiB and 1 MiB, and a single-threaded glibc memmove of the same
        bytes 9-12 GB/s. On an
        accelerator, or for pages that are parts of rows, the object is hashed whole, then
        written.

        With ``hasher`` (a one-thread executor: the caller passes one where
        :data:`NON_TEMPORAL_PAGES`), the object is hashed whole on that thread while this
        one copies its pages (:meth:`_copy`): measured with glibc's streaming memmove
        (``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x40000``), page copies alone
        11.2-11.5 GB/s and copies with the concurrent hash 12.5-14.2 GB/s against 13.0-13.3
        for one memmove of the same bytes (and 7.6-8.0 for the pieces above); copies that go
        through the cache are slowed by the concurrent hash (4.4-4.9 GB/s)."""
        g = self._groups[group_id]
        expected_bytes = g.object_bytes(len(block_ids))
        if len(payload) != expected_bytes:
            raise ValueError(f"group {group_id}: object of {len(payload)} bytes, expected {expected_bytes}")
        h = xxhash.xxh3_128(prefix)
        if self._raw.device.type != "cpu" or any(part.rows > 1 for part in g.layers):
            # On an accelerator the page copies are queued first (a DMA straight from the
            # arena's pages once it is page-locked: CacheClient.register_arena_cuda), and the
            # CPU hashes the same bytes while they run.
            self.write(group_id, block_ids, payload, wait=False)
            h.update(payload)
            self._synchronize()
            return h.digest() == expected
        src = _bytes_view(payload)
        src_addr = _address(src)
        raw_addr = self._raw.data_ptr()
        if hasher is not None:
            digest = hasher.submit(_digest, h, src)
            self._copy([(group_id, block_ids, src_addr)])
            return digest.result() == expected
        piece = VERIFY_PIECE_BYTES
        pos = start = 0  # the object's bytes [start, pos) are the piece being gathered
        pages: list[tuple[int, int, int]] = []  # its copies: (destination, source, bytes)
        for part in g.layers:
            lp = self._layers[part.name]
            dst0 = raw_addr + lp.base + part.row_offset
            for b in block_ids:
                n = part.page_bytes
                dst = None if b is None else dst0 + b * lp.block_stride
                while n:  # a page larger than a piece is split: each piece is hashed, then copied
                    k = min(n, start + piece - pos)
                    if dst is not None:
                        pages.append((dst, src_addr + pos, k))
                        dst += k
                    pos += k
                    n -= k
                    if pos - start >= piece:
                        h.update(src[start:pos])
                        copy_table(np.array(pages, dtype=np.int64).reshape(-1, 3))
                        pages.clear()
                        start = pos
        if pos > start:
            h.update(src[start:pos])
            copy_table(np.array(pages, dtype=np.int64).reshape(-1, 3))
        return h.digest() == expected

    def write_layer_page(self, layer_name: str, group_id: int, block_id: int,
                         page: bytes | memoryview) -> None:
        """Write one layer's page of one block."""
        part = next((p for p in self._groups[group_id].layers if p.name == layer_name), None)
        if part is None:
            raise ValueError(f"layer {layer_name} is not in group {group_id}")
        if len(page) != part.page_bytes:
            raise ValueError(f"page of {len(page)} bytes, expected {part.page_bytes}")
        self._page(part, block_id).copy_(_as_uint8(page).to(self._raw.device).view(part.rows, part.row_width))
