"""The server's namespace table: which namespaces it admits (at most ``--max-namespaces``),
the chunk size each negotiated at ``hello``, the TP layout each engine declared, and their
part of /status.

A namespace is admitted by its first ``hello`` or ``put``; one only put to has no
negotiation yet. The table is bounded so that a client cannot make the server remember
any number of names: at the limit the least recently admitted namespace without objects
is forgotten, and when every one holds objects the newcomer is refused. A forgotten
namespace is gone: its negotiation, its layout here, and the store's chunk tree (with it
its series on /metrics).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from cache_server import protocol as p

if TYPE_CHECKING:
    from cache_server.metrics import ServerMetrics
    from cache_server.store import ObjectStore

logger = logging.getLogger("glm_cache_server")

Negotiation = tuple[int, int]  # (alignment, chunk size)
TpLayout = tuple[int, tuple[int, ...]]  # (world size, groups stored once for every TP rank)


class NamespaceTable:
    """Admitted namespaces with their negotiation and layout; thread-safe (workers write it,
    the HTTP thread reads it for /status)."""

    def __init__(self, store: ObjectStore, metrics: ServerMetrics, max_namespaces: int) -> None:
        self._store = store
        self._metrics = metrics
        self._max = max_namespaces
        # ns -> negotiation, or None for one only put to; least recently admitted first.
        self._chunks: OrderedDict[str, Negotiation | None] = OrderedDict()
        self._layouts: dict[str, TpLayout] = {}  # as the engine said at hello
        self._lock = threading.Lock()

    def admit(self, ns: str) -> Negotiation | None:
        """Enter ``ns`` in the table (or refresh it) and return its negotiation.
        At ``--max-namespaces`` the least recently admitted namespace without objects is
        forgotten; when every one holds objects the request is refused."""
        with self._lock:
            table = self._chunks
            if ns in table:
                table.move_to_end(ns)
                return table[ns]
            if len(table) >= self._max:
                idle = next((n for n in table if self._store.forget_namespace(n)), None)
                if idle is None:
                    self._metrics.limit_refusals.labels(limit="namespaces").inc()
                    raise p.ProtocolError(p.ErrorCode.TOO_MANY_NAMESPACES,
                                          f"{len(table)} namespaces hold objects, the maximum (--max-namespaces); "
                                          f"clear one to use {ns[:64]!r}")
                del table[idle]
                self._layouts.pop(idle, None)
                logger.info("forgot namespace %r (no objects) to admit %r", idle, ns)
            table[ns] = None
            return None

    def record_hello(self, ns: str, known: Negotiation | None, alignment: int, chunk: int,
                     min_chunk_size: int, world_size: int, replicated: list[int]) -> None:
        """What a hello settles for ``ns`` once admitted (``known``: what :meth:`admit`
        returned): its layout, and its negotiation if it had none. Another alignment than
        the one negotiated before is refused: the namespace's stored chunks follow that one."""
        with self._lock:
            self._layouts[ns] = (world_size, tuple(replicated))
        if known is None:
            with self._lock:
                self._chunks[ns] = (alignment, chunk)
            logger.info("Negotiated chunk size to %d (configured_min=%d, required_alignment=%d)",
                        chunk, min_chunk_size, alignment)
        elif known[0] != alignment:
            raise p.ProtocolError(p.ErrorCode.CONFLICT,
                                  f"namespace {ns!r} negotiated alignment {known[0]} before, now {alignment}")

    def chunk_size(self, ns: str) -> int | None:
        """The chunk size ``ns`` negotiated (None: not admitted, or only put to); touches nothing."""
        with self._lock:
            negotiation = self._chunks.get(ns)
        return None if negotiation is None else negotiation[1]

    def status(self) -> dict[str, dict[str, Any]]:
        """The ``namespaces`` part of /status."""
        with self._lock:
            table = list(self._chunks.items())
            layouts = dict(self._layouts)
        return {ns: {"alignment": ac[0] if ac else None, "chunk_size": ac[1] if ac else None,
                     "metrics_id": self._metrics.namespace_id(ns),
                     "objects": self._store.namespace_objects(ns),
                     **self._replication_status(ns, layouts.get(ns)),
                     "object_groups": self._store.group_names(ns),
                     "usable_prefixes": self._store.usable_prefixes(ns)} for ns, ac in table}

    def _replication_status(self, ns: str, layout: TpLayout | None) -> dict[str, Any]:
        """What storing the TP-replicated groups once saves in ``ns``: per-rank storage
        would hold ``world_size`` copies of each of their objects."""
        world_size, replicated = layout or (1, ())
        resident = sum(self._store.namespace_group_bytes(ns, g) for g in replicated)
        return {"world_size": world_size, "replicated_groups": list(replicated), "replicated_bytes": resident,
                "bytes_saved_by_storing_once": resident * (world_size - 1)}
