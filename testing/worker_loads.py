"""Waiting on a worker-side load the way vLLM does: through ``get_transfer_results``."""

from __future__ import annotations

import time
from typing import Any


def wait_load(worker: Any, req_id: str, timeout_s: float = 30.0) -> bool:
    """True when ``worker`` (a ``connector.worker.WorkerSide``) reports ``req_id``'s load
    finished, False when it reports it failed; AssertionError if it never reports."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = worker.get_transfer_results()
        if req_id in r.finished_recving:
            return req_id not in r.failed_recving
        time.sleep(0.005)
    raise AssertionError("load never reported")
