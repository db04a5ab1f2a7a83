"""A request's time against its client's deadline, on the server's side.

A client may say when it sent a request and how long it waits (``sent``, ``budget``:
:func:`cache_server.protocol.deadline_fields`). The server then knows how long the request
queued before a worker took it, skips work its client has given up on
(:data:`~cache_server.protocol.SKIPPED_WHEN_EXPIRED`), and counts and logs an answer that
came too late, releasing the lease a late lookup took. A request without a deadline is
logged when it took longer than :data:`SLOW_REQUEST_S` to handle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_server import protocol as p
from cache_server.leases import Release

if TYPE_CHECKING:
    from cache_server.metrics import ServerMetrics
    from cache_server.store import ObjectStore

logger = logging.getLogger("glm_cache_server")

# A request answered slower than this is logged: its client (2 s by default) may have given up.
# A request that says its deadline (``sent`` + ``budget``) is logged when answered after it.
SLOW_REQUEST_S = 2.0
# A client clock this far ahead of ours makes its requests' deadlines unknowable: none applied.
CLOCK_SKEW_S = 1.0


@dataclass
class Request:
    """What the reply to a request needs of it while it is being answered."""

    start: float  # time.perf_counter() when a worker took it
    arrived: float  # time.time() then
    client: bytes | None = None  # the sender's ZMQ identity
    id: Any = None
    op: str = "invalid"
    sent: float | None = None  # the client's time.time() at sending (None: it gave no deadline)
    budget: float | None = None  # seconds the client waits
    queued: float = 0.0  # from sending to a worker taking it
    expired: bool = False  # the deadline had passed when a worker took it

    def left(self) -> float:
        """Seconds to the client's deadline now (negative: past it; inf: none given)."""
        if self.sent is None or self.budget is None:
            return float("inf")
        return self.sent + self.budget - time.time()


def note_deadline(request: Request, header: dict[str, Any], metrics: ServerMetrics) -> None:
    """Read the request's ``sent`` and ``budget``: how long it waited before a worker
    took it, and whether its client has given up already (:attr:`Request.expired`)."""
    fields = p.deadline_fields(header)
    if fields is None:
        return
    sent, budget = fields
    queued = request.arrived - sent
    if queued < -CLOCK_SKEW_S:
        metrics.clock_skewed.inc()
        return
    request.sent, request.budget = sent, budget
    request.queued = max(0.0, queued)
    metrics.queued.labels(op=request.op).observe(request.queued)
    request.expired = request.left() < 0


def account_late(request: Request, took: float, reply: dict[str, Any] | None, store: ObjectStore,
                 metrics: ServerMetrics) -> None:
    """Count and log a request answered after its client's deadline, or skipped for it;
    release the lease a late lookup took (its client has given up on it: nothing else
    would release it before the TTL). Without a deadline, log one slower than
    :data:`SLOW_REQUEST_S` to handle."""
    if request.budget is None:
        if took > SLOW_REQUEST_S:
            logger.warning("%r (request %s) took %.1f s to answer", request.op, request.id, took)
        return
    if request.expired and request.op in p.SKIPPED_WHEN_EXPIRED:  # releases and deletes are done anyway
        metrics.late.labels(op=request.op, outcome="dropped").inc()
        logger.warning("%r (request %s) dropped: its client's %.1f s deadline had passed when a worker took it "
                       "(queued %.1f s)", request.op, request.id, request.budget, request.queued)
        return
    if request.queued + took <= request.budget:
        return
    metrics.late.labels(op=request.op, outcome="answered").inc()
    lease_id = reply.get("lease_id") if reply is not None else None
    released = type(lease_id) is int and store.release_from(lease_id, request.client) is Release.RELEASED
    logger.warning("%r (request %s) answered after its client's %.1f s deadline: queued %.1f s, handled %.1f s%s",
                   request.op, request.id, request.budget, request.queued, took,
                   "; its lease released" if released else "")
