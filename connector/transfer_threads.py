"""The worker side's transfer threads: one thread per pool (load, fetch, hash, save), named
in the OS and, on a CPU engine, moved off the model's OpenMP cores.

vLLM's CPU backend pins a worker process to its OpenMP cores, and threads inherit their
creator's affinity: without a move, every page copy, checksum and send of the save thread
(and the ZMQ I/O thread its first request starts) preempts the model's forward on its own
core, while the cores vLLM reserves for its scheduler process and for KV connectors idle.
Where the threads go is the ``transfer_cpus`` setting (:func:`transfer_cpus`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_PR_SET_NAME = 15


def _start_thread(name: str, cpus: frozenset[int] | None) -> None:
    """Thread-pool initializer: name the thread in the OS (``top -H``,
    ``/proc/<pid>/task/*/comm``: what ``validation/bench_overhead.py`` uses to tell the
    connector's CPU time from the model's) and move it to ``cpus``. Best effort: a pool
    whose initializer raised would be broken, and both are about speed, not behaviour."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except Exception:  # noqa: BLE001 (not Linux, no libc: the name is cosmetic)
        pass
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        except (AttributeError, OSError):
            pass


def spare_cpus(allowed: set[int], model_cpus: set[int], local_workers: int) -> frozenset[int] | None:
    """Where the connector's threads should run on a CPU engine: the CPUs the engine was
    given (``allowed``, its parent process's affinity) that the model's OpenMP threads are
    not pinned to (``model_cpus``, this worker's affinity), i.e. the cores vLLM reserves
    for its scheduler process and for KV connectors. None (stay where we are) when
    nothing is spare, when nothing was pinned, or when other workers of this host hold
    some of the other CPUs (``local_workers`` > 1: we cannot tell which are theirs)."""
    if local_workers != 1 or not model_cpus or model_cpus >= allowed:
        return None
    spare = frozenset(allowed - model_cpus)
    return spare or None


def engine_spare_cpus(vllm_config: Any) -> frozenset[int] | None:
    """:func:`spare_cpus` for this worker (None off CPU engines, or where it can't be told)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        pc = vllm_config.parallel_config
        # workers of this host: this engine's, times its data-parallel engines here
        local = int(getattr(pc, "local_world_size", 1)) * max(1, int(getattr(pc, "data_parallel_size_local", 1)))
        return spare_cpus(set(os.sched_getaffinity(os.getppid())), set(os.sched_getaffinity(0)), local)
    except Exception:  # noqa: BLE001 (no affinity API, parent gone: stay where we are)
        return None


def transfer_cpus(spec: str | tuple[int, ...], vllm_config: Any) -> frozenset[int] | None:
    """Where this worker's transfer threads run by the ``transfer_cpus`` setting: "auto",
    the engine's spare CPUs (:func:`engine_spare_cpus`); "off", where they are created
    (None); else the CPUs it lists."""
    return engine_spare_cpus(vllm_config) if spec == "auto" else None if spec == "off" else frozenset(spec)


def thread_pool(name: str, cpus: frozenset[int] | None = None) -> ThreadPoolExecutor:
    """A pool of one thread called ``name``, on ``cpus`` (None: where it is created)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                              initializer=_start_thread, initargs=(name, cpus))
