"""Sleep mode (vLLM 0.33): the connector follows the KV cache's remap. The hooks are called
the way 0.33's GPU worker calls them (vllm/v1/worker/gpu_worker.py: ``sleep`` and
``discard`` call ``unregister_kv_caches`` before the memory goes, ``wake_up`` calls
``restore_kv_caches``), on the real GLM-5.3-Flash KV cache (native layout, TP 4) as vLLM
places and views it (``testing/glm_flash_kv_layouts.py``). No engine, no server: the
worker's fetches are answered in-process."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("transformers")

from cache_server.client import InPlace  # noqa: E402
from connector.config import Settings  # noqa: E402
from connector.glm_connector import GlmCacheConnector  # noqa: E402
from connector.metadata import GlmConnectorMetadata, LoadJob, ObjectMove  # noqa: E402
from connector.worker import WorkerSide  # noqa: E402
from testing import glm_flash_kv_layouts as L  # noqa: E402
from testing.worker_loads import wait_load  # noqa: E402

NS = "sleep-mode"


@pytest.fixture(scope="module")
def layout():
    built = L.build("native", 4, num_blocks=4)
    return built, L.resolve(built)


def _object(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


class _Fetches:
    """Stands in for the worker's load client: answers each key with its object, after
    ``gate`` opens; ``started`` is set when a fetch arrives."""

    def __init__(self, objects: dict[tuple[bytes, int], bytes]) -> None:
        self.objects = objects
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def get(self, namespace, keys, timeout_s=None):
        self.started.set()
        assert self.gate.wait(30)
        return [self.objects[(h, g)] for h, g, _ in keys]

    reads_in_place = False  # no arena: loads batch by batch_bytes

    def get_in_place(self, namespace, keys, timeout_s=None):  # what the worker calls: nothing in an arena
        return InPlace(self.get(namespace, keys, timeout_s), [None] * len(keys), float("inf"), None)

    def release_pin(self, pin) -> None:
        pass

    def unpin(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _worker(layout, fetches: _Fetches):
    built, geo = layout
    raw, views = L.allocate(built)
    vcfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    w = WorkerSide(vcfg, built.kv_cache_config, Settings(url="tcp://127.0.0.1:1"), geo, None)
    w._load_client.close()
    w._load_client = fetches
    w.register_kv_caches(views)  # as vLLM does once the caches are allocated
    return w, raw, views


def _page(views, name: str, block: int) -> bytes:
    return views[name][block].contiguous().view(torch.uint8).numpy().tobytes()


def test_sleep_drops_the_pages_after_inflight_loads_and_wake_up_rebuilds_them(layout):
    built, geo = layout
    latent = next(g for g in geo.groups if g.name == "mla_latent")
    state = geo.state_groups[0]
    h = b"\x01" * 32
    objects = {(h, latent.group_id): _object(latent.object_bytes(1), 1),
               (h, state.group_id): _object(state.object_bytes(1), 2)}
    job = lambda rid: LoadJob(rid, [ObjectMove(h, state.group_id, [3]),  # noqa: E731
                                    ObjectMove(h, latent.group_id, [2])])
    fetches = _Fetches(objects)
    w, raw, views = _worker(layout, fetches)
    try:
        # A load in flight when vLLM goes to sleep: unregistering waits for it, and the
        # load, finding no pages, fails (its request is recomputed) without writing.
        fetches.gate.clear()
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[job("in-flight")]))
        assert fetches.started.wait(10)
        before = raw.clone()
        sleeper = threading.Thread(target=w.unregister_kv_caches)  # GPU worker's sleep()
        sleeper.start()
        sleeper.join(0.3)
        assert sleeper.is_alive(), "unregister_kv_caches returned while a load could still write"
        fetches.gate.set()
        sleeper.join(10)
        assert not sleeper.is_alive()
        assert wait_load(w, "in-flight") is False
        assert torch.equal(raw, before)

        # Asleep: loads fail at once, saves copy nothing, a second unregister is a no-op.
        w.unregister_kv_caches()
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[job("asleep")]))
        assert wait_load(w, "asleep") is False
        w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=[ObjectMove(h, latent.group_id, [2])]))
        assert w.wait_for_pending_saves(5)
        assert torch.equal(raw, before)

        # wake_up(): the pages again, over the same tensors; a second restore changes nothing.
        w.restore_kv_caches()
        pages = w._pages
        assert pages is not None
        w.restore_kv_caches()
        assert w._pages is pages
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[job("awake")]))
        assert wait_load(w, "awake") is True
        got = b"".join(_page(views, p.name, 2) for p in latent.layers)
        assert got == objects[(h, latent.group_id)]
        got = b"".join(_page(views, p.name, 3)[: p.page_bytes] for p in state.layers)
        assert got == objects[(h, state.group_id)]
        assert pages.read(latent.group_id, [2]) == objects[(h, latent.group_id)]

        # discard(("kv_cache",)) unregisters too, and a later wake-up restores.
        w.unregister_kv_caches()
        assert w._pages is None
        w.restore_kv_caches()
        assert w._pages.read(latent.group_id, [2]) == objects[(h, latent.group_id)]
    finally:
        fetches.gate.set()
        w.shutdown()


def test_the_connector_declares_sleep_mode_and_hands_the_hooks_to_its_worker(layout):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert GlmCacheConnector.supports_sleep_mode(SimpleNamespace(kv_connector_extra_config={})) is True
    # The names are vLLM's (0.33 has them; 0.32 calls none of them).
    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        if hasattr(KVConnectorBase_V1, name):
            assert getattr(GlmCacheConnector, name) is not getattr(KVConnectorBase_V1, name), name
    calls = []
    conn = object.__new__(GlmCacheConnector)  # the worker role, without an engine to build it
    conn._scheduler = None
    conn._worker = SimpleNamespace(unregister_kv_caches=lambda: calls.append("unregister"),
                                   restore_kv_caches=lambda: calls.append("restore"))
    conn.unregister_kv_caches()
    conn.restore_kv_caches()
    assert calls == ["unregister", "restore"]
    conn._worker = None  # the scheduler role: nothing to do
    conn.unregister_kv_caches()
    conn.restore_kv_caches()
