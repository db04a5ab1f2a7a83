"""Times a CPU of the machine stood still, seen from one idle thread pinned to each CPU.

On the 2-core VMs this project is built and tested on, the host sometimes stops running the
VM's CPUs. Two shapes were measured:

* every process stops at the same instant for about 30 s (26.2, 28.9, 30.4 s within ten
  minutes; heartbeat threads of the cache server, the test process and an unrelated script
  all late by the same amount at the same second);
* one CPU stops for minutes while the other runs (CI at 226d1d6: the kernel logged
  "workqueue lockup - pool cpus=1 ... stuck for 100s" and an RCU stall on the other CPU;
  the soak's loads on threads pinned to that CPU stood still for 7 minutes, then failed at
  once with their deadlines long past, while the engines' unpinned threads kept stepping).

A request in flight then is late on both sides: the client's deadline has passed when it
runs again, and the server takes the request late (``glm_cache_late_requests_total``).
Nothing in the product can tell that from a slow server; a thread that only sleeps can, so
the test run records them and prints them beside its failures (``tests/conftest.py``), and
the soak reports them with its figures and waits out a CPU that stands still
(:meth:`StallWatch.standing_still`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

STALL_S = 5.0  # a 0.1 s sleep that returns this late is the machine, not this thread


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread
        except OSError:  # a CPU taken away meanwhile: watch from wherever we run
            pass


class StallWatch:
    """One daemon thread per CPU (``cpus``; default: those this process may use), each
    pinned there and sleeping ``interval_s`` at a time. A wake-up more than ``stall_s``
    after the previous one is a stall of that CPU: ``(cpu, wall-clock start, seconds)`` in
    :attr:`stalls`. A thread that cannot be pinned (``cpus`` ``[None]``) watches the
    machine as a whole."""

    def __init__(self, stall_s: float = STALL_S, interval_s: float = 0.1, cpus: list[int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time) -> None:
        self.stall_s, self.interval_s = stall_s, interval_s
        self._clock, self._sleep, self._wall = clock, sleep, wall
        self.cpus: list[int | None] = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
        self.stalls: list[tuple[int | None, float, float]] = []
        self._beats: dict[int | None, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.run, args=(cpu,), name=f"stall-watch-{cpu}", daemon=True)
                         for cpu in self.cpus]

    def start(self) -> StallWatch:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(5)

    def __enter__(self) -> StallWatch:
        return self if self._threads[0].is_alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, cpu: int | None = None) -> None:
        _pin(cpu)
        last = self._clock()
        self._beats[cpu] = last
        while not self._stop.is_set():
            self._sleep(self.interval_s)
            now = self._clock()
            if now - last > self.stall_s:
                with self._lock:
                    self.stalls.append((cpu, self._wall() - (now - last), now - last))
            last = self._beats[cpu] = now

    def standing_still(self) -> list[int | None]:
        """The CPUs whose watcher is late now: a thread that runs there (or is pinned there)
        runs again only when the host runs that CPU again."""
        now = self._clock()
        return [cpu for cpu, beat in list(self._beats.items()) if now - beat > self.stall_s]

    @staticmethod
    def describe(stalls: list[tuple[int | None, float, float]]) -> str:
        """Per CPU, each stall's start (UTC) and length; ``none`` without any."""
        by_cpu: dict[int | None, list[str]] = {}
        for cpu, start, length in stalls:
            by_cpu.setdefault(cpu, []).append(f"{time.strftime('%H:%M:%S', time.gmtime(start))} UTC "
                                              f"for {length:.1f} s")
        return "; ".join(("the machine" if cpu is None else f"cpu {cpu}") + ": " + ", ".join(items)
                         for cpu, items in sorted(by_cpu.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))) or "none"
