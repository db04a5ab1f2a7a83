"""Requests whose data the connector cannot handle (handling one raised in a hook): the
scheduler side serves such a request without the external cache from then on, and says so
in at most one log line a minute per hook (:class:`ErrorLog`), so that a client sending such
requests in a loop does not flood the log. Nothing about a request may stop the engine."""

from __future__ import annotations

import time

from connector.config import logger

# A request whose data raised in a hook is logged at most once this often (per hook).
ERROR_LOG_INTERVAL_S = 60.0


class ErrorLog:
    """The log lines of requests served uncached: at most one per hook (``where``) every
    :data:`ERROR_LOG_INTERVAL_S`, which says how many were not logged since the last."""

    def __init__(self) -> None:
        self._logged_at: dict[str, float] = {}  # where -> when a request error was last logged
        self._unlogged: dict[str, int] = {}  # where -> errors since that line

    def warn(self, where: str, req_id: str, error: BaseException) -> None:
        now = time.monotonic()
        last = self._logged_at.get(where)
        if last is not None and now - last < ERROR_LOG_INTERVAL_S:
            self._unlogged[where] = self._unlogged.get(where, 0) + 1
            return
        self._logged_at[where] = now
        more = self._unlogged.pop(where, 0)
        logger.warning(
            "GlmCacheConnector: %s of request %.64s raised %s: %.200s; serving it without the external "
            "cache%s", where, req_id, type(error).__name__, str(error),
            f" ({more} more since the last such line)" if more else "", exc_info=error,
        )
