"""What a get answered, checked before the caller sees a byte: where the server placed
found objects in its arena (within it, this arena's, a pin granted for a sane time), which
of them it verified as it placed them, and every other payload against the checksum its
writer stored with it (:func:`~cache_server.protocol.checksum`, which covers the key). What
:meth:`~cache_server.client.CacheClient.get_in_place` answers is :class:`InPlace`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cache_server import protocol as p
from cache_server.arena import HEAD_BYTES as ARENA_HEAD
from cache_server.client.errors import CacheServerError

# Where a get's payload is (CacheClient._get_locked): copied to us (verified on arrival), a view
# of the server's arena the reader verifies as it copies, or one the server verified when it
# placed it there (the arena's bytes cannot change under a read pin: the reader copies it as is).
BY_COPY, IN_ARENA, IN_ARENA_CHECKED = 0, 1, 2
PIN_MARGIN_S = 1.0  # a copy under a read pin must end this long (or a tenth of the pin) before it ends


@dataclass
class InPlace:
    """What :meth:`~cache_server.client.CacheClient.get_in_place` answers: per key, its
    payload (None: absent, or it failed its checksum here), and for a view of the server's arena the key prefix
    and stored checksum the caller must verify it against (:func:`~cache_server.protocol.checksum`
    is XXH3-128 over the prefix, then the payload); the monotonic time by which those copies
    must be done, and the read pin to hand back."""

    payloads: list[memoryview | None]
    unverified: list[tuple[bytes, bytes] | None]
    deadline: float
    pin: int | None


def arena_checked(reply: dict[str, Any], spans: list[tuple[int, int] | None]) -> list[bool]:
    """Which arena placements the server verified when it placed them (its
    ``arena_checked``; a server that does not say: none)."""
    checked = reply.get("arena_checked")
    if checked is None:
        return [False] * len(spans)
    if not isinstance(checked, list) or len(checked) != len(spans) or not all(c is True or c is False
                                                                             for c in checked):
        raise CacheServerError("bad_reply", "get answered a malformed arena_checked")
    return checked


def arena_spans(reply: dict[str, Any], arena: Any, nonce: bytes | None) -> list[tuple[int, int] | None] | None:
    """Where a get's reply placed found objects in ``arena`` (None: it placed nothing
    there, e.g. a server without one); a placement outside the arena, or another
    arena's (not ``nonce``), is a bad reply."""
    spans = reply.get("arena")
    if spans is None:
        return None
    found = reply.get("found")
    granted = reply.get("pin_s")
    if not isinstance(spans, list) or not isinstance(found, list) or len(spans) != sum(map(bool, found)) \
            or reply.get("arena_nonce") != nonce \
            or not isinstance(granted, (int, float)) or isinstance(granted, bool) or not 0 <= granted <= 3600:
        raise CacheServerError("bad_reply", "get answered a malformed arena placement")
    out: list[tuple[int, int] | None] = []
    for x in spans:
        if x is None:
            out.append(None)
            continue
        if not (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
                and ARENA_HEAD <= x[0] and 0 <= x[1] and x[0] + x[1] <= arena.size):
            raise CacheServerError("bad_reply", "get placed an object outside the server's arena")
        out.append((x[0], x[1]))
    return out


def verify(namespace: str, keys: Sequence[tuple[bytes, int, int]], reply: dict[str, Any],
           frames: list[memoryview], in_arena: list[int]) -> tuple[InPlace, list[tuple[bytes, int, int]]]:
    """Check every payload not in the arena (a corrupt one is answered as absent, and
    listed second: the caller deletes it); the arena ones are the caller's to check, but
    those the server verified when it placed them (:data:`IN_ARENA_CHECKED`)."""
    found, sums = reply["found"], reply.get("sums")
    if len(found) != len(keys) or sum(found) != len(frames) or not isinstance(sums, list) \
            or len(sums) != len(frames):
        raise CacheServerError("bad_reply", f"get answered {len(frames)} payloads for {found}")
    it = iter(zip(frames, sums, in_arena))
    out: list[memoryview | None] = []
    unverified: list[tuple[bytes, bytes] | None] = []
    corrupt: list[tuple[bytes, int, int]] = []
    for key, f in zip(keys, found):
        unverified.append(None)
        if not f:
            out.append(None)
            continue
        frame, stored, arena = next(it)
        key = (key[0], key[1], key[2])
        if arena:
            out.append(frame)
            if arena != IN_ARENA_CHECKED:
                unverified[-1] = (p.key_prefix(namespace, key), stored)
        elif stored != p.checksum(frame, namespace, key):
            corrupt.append(key)
            out.append(None)
        else:
            out.append(frame)
    pin = reply.get("pin") if any(in_arena) else None
    return InPlace(out, unverified, reply.get("deadline", float("inf")) if pin else float("inf"), pin), corrupt
