"""A request's payloads in shared memory, on the server's side: the region of a client's
segment a ``get`` copies found objects into, where a ``put``'s payloads lie, and the
store's own copy of those (the client reuses its segment as soon as the put is answered).

The segments themselves, how a client and the server agree on one, and the bounds on what
the server maps: :mod:`cache_server.shm`.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from cache_server import protocol as p
from cache_server.shm import DATA_OFFSET, SegmentTable, align_up


def request_span(view: np.ndarray, off: Any, n: Any, what: str) -> tuple[int, int]:
    """``(off, n)`` of a request, checked to lie in the data part of the segment ``view``."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, n)) or off < DATA_OFFSET \
            or n < 0 or off + n > view.nbytes:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                              f"{what} must lie within the segment, at or after byte {DATA_OFFSET}")
    return off, n


class GetRegion:
    """The region of a segment a ``get`` names: found objects are copied in, in order, each
    on an :data:`~cache_server.shm.ALIGN` boundary, while they fit."""

    def __init__(self, segments: SegmentTable, spec: Any) -> None:
        self.view = segments.request_view(spec)
        self.cursor, length = request_span(self.view, spec.get("off"), spec.get("len"), "the get region")
        self.end = self.cursor + length
        self.copied = 0  # payload bytes placed

    def place(self, payload: bytes | memoryview) -> list[int] | None:
        """Copy ``payload`` in and answer ``[offset, length]``; None if it does not fit."""
        n = memoryview(payload).nbytes
        if self.cursor + n > self.end:
            return None
        if n:  # numpy copies without the GIL
            np.copyto(self.view[self.cursor:self.cursor + n], np.frombuffer(payload, dtype=np.uint8))
        place = [self.cursor, n]
        self.cursor = align_up(self.cursor + n)
        self.copied += n
        return place


def put_spans(view: np.ndarray, at: Any, keys: int) -> list[tuple[int, int]]:
    """Where a put's ``keys`` payloads lie in ``view``, from its ``shm.at``: offset then
    length per key, little-endian uint64s in one bin. Not arrays of small integers: those
    spend an element every few header bytes, which the header bound
    (``protocol.unpack_header``) refuses for a put of more than a few dozen objects."""
    if not isinstance(at, bytes) or len(at) != 16 * keys:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                              "shm.at must be 16 bytes per key: offset and length, uint64 little-endian")
    pairs = np.frombuffer(at, dtype="<u8").reshape(-1, 2).tolist()
    return [request_span(view, off, n, f"shm.at[{i}]") for i, (off, n) in enumerate(pairs)]


class SizedSpan:
    """Stands for a payload in shared memory where only its size is checked."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


_POPULATED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
OWN_MAPPING_BYTES = 1 << 20


def owned_copy(src: np.ndarray, arena: Any = None, expect: tuple[bytes, bytes] | None = None) -> memoryview:
    """The store's own copy of a payload a client left in shared memory.

    With an ``arena`` (:class:`cache_server.arena.Arena`), one of at least
    :data:`~cache_server.arena.MIN_ARENA_BYTES` goes there when a range fits it (same-host
    engines then read it in place), verified against ``expect`` (key prefix, checksum) as
    it is copied (:meth:`~cache_server.arena.Arena.place`); otherwise, as below.

    A large one gets its own pre-faulted anonymous mapping (freed with the object). Not
    ``np.empty``: numpy asks for transparent huge pages on large arrays, and once the
    kernel has no free huge pages each allocation waits on memory compaction: measured
    here, 4 ms per 40 MB copy while they last, then 120-870 ms, against 15-25 ms for a
    pre-faulted mapping (MAP_POPULATE faults every page in one call). libc would give a
    mapping of its own too, past the server's mmap threshold (``cli``)."""
    n = src.nbytes
    if arena is not None and n >= arena.min_bytes:
        placed = arena.place(src, expect)
        if placed is not None:
            return placed
    if n < OWN_MAPPING_BYTES:
        return memoryview(src.tobytes())
    buf = mmap.mmap(-1, n, flags=_POPULATED)
    np.copyto(np.frombuffer(buf, dtype=np.uint8), src)  # without the GIL
    return memoryview(buf)
