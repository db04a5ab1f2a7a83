"""Times the whole machine stood still, seen from one idle thread.

On the 2-core VMs this project is built and tested on, every process sometimes stops at the
same instant for about 30 s (measured: 26.2, 28.9, 30.4 s within ten minutes; heartbeat
threads of the cache server, the test process and an unrelated script all late by the same
amount at the same second). A request in flight then is late on both sides: the client's
deadline has passed when it runs again, and the server takes the request late (counted in
``glm_cache_late_requests_total``). Nothing in the product can tell that from a slow
server; a thread that only sleeps can, so the test run records them and prints them beside
its failures (``tests/conftest.py``), and the soak reports them with its figures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

STALL_S = 5.0  # a 0.1 s sleep that returns this late is the machine, not this thread


class StallWatch:
    """A daemon thread sleeping ``interval_s`` at a time; each wake-up more than ``stall_s``
    after the previous one is a stall: ``(wall-clock start, seconds)`` in :attr:`stalls`."""

    def __init__(self, stall_s: float = STALL_S, interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time) -> None:
        self.stall_s, self.interval_s = stall_s, interval_s
        self._clock, self._sleep, self._wall = clock, sleep, wall
        self.stalls: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def run(self) -> None:
        last = self._clock()
        while not self._stop.is_set():
            self._sleep(self.interval_s)
            now = self._clock()
            if now - last > self.stall_s:
                self.stalls.append((self._wall() - (now - last), now - last))
            last = now

    @staticmethod
    def describe(stalls: list[tuple[float, float]]) -> str:
        return ", ".join(f"{time.strftime('%H:%M:%S', time.gmtime(start))} UTC for {length:.1f} s"
                         for start, length in stalls) or "none"
