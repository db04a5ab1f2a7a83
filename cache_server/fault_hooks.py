"""The server's fault hooks (``--debug-fault-hooks``, tests only): ops that break it on
demand, for tests of what survives. ``debug_corrupt`` flips a byte of a stored object,
keeping its checksum (bit rot, which cannot be caused otherwise); ``debug_die_on`` arms a
SIGKILL of the server when the next request of an op arrives (a crash mid-transfer).
Without the flag both ops are unknown.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from cache_server import protocol as p
from cache_server.workers import Reply

if TYPE_CHECKING:
    from cache_server.arena import Arena
    from cache_server.store import ObjectStore

logger = logging.getLogger("glm_cache_server")


class FaultHooks:
    """The two ops over ``store`` and its ``arena`` (None: none), and the armed SIGKILL."""

    def __init__(self, enabled: bool, store: ObjectStore, arena: Arena | None) -> None:
        self.enabled = enabled
        self._store = store
        self._arena = arena
        self._die_on: str | None = None

    def die_if_armed(self, op: str) -> None:
        """SIGKILL this process if ``op`` is the one armed: mid-request, as kill -9 would."""
        if op == self._die_on:
            os.kill(os.getpid(), signal.SIGKILL)

    def corrupt(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        """Flip one byte of a stored object, keeping its checksum: bit rot on demand."""
        if not self.enabled:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP, "debug_corrupt needs --debug-fault-hooks")
        ns = p.namespace_field(h)
        keys = p.key_list(h)
        if len(keys) != 1:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "debug_corrupt takes exactly one key")
        key = keys[0]
        offset = p.int_field(h, "offset", minimum=0, default=0)
        found = self._store.get_with_checksum((ns, *key))
        if found is None or not memoryview(found[0]).nbytes:  # nothing to flip
            return {"corrupted": False}, []
        if self._arena is not None and self._arena.offset_of(found[0]) is not None:  # in place, in the arena
            view = found[0]
            view[offset % view.nbytes] ^= 0xFF
            self._arena.written(view)  # readers verify it again, and find the flip
            logger.warning("debug fault hook: flipped byte %d of an arena object in namespace %r",
                           offset % view.nbytes, ns)
            return {"corrupted": True}, []
        data = bytearray(found[0])
        data[offset % len(data)] ^= 0xFF
        self._store.delete((ns, *key))
        self._store.put((ns, *key), bytes(data), None, found[1])
        logger.warning("debug fault hook: flipped byte %d of an object in namespace %r", offset % len(data), ns)
        return {"corrupted": True}, []

    def die_on(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        """Arm a SIGKILL of this process when the next request of ``op`` arrives (before it is
        answered): a crash during a load (``get``) or a save (``put``), on demand."""
        if not self.enabled:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP, "debug_die_on needs --debug-fault-hooks")
        op = p.str_field(h, "on", p.MAX_NAME_CHARS)
        if op not in ("get", "put", "lookup"):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "on must be get, put or lookup")
        self._die_on = op
        logger.warning("debug fault hook: this server will SIGKILL itself on the next %s", op)
        return {"armed": op}, []
