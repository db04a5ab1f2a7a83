"""Routers' queries (op ``query``, :mod:`cache_server.prefix_query`) on one query thread of
their own, never on a worker that serves engines: at most :data:`MAX_WAITING_QUERIES` wait
for it (past that: ``busy``), each answered within :data:`QUERY_DEADLINE_S` or told ``busy``
(the thread still finishes it; its cost is bounded by
:data:`~cache_server.protocol.MAX_QUERY_OBJECTS` and the L2 probe's timeout). The worker
that took the request replies when it is done (:class:`cache_server.workers.Later`),
serving other requests meanwhile.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cache_server import protocol as p
from cache_server.prefix_query import PrefixQuery, parse_query
from cache_server.workers import Later, Reply

MAX_WAITING_QUERIES = 16
QUERY_DEADLINE_S = 10.0


@dataclass
class QueryJob:
    """A router's query on the query thread (a :class:`~cache_server.workers.Job`)."""

    future: Future[dict[str, Any]] | None
    deadline: float


class QueryThread:
    """The query thread of one server, answering with ``queries``."""

    def __init__(self, queries: PrefixQuery) -> None:
        self._queries = queries
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="glm-query")
        self._lock = threading.Lock()
        self._waiting = 0

    def query(self, h: dict[str, Any], _: list[memoryview]) -> Later:
        """A router's question: leases nothing. Parsed here (bounded), answered on the query
        thread (its store walk and L2 probe never hold a worker that engines' requests are
        dealt to), replied to by this worker when done."""
        q = parse_query(h)
        with self._lock:
            if self._waiting >= MAX_WAITING_QUERIES:
                raise p.ProtocolError(p.ErrorCode.BUSY, f"{self._waiting} router queries wait for the "
                                                        "server's query thread; ask again later")
            self._waiting += 1

        def run() -> dict[str, Any]:
            try:
                return self._queries.answer(q)
            finally:
                with self._lock:
                    self._waiting -= 1

        job = QueryJob(self._pool.submit(run), time.monotonic() + QUERY_DEADLINE_S)

        def finish() -> Reply:
            assert job.future is not None
            if not job.future.done():
                raise p.ProtocolError(p.ErrorCode.BUSY, f"the query was not answered within {QUERY_DEADLINE_S:.0f} s "
                                                        "(queries queue for one thread)")
            return {"result": job.future.result()}, []  # its ProtocolError, if any, is the reply

        return Later(job, finish)

    def status(self) -> dict[str, Any]:
        """The ``queries`` part of /status."""
        with self._lock:
            return {"waiting": self._waiting, "max_waiting": MAX_WAITING_QUERIES, "deadline_s": QUERY_DEADLINE_S}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
