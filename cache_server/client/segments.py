"""The same-host half of :class:`~cache_server.client.CacheClient`: the shared-memory
segments it offers the server (:mod:`cache_server.shm` says how they are agreed), the one
it picks for each ``get`` or ``put``, and the checks of where the server placed a get's
payloads before any of them is read.

Segments are created on demand, at least ``first_bytes`` each and at most ``max_bytes``
(and :data:`~cache_server.shm.MAX_SEGMENTS_PER_CLIENT` segments) together; a segment is
busy while a request uses it or any view of a get answered through it is alive, so no
later request writes into bytes a caller still holds.

A segment is abandoned when a request through it (or its offer) times out: the server may
still be copying into it, so it is never used again, and it is detached at the next
``get``, ``put`` or ``hello`` that reaches the server (its id is known even when the offer's
answer was lost: :func:`~cache_server.shm.segment_id`). So timeouts never leave the server
mapping segments this client no longer uses.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cache_server import protocol as p
from cache_server.arena import ClientArena, map_arena
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.shm import DATA_OFFSET, MAX_SEGMENTS_PER_CLIENT, ClientSegment, align_up, boot_id, memfd_supported, segment_id

MIB = 1 << 20
MAX_ABANDONED = 256  # ids kept for detaching; older ones the server drops when idle

logger = logging.getLogger("vllm.glm_cache_client")

# Sends one request without payloads on the client's connection (its lock held) within the
# timeout (None: the client's), and returns the reply header; raises as the client does.
Request = Callable[[dict[str, Any], float | None], dict[str, Any]]


class ClientShm:
    """The segments of one client, and whether the server agreed to shared memory.

    Called with the client's lock held; :attr:`segments` lists the attached ones, newest
    last."""

    def __init__(self, url: str, enabled: bool, first_bytes: int, max_bytes: int) -> None:
        if first_bytes <= DATA_OFFSET or max_bytes < first_bytes:
            raise ValueError(f"need {DATA_OFFSET} < shm_bytes <= shm_max_bytes, got {first_bytes}, {max_bytes}")
        self._url = url
        self.host = boot_id() if enabled and memfd_supported() else None
        self.refusal: str | None = None if self.host else ("off in this client" if not enabled
                                                           else "no boot id or memfd here")
        self.agreed = False
        self.offered = False  # offered once (at hello, or at the first get/put without one)
        self._next = first_bytes  # size of the next segment (grows to what a get needed)
        self._max = max_bytes
        self.segments: list[ClientSegment] = []
        self._abandoned: list[int] = []  # ids of segments the server may still map, to detach
        self.arena: ClientArena | None = None  # the server's arena, mapped read-only (cache_server.arena)
        self.arena_nonce: bytes | None = None
        self.arena_refusal: str | None = "not offered yet"

    def offer_at_hello(self) -> ClientSegment | None:
        """The segment a hello offers (None: none to offer, or one is attached already)."""
        offer = self._offer(self._next) if self.host and not self.segments else None
        self.offered = True
        return offer

    def describe(self, seg: ClientSegment) -> dict[str, Any]:
        """The ``shm`` map offering ``seg``."""
        return seg.describe(self.host or "")

    def _offer(self, size: int) -> ClientSegment | None:
        """A new segment to offer the server, or None where /dev/shm cannot hold one."""
        try:
            return ClientSegment(size)
        except OSError as e:
            logger.info("glm-cache-server client: no shared-memory segment of %d bytes (%s); using TCP", size, e)
            return None

    def settle(self, seg: ClientSegment, answer: Any) -> bool:
        """Keep ``seg`` if the server's answer agrees, else drop it and say why (a refused
        further segment leaves those attached in use)."""
        seg.close_fd()  # mapped on both sides now, or never will be
        if isinstance(answer, dict) and isinstance(answer.get("seg"), int) and answer["seg"] > 0:
            seg.seg_id = answer["seg"]
            self.segments.append(seg)
            self._map_arena(answer.get("arena"))
            if not self.agreed:
                logger.info("glm-cache-server at %s: payloads through shared memory", self._url)
            self.agreed, self.refusal = True, None
            return True
        seg.close()
        reason = answer.get("reason") if isinstance(answer, dict) else "the server offers no shared memory"
        if self.agreed and self.segments:
            logger.info("glm-cache-server at %s: refused another shared-memory segment (%s)", self._url, reason)
            return False
        if self.agreed or self.refusal != reason:
            logger.info("glm-cache-server at %s: no shared memory (%s); payloads over TCP", self._url, reason)
        self.agreed, self.refusal = False, str(reason)
        return False

    def _map_arena(self, spec: Any) -> None:
        """Map the arena an agreed answer announces, once (a new one after a restart);
        where that fails, gets are served by copy as before."""
        nonce = spec.get("nonce") if isinstance(spec, dict) else None
        if self.arena is not None and nonce == self.arena_nonce:
            return
        arena, why = map_arena(spec)
        self.arena, self.arena_nonce = arena, (nonce if arena is not None else None)
        if why != self.arena_refusal:
            if arena is not None:
                logger.info("glm-cache-server at %s: gets read its arena in place", self._url)
            else:
                logger.info("glm-cache-server at %s: no arena (%s); gets are served by copy", self._url, why)
        self.arena_refusal = why

    def _attach(self, size: int, request: Request, timeout_s: float | None) -> ClientSegment | None:
        seg = self._offer(size)
        if seg is None:
            return None
        try:
            reply = request({"op": "shm_attach", "shm": self.describe(seg)}, timeout_s)
        except CacheServerError as e:  # a server without the op: frames it is
            self.settle(seg, {"reason": f"{e.code}: {e.message}"})
            return None
        except BaseException:  # no answer in time: the server may have mapped it all the same
            self.abandon(seg)
            if not self.agreed:
                self.offered = False  # not a refusal: offer again at the next transfer
            raise
        return seg if self.settle(seg, reply.get("shm")) else None

    def abandon(self, seg: ClientSegment) -> None:
        """Never use ``seg`` again, and detach it from the server at the next chance (the
        server may still be writing into it: its request, or its offer, timed out)."""
        seg.close()
        self._abandoned.append(seg.seg_id if seg.seg_id is not None else segment_id(seg.nonce))
        del self._abandoned[:-MAX_ABANDONED]

    def flush(self, request: Request, timeout_s: float | None) -> None:
        """Detach the abandoned segments (raises as the client does when the server does
        not answer: they stay to be detached next time)."""
        while self._abandoned:
            try:
                request({"op": "shm_detach", "seg": self._abandoned[0]}, timeout_s)
            except CacheServerError:
                pass  # a server without the op, or one that forgot it: nothing mapped there
            self._abandoned.pop(0)

    def segment(self, need: int, request: Request, timeout_s: float | None) -> ClientSegment | None:
        """A free attached segment with ``need`` bytes of room (``need`` 0: a get, which
        prefers one of the size gets have needed), attaching a new one within
        ``max_bytes``; None: use frames. Detaches what was abandoned first."""
        self.flush(request, timeout_s)
        if not self.agreed:
            if self.host is None or self.offered:
                return None
            # Never said hello (a worker-side client): offer shared memory once, now.
            self.offered = True
            if self._attach(self._next, request, timeout_s) is None:
                return None
        want = max(need, self._next - DATA_OFFSET)
        free = [s for s in self.segments if not s.busy]
        fits = [s for s in free if s.capacity >= want]
        if fits:
            return min(fits, key=lambda s: s.capacity)
        size = max(self._next, -(-(want + DATA_OFFSET) // MIB) * MIB)

        def room() -> bool:  # within our bytes, and within the segments the server maps for one client
            return sum(s.size for s in self.segments) + size <= self._max \
                and len(self.segments) < MAX_SEGMENTS_PER_CLIENT

        for small in sorted(free, key=lambda s: s.capacity):  # retire free ones too small to make room
            if room():
                break
            self._detach(small, request, timeout_s)
        if room():
            seg = self._attach(size, request, timeout_s)
            if seg is not None:
                return seg
        free = [s for s in self.segments if not s.busy and s.capacity >= need]
        return max(free, key=lambda s: s.capacity) if free else None

    def _detach(self, seg: ClientSegment, request: Request, timeout_s: float | None) -> None:
        self.segments.remove(seg)
        self.abandon(seg)  # detached now, or at the next chance if this times out
        self.flush(request, timeout_s)

    def detach_all(self, request: Request, timeout_s: float) -> None:
        """Let the server unmap every segment now rather than when idle (a client closing),
        the abandoned ones included; stops at the first failure."""
        for seg in list(self.segments):
            self.segments.remove(seg)
            self.abandon(seg)
        try:
            self.flush(request, timeout_s)
        except CacheServerUnavailable:
            pass

    def drop(self) -> None:
        """Stop using every segment (after a timeout the server may still be writing into
        them, or it has dropped them); they are detached at the next chance."""
        for seg in self.segments:
            self.abandon(seg)
        self.segments = []

    def retry(self, e: CacheServerError) -> bool:
        """After ``shm_unknown`` (the server dropped our segment or restarted): forget every
        segment (new ones are attached on demand) and say the request should be repeated."""
        if e.code != p.ErrorCode.SHM_UNKNOWN.value:
            return False
        self.drop()
        return True

    def place(self, seg: ClientSegment, reply: dict[str, Any], frames: list[memoryview]) -> list[memoryview]:
        """The payloads of a get answered through ``seg``, in order: views of the segment
        (which stays busy until the last of them is gone) and the frames of what did not fit."""
        places = reply.get("shm")
        found = reply.get("found")
        if not isinstance(places, list) or not isinstance(found, list) or len(places) != sum(map(bool, found)) \
                or sum(x is None for x in places) != len(frames):
            raise CacheServerError("bad_reply", "get through shared memory answered a malformed placement")
        end = max([off + n for off, n in (x for x in places if x is not None)], default=0)
        if end > seg.size or any(x is not None and (x[0] < DATA_OFFSET or x[1] < 0) for x in places):
            raise CacheServerError("bad_reply", "get through shared memory placed an object outside the region")
        # Every view this get returns hangs off this one array (made from the mapping itself, so
        # numpy does not collapse their base past it): the segment is busy while any lives.
        holder = seg.mapping.array()
        out, it = [], iter(frames)
        for x in places:
            out.append(next(it) if x is None else memoryview(holder[x[0]:x[0] + x[1]]))
        overflow = sum(memoryview(f).nbytes for f in frames)
        if overflow:  # some objects did not fit: make the next segment large enough for all of them
            total = (end - DATA_OFFSET) + overflow + 64 * len(places)
            self._next = min(self._max, max(self._next, -(-(total + DATA_OFFSET) // MIB) * MIB))
        if end:
            weakref.finalize(holder, _set_free, seg)
        else:
            seg.busy = False
        return out


def get_region(seg: ClientSegment) -> dict[str, Any]:
    """The ``shm`` map of a get answered into ``seg``: all of its payload bytes."""
    return {"seg": seg.seg_id, "off": DATA_OFFSET, "len": seg.capacity}


def write_payloads(seg: ClientSegment, payloads: Sequence[memoryview]) -> dict[str, Any]:
    """Copy ``payloads`` into ``seg`` one after another, each on an aligned offset; the
    ``shm`` map of the put that names where they lie."""
    at, cursor = [], DATA_OFFSET
    for v in payloads:
        if v.nbytes:
            np.copyto(seg.view[cursor:cursor + v.nbytes], np.frombuffer(v, dtype=np.uint8))
        at += (cursor, v.nbytes)  # packed below: one bin, not an array
        cursor = align_up(cursor + v.nbytes)
    return {"seg": seg.seg_id, "at": np.asarray(at, dtype="<u8").tobytes()}


def _set_free(seg: ClientSegment) -> None:
    seg.busy = False
