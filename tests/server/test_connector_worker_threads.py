"""The worker side's transfer threads on a CPU engine: vLLM pins a worker process to its
model's OpenMP cores and threads inherit their creator's affinity, so the connector moves
its save/load/fetch threads (and, through their first request, its ZMQ I/O thread) to the
cores the engine was given but the model is not pinned to, and names them in the OS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from connector.config import Settings, cpu_setting
from connector.transfer_threads import spare_cpus, thread_pool
from testing.server_process import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spare_cpus_are_the_engines_cpus_the_model_is_not_pinned_to():
    assert spare_cpus({0, 1, 2, 3}, {0, 1}, 1) == frozenset({2, 3})
    assert spare_cpus({0, 1}, {0}, 1) == frozenset({1})
    assert spare_cpus({0, 1}, {0, 1}, 1) is None  # nothing pinned apart: stay
    assert spare_cpus({0, 1}, set(), 1) is None
    assert spare_cpus({0, 1, 2, 3}, {0}, 2) is None  # another local worker owns some of the rest


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pool_threads_are_named_and_placed():
    cpu = max(os.sched_getaffinity(0))
    pool = thread_pool("glm-save", frozenset({cpu}))

    def probe() -> tuple[str, set[int]]:
        import threading

        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip(), os.sched_getaffinity(0)

    try:
        assert pool.submit(probe).result(timeout=10) == ("glm-save", {cpu})
    finally:
        pool.shutdown()
    assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1  # the caller stays put


_CHILD = textwrap.dedent("""
    import json, os, sys
    model_cpu = int(sys.argv[2])
    os.sched_setaffinity(0, {model_cpu})  # what vLLM's CPU backend does to a worker
    import torch
    from tests.server.test_connector_worker_stream import ATTN, NB, NS, _hash, _worker
    from connector.metadata import GlmConnectorMetadata, ObjectMove
    from cache_server.client import CacheClient
    w, buf = _worker(sys.argv[1], transfer_cpus=json.loads(sys.argv[3]))  # that module's generous timeout_s
    buf.copy_(torch.randint(-100, 100, buf.shape, dtype=torch.int8))
    w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=[ObjectMove(_hash(7), ATTN, [0, 1], parent=None)]))
    assert w.wait_for_pending_saves(timeout_s=120), "the save did not complete within 120 s"
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            threads.setdefault(f.read().strip(), []).append(sorted(os.sched_getaffinity(int(tid))))
    with CacheClient(sys.argv[1], timeout_s=60) as cli:
        stored = bytes(cli.get(NS, [(_hash(7), ATTN, 0)])[0])
    expected = bytes(w._pages.read(ATTN, [0, 1]))
    print(json.dumps({"threads": threads, "main": sorted(os.sched_getaffinity(0)),
                      "saved": w.stats["saved_objects"], "same": stored == expected}))
    w.shutdown()
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("setting", ["auto", "off", "explicit"])
def test_a_pinned_worker_saves_from_the_other_cores(setting):
    """A worker process pinned like vLLM pins one (its main thread on the model's core): the
    save lands byte for byte, sent from threads on the engine's other cores ("auto"), on
    the CPUs given ("explicit"), or on the model's core ("off")."""
    allowed = sorted(os.sched_getaffinity(0))
    model_cpu, rest = allowed[0], allowed[1:]
    spec, expected = {"auto": ("auto", rest), "off": ("off", [model_cpu]),
                      "explicit": ((allowed[-1],), [allowed[-1]])}[setting]
    with ServerProcess("--separate-object-groups", "--chunk-size", "32", "--l1-size-gb", "0.05") as srv:
        out = subprocess.run([sys.executable, "-c", _CHILD, srv.url, str(model_cpu), json.dumps(spec)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["saved"] == 1 and got["same"] is True
    threads = got["threads"]
    assert threads["glm-save"] == [expected]
    assert got["main"] == [model_cpu]  # the main thread (the model's) stays on its core
    # the client's ZMQ I/O thread started from the save thread's first request: it follows
    assert threads["ZMQbg/IO/0"] == [expected]


def test_transfer_cpus_setting_is_checked_at_start_up():
    from vllm.config import KVTransferConfig

    def settings(**extra) -> Settings:
        return Settings.from_config(KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both",
                                                     kv_connector_extra_config=extra))

    assert settings().transfer_cpus == "auto"
    assert settings(transfer_cpus="1,0").transfer_cpus == (0, 1)
    with pytest.raises(ValueError, match="transfer_cpus"):
        settings(transfer_cpus="fast")
    assert cpu_setting("auto") == "auto" and cpu_setting(" Off ") == "off"
    assert cpu_setting("3,1") == (1, 3) and cpu_setting([2, 2]) == (2,)
    for bad in ("", "x", [-1], [], None):
        with pytest.raises(ValueError, match="transfer_cpus"):
            cpu_setting(bad)
