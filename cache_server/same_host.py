"""The server's same-host paths: the client segments it maps (:mod:`cache_server.shm`),
the arena same-host engines read stored objects from in place (:mod:`cache_server.arena`),
and the read pins of the gets answered there.

Here are their ops (``shm_attach``, ``shm_detach``, ``unpin``), their part of ``get`` (where
found objects go: the arena, the client's region, or frames) and of ``put`` (payloads taken
from the client's segment), their housekeeping and their /status.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_server import protocol as p
from cache_server.arena import PinTable, make_arena, pin_ids, pin_seconds, same_user_processes
from cache_server.config import ServerConfig
from cache_server.shm import SegmentTable
from cache_server.shm_payloads import GetRegion, owned_copy, put_spans
from cache_server.workers import Reply

logger = logging.getLogger("glm_cache_server")


@dataclass
class GetPlan:
    """Where a get asked its objects to go (:meth:`SameHost.begin_get`)."""

    region: GetRegion | None  # the client's region of a segment; None: frames
    want_arena: bool  # answered in place from the arena where it holds them
    pin_s: float  # how long the pins of objects answered in the arena hold


@dataclass
class PutSource:
    """Where a put's payloads lie in the client's segment (:meth:`SameHost.put_source`)."""

    view: np.ndarray
    spans: list[tuple[int, int]]  # offset and length per key

    @property
    def total(self) -> int:
        return sum(n for _, n in self.spans)


class SameHost:
    """The segments, the arena and its pins of one server. ``client()`` is the ZMQ identity
    of the request being handled (the owner of what it attaches and pins)."""

    def __init__(self, config: ServerConfig, client: Callable[[], bytes | None]) -> None:
        self._client = client
        self.segments = SegmentTable(config.shm)
        # Large objects put through shared memory live in a sealed memfd same-host engines map
        # read-only (cache_server.arena); read pins keep what a get placed there from reuse.
        self.arena, why = (None, "--no-arena") if not config.arena else \
            make_arena(config.l1_size_bytes) if self.segments.host is not None else (None, "no shm")
        if self.arena is None and config.shm:
            logger.info("no arena (%s): same-host gets are served by copy", why)
        elif self.arena is not None:
            others = same_user_processes()
            if others:
                logger.warning("the arena (stored objects of 256 KiB and more) can be read by every process of uid %d "
                               "on this host, %d of which run now (%s): run the server as a user of its own, or "
                               "with --no-arena where tenants share this host and are kept apart by cache_salt only",
                               os.getuid(), len(others), ", ".join(others[:5]))
        self.pins = PinTable()

    # --- ops -----------------------------------------------------------------------------

    def shm_attach(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        return {"shm": self.agree(p.field(h, "shm", dict))}, []

    def agree(self, spec: Any) -> dict[str, Any]:
        """Answer a segment offer (``shm_attach``, or ``hello``'s ``shm``); an agreed one also
        learns where the arena is."""
        answer = self.segments.attach(spec, self._client())
        if answer.get("seg") and self.arena is not None:
            answer["arena"] = self.arena.describe()
        return answer

    def unpin(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        return {"unpinned": self.pins.release(self._client(), pin_ids(h, "pins"))}, []

    def shm_detach(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        return {"detached": self.segments.detach(p.int_field(h, "seg", minimum=1))}, []

    # --- get and put ---------------------------------------------------------------------

    def begin_get(self, h: dict[str, Any]) -> GetPlan:
        """A get's same-host part, before the store is read: the pins of earlier gets it is
        done with (``unpin``) released, and where it asks its objects to go, checked."""
        if "unpin" in h:  # pins of earlier gets the client is done with
            self.pins.release(self._client(), pin_ids(h, "unpin"))
        want_arena = p.field(h, "arena", bool, default=False)
        pin_s = pin_seconds(h) if want_arena else 0.0
        if want_arena and "shm" not in h:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "arena placement needs the get's shm region (a client "
                                                           "whose shared memory the server agreed to)")
        # Copy what fits into the client's region; the rest goes as frames.
        region = GetRegion(self.segments, h["shm"]) if "shm" in h else None
        return GetPlan(region, want_arena, pin_s)

    def deliver(self, plan: GetPlan, hits: list[Any], reply: dict[str, Any]) -> list[Any]:
        """Answer a get's found objects ``hits`` (in order) as ``plan`` says: in place in the
        arena (pinned), else copied into the client's region while they fit; the rest are
        the payload frames returned. Says where in ``reply`` (``arena``, ``shm``)."""
        spans: list[Any] = [None] * len(hits)
        if plan.want_arena and self.arena is not None:
            spans = [self.arena.offset_of(x) for x in hits]
            pinned = [x for x, span in zip(hits, spans) if span is not None]
            client = self._client()
            pin = self.pins.grant(client, pinned, plan.pin_s, self.segments.peer_of(client)) if pinned else None
            if pin is None:  # nothing there, or past a bound: by copy
                spans = [None] * len(hits)
            reply.update(arena=[list(x) if x is not None else None for x in spans], pin=pin, pin_s=plan.pin_s,
                         arena_nonce=self.arena.nonce,
                         # verified when placed (Arena.place): the reader copies them without a hash
                         arena_checked=[x is not None and self.arena.checked(hit) for hit, x in zip(hits, spans)])
        payloads, places = [], []
        for x, span in zip(hits, spans):
            if span is not None:
                continue
            place = None if plan.region is None else plan.region.place(x)
            places.append(place)
            if place is None:
                payloads.append(x)
        if plan.region is not None:
            reply["shm"] = places  # the objects not answered in the arena, in order
            self.segments.count(get_bytes=plan.region.copied)
        return payloads

    def put_source(self, h: dict[str, Any], frames: list[memoryview], keys: int) -> PutSource | None:
        """Where a put's ``keys`` payloads lie in the client's segment; None: they come as
        frames."""
        if "shm" not in h:
            return None
        if frames:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a put through shared memory carries no payload frames")
        view = self.segments.request_view(h["shm"])
        return PutSource(view, put_spans(view, h["shm"].get("at"), keys))

    def take(self, source: PutSource, ns: str, keys: list[p.ObjectKey], sums: list[bytes]) -> list[Any]:
        """The store's own copies of a put's payloads in shared memory (the client reuses its
        segment once answered): into the arena where they go there, verified as copied."""
        frames = [owned_copy(source.view[off:off + n], self.arena, (p.key_prefix(ns, tuple(key)), s))
                  for (off, n), key, s in zip(source.spans, keys, sums)]
        self.segments.count(put_bytes=source.total)
        return frames

    # --- housekeeping --------------------------------------------------------------------

    def housekeep(self) -> None:
        """Drop idle segments and those of exited processes, the pins of connections whose
        last segment went, and expired pins (the server's main thread, once a second)."""
        self.segments.expire()
        self.segments.reap_exited()
        for owner in self.segments.take_gone():  # a connection's pins go with it
            self.pins.drop_owner(owner)
        self.pins.expire()

    def close(self) -> None:
        self.segments.close()
        self.pins.clear()
        if self.arena is not None:
            self.arena.close()

    def status(self) -> dict[str, Any]:
        """The ``shm`` part of /status."""
        status = self.segments.snapshot()
        if self.arena is not None:
            status["arena"] = {**self.arena.snapshot(), **self.pins.snapshot()}
        return status
