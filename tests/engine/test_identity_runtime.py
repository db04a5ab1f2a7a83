"""The namespace follows the weights at run time and by flag (issue 31, item 7).

- In-place weight changes move the engine to the new weights' namespace: ``reload_weights``
  and sleep (levels 1 and 2) in a real engine (one, module-scoped); the weight transfer
  API's loading (vLLM's ``load_checkpoint_weight_patches``, what its sparse NCCL engine
  applies after the broadcast; its NCCL/IPC engines call the same ``model.load_weights`` in
  the same layerwise-reload lifecycle as ``reload_weights``) at unit level, as are the
  worker's refusals and the scheduler's moves, against a real glm-cache-server.
- ``--load-format`` values whose weights are not the model's files serve without the
  external cache.
- The plugin's numerics version is in the namespace, and a float32 forward of the tiny
  checkpoint holds it to its recorded outputs."""

from __future__ import annotations

import gc
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import glm5next_tiny
from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from connector.config import Settings
from connector.geometry import CacheGroup, Geometry, LayerPage
from connector.identity import FILE_LOAD_FORMATS, UnnamedWeights, check_weights_source, weights_digest
from connector.live_weights import LiveWeights
from connector.metadata import UNVERIFIED, GlmConnectorMetadata, GlmWorkerMeta, LoadJob, ObjectMove
from connector.namespace import model_numerics_version, numerics_version_of
from connector.worker import WorkerSide
from testing.engines import connector_engine, generate_one, random_prompt, stop_engine
from testing.sched_harness import Blocks, request, weights_dir
from testing.worker_loads import wait_load

vkv = pytest.importorskip("vllm.v1.kv_cache_interface")

C = 256  # the shared server fixture's minimum chunk (conftest.py)


# The plugin's numerics ----------------------------------------------------------------------
#
# A float32 forward of the tiny checkpoint (seed 0) on a fixed prompt of 700 tokens (past the
# 512 tokens from which the sparse-MLA indexer selects its top-k pools), through the
# plugin's model outside vLLM (glm5next_plugin.standalone). Recorded per NUMERICS_VERSION:
# the checkpoint's content digest (so a change of the checkpoint generator reads as such),
# the log-probability of the prompt's next token at NUMERICS_POSITIONS and of a few tokens
# after the last one.

NUMERICS_PROMPT = (700, 7)  # random_prompt(n, seed)
NUMERICS_POSITIONS = [0, 1, 63, 127, 255, 256, 511, 512, 600, 698]
NUMERICS_LAST_TOKENS = [0, 17, 100, 300, 511]
RECORDED = {
    1: {
        "checkpoint": "725437b289520c69e12271c1e2918374",
        "next_token": [-11.1229, -12.56214, -5.99518, -11.19895, -8.63677, -6.40912, -11.87898, -9.20737,
                       -15.42133, -11.85189],
        "last": [-9.03857, -14.92925, -9.48812, -15.82607, -12.73524],
    },
}
# float32 on x86 CPUs with and without AMX, any thread count: the same values to ~1e-5.
NUMERICS_TOL = 1e-3


@pytest.fixture(scope="module")
def numerics_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("numerics")
    glm5next_tiny.main([str(path), "--seed", "0"])
    return path


def test_the_plugins_outputs_are_those_recorded_for_its_numerics_version(numerics_checkpoint):
    """Fails when the plugin's outputs move without a new NUMERICS_VERSION: objects computed
    by the new code would otherwise share a namespace with the old code's."""
    from glm5next_plugin import NUMERICS_VERSION
    from glm5next_plugin.standalone import load_standalone

    where = f"RECORDED in {__file__}"
    assert NUMERICS_VERSION in RECORDED, (
        f"no outputs recorded for NUMERICS_VERSION {NUMERICS_VERSION}: record them ({where})")
    recorded = RECORDED[NUMERICS_VERSION]
    assert weights_digest(numerics_checkpoint) == recorded["checkpoint"], (
        f"the tiny checkpoint changed (glm5next_tiny/ writes other weights): re-record the "
        f"outputs for it ({where}); the plugin's numerics need no new version for that")
    torch.manual_seed(0)
    model = load_standalone(numerics_checkpoint)
    ids = torch.tensor(random_prompt(*NUMERICS_PROMPT))
    with torch.no_grad():
        lp = model.logprobs(ids)
    assert lp.dtype == torch.float32
    got = [lp[p, ids[p + 1]].item() for p in NUMERICS_POSITIONS] + lp[-1, NUMERICS_LAST_TOKENS].tolist()
    want = recorded["next_token"] + recorded["last"]
    err = max(abs(a - b) for a, b in zip(got, want))
    assert err <= NUMERICS_TOL, (
        f"the plugin's float32 outputs on the tiny checkpoint moved by up to {err:.2e} (tolerance {NUMERICS_TOL}) "
        f"under NUMERICS_VERSION {NUMERICS_VERSION}: bump NUMERICS_VERSION (glm5next_plugin/version.py) and "
        f"re-record ({where}); got {[round(v, 5) for v in got]}")


def test_the_numerics_version_is_in_the_namespace(sides, monkeypatch):
    """The connector reads NUMERICS_VERSION from the package of the model class vLLM
    resolves (the plugin's classes, the MTP drafter's too; vLLM's own models have none), and
    engines whose model code has another version share no namespace."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    import glm5next_plugin
    from glm5next_plugin.model import Glm5NextForConditionalGeneration
    from glm5next_plugin.mtp import Glm5NextMTPModel

    mine = f"glm5next_plugin/{glm5next_plugin.NUMERICS_VERSION}"
    assert numerics_version_of(Glm5NextForConditionalGeneration) == mine
    assert numerics_version_of(Glm5NextMTPModel) == mine
    assert numerics_version_of(Qwen3NextForCausalLM) is None
    monkeypatch.setattr(glm5next_plugin, "NUMERICS_VERSION", glm5next_plugin.NUMERICS_VERSION + 1)
    bumped = numerics_version_of(Glm5NextForConditionalGeneration)
    assert bumped != mine
    engines = [sides(), sides(numerics=mine), sides(numerics=bumped), sides(numerics=mine)]
    assert all(e.remote.usable() and e.namespace for e in engines)
    none, v1, v2, v1_again = (e.namespace for e in engines)
    assert len({none, v1, v2}) == 3 and v1_again == v1


# --load-format ------------------------------------------------------------------------------

def test_load_formats_whose_weights_are_not_the_files_serve_without_the_external_cache(sides, caplog):
    """Every loader vLLM registers is either one reading the model directory's files (named
    by their content) or refused: a benchmark engine with ``--load-format dummy`` pointed at
    a production server must not save its random-weight KV under the files' namespace."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    mc = SimpleNamespace(model=str(weights_dir()), model_weights="")
    refused = set()
    for fmt in _LOAD_FORMAT_TO_MODEL_LOADER:
        try:
            check_weights_source(mc, LoadConfig(load_format=fmt))
        except UnnamedWeights:
            refused.add(fmt)
    registered = set(_LOAD_FORMAT_TO_MODEL_LOADER)
    assert refused == registered - FILE_LOAD_FORMATS
    assert "dummy" in refused and {"tensorizer", "runai_streamer", "runai_streamer_sharded", "modelexpress",
                                   "ipc_cache"} & registered <= refused
    assert not {"auto", "safetensors", "hf", "pt"} & refused
    with pytest.raises(UnnamedWeights, match="my_loader"):  # a loader a plugin registers: not known to be the files
        check_weights_source(mc, SimpleNamespace(load_format="my_loader"))
    with pytest.raises(UnnamedWeights, match="s3://bucket/model"):  # object storage: the directory holds configs only
        check_weights_source(SimpleNamespace(model=str(weights_dir()), model_weights="s3://bucket/model"),
                             LoadConfig())

    with caplog.at_level(logging.ERROR, logger="glm_cache_connector"):
        dummy = sides(load_format="dummy")
    assert not dummy.remote.usable() and dummy.namespace == ""
    assert any("--load-format dummy: random weights" in r.getMessage()
               and "serving without the external cache" in r.getMessage() for r in caplog.records)
    named = sides()
    assert named.remote.usable() and named.namespace


# Weights at run time: the worker --------------------------------------------------------------

class _Model(nn.Module):
    """A model as vLLM's loaders drive it: ``load_weights`` by checkpoint name through each
    parameter's weight loader (vLLM's ``default_weight_loader``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            default_weight_loader(params[name], w)
            loaded.add(name)
        return loaded


def _patch(model: nn.Module, index: int, value: float) -> None:
    """One element of ``proj.weight`` set the way vLLM's sparse weight transfer does
    (``SparseNCCLWeightTransferEngine.receive_weights`` applies what it received so)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    w = model.proj.weight
    patch = CheckpointWeightPatch("proj.weight", tuple(w.shape), w.dtype, torch.tensor([value], dtype=w.dtype),
                                  torch.tensor([index], dtype=torch.int32))
    load_checkpoint_weight_patches(model, [patch])


def test_live_weights_name_what_is_in_memory():
    """A worker names its weights by content: a one-element update through the model's
    load_weights is seen at the next step (a sampled digest would miss it), restoring it
    names the start-up weights again, and equal weights have equal names (replicas updated
    alike share). A direct write bypassing load_weights is seen when the scheduler asks
    after a reset (a pause or sleep with cleared caches)."""
    torch.manual_seed(0)
    model = _Model()
    live = LiveWeights([model])
    assert live.check(0, None) is None  # nothing changed: nothing to say
    before = model.proj.weight.view(-1)[37].item()
    _patch(model, 37, before + 0.25)
    assert model.proj.weight.view(-1)[37].item() == before + 0.25
    seq, token = live.check(0, None)
    assert (seq, token is not None) == (0, True)
    assert live.check(0, token) is None  # the scheduler has it
    assert live.check(0, None) == (0, token)  # said again while the plan names other weights
    replica = _Model()
    replica.load_state_dict(model.state_dict())
    assert LiveWeights([replica]).baseline == token  # the same weights, the same name
    _patch(model, 37, before)
    assert live.check(0, token) == (0, None)  # the start-up weights again
    with torch.no_grad():
        model.proj.weight.data[0, 0] += 1.0  # storage written directly: no load_weights
    assert live.check(0, None) is None
    seq, token = live.check(1, None)  # asked after a reset
    assert seq == 1 and token not in (None, live.baseline)
    assert LiveWeights([]).check(1, None) == (1, "unnamed")  # no model to read: cannot name them
    unreadable = LiveWeights([_Model().to("meta")])  # weights with no bytes to read
    assert unreadable.baseline is None and unreadable.check(1, None) == (1, "unnamed")


NB, PAGE, BLOCK = 8, 1024, 16
NS = "weights-runtime"


def _worker(url: str, model: nn.Module) -> WorkerSide:
    """A worker side over one attention layer's pages (as vLLM places them), watching
    ``model``'s weights as it watches the engine's."""
    t = vkv.KVCacheTensor(size=NB * PAGE, layers=["a.0"], layer_stride=NB * PAGE, block_stride=PAGE, offset=0)
    config = vkv.KVCacheConfig(num_blocks=NB, kv_cache_tensors=[t], kv_cache_groups=[])
    buf = torch.zeros(NB * PAGE, dtype=torch.int8)
    views = {"a.0": torch.as_strided(buf, (NB, PAGE), (PAGE, 1), 0)}
    group = CacheGroup(0, False, BLOCK, (LayerPage("a.0", PAGE, "int8", BLOCK, BLOCK, "FullAttentionSpec"),))
    geo = Geometry((group,), (BLOCK,), BLOCK, BLOCK)
    w = WorkerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), config,
                   Settings(url=url), geo, None)
    w.register_kv_caches(views)
    assert w._live is None  # not an engine's config: nothing found to watch
    w._live = LiveWeights([model])  # what register_kv_caches finds in an engine's worker
    return w


def _objects(url: str, namespace: str | None = None) -> int:
    with CacheClient(url, timeout_s=60) as c:
        st = c.stats()
    return st["objects"] if namespace is None else st["namespaces"].get(namespace, {}).get("objects", 0)


def test_a_worker_moves_nothing_planned_for_other_weights(server):
    """After the weights changed, a step planned for the old ones (the scheduler has not
    heard yet) loads nothing (vLLM recomputes) and saves nothing, a load started before the
    change is reported failed, and the new weights' name goes back with the step's output."""
    key = b"\x07" * 32
    with CacheClient(server.url, timeout_s=60) as c:
        c.hello(NS, BLOCK, attn_groups=[0], state_groups=[])
        assert c.put(NS, [(key, 0, 0, bytes(range(256)) * (PAGE // 256))]) in (["stored"], ["exists"])
    model = _Model()
    w = _worker(server.url, model)
    try:
        load = lambda rid: LoadJob(rid, [ObjectMove(key, 0, [1])])  # noqa: E731
        w.start_load_kv(GlmConnectorMetadata(NS, loads=[load("before")]))
        assert wait_load(w, "before")  # planned for these weights: loaded
        assert w.build_connector_worker_meta() is None

        _patch(model, 3, 9.0)  # the weight transfer API, between two steps
        save = ObjectMove(b"\x08" * 32, 0, [2], parent=None, req_id="r")
        stale = GlmConnectorMetadata(NS, loads=[load("stale")], saves=[save])  # planned for the start-up weights
        held = _objects(server.url, NS)
        w.start_load_kv(stale)
        w.wait_for_save(stale)
        assert not wait_load(w, "stale")  # failed: vLLM recomputes it
        assert w.wait_for_pending_saves() and _objects(server.url, NS) == held  # nothing sent
        report = w.build_connector_worker_meta()
        assert isinstance(report, GlmWorkerMeta) and set(report.weights) == {0}
        seq, token = report.weights[0]
        assert seq == 0 and token is not None and token == w._live.token

        current = GlmConnectorMetadata(NS, loads=[load("in-flight")], weights=(token,))
        w.start_load_kv(current)  # planned for these weights ...
        _patch(model, 3, 7.0)  # ... and they change before vLLM hears the load finished
        w.start_load_kv(GlmConnectorMetadata(NS, weights=(token,)))  # the next step names them again
        assert not wait_load(w, "in-flight")
        token2 = w._live.token
        assert token2 not in (None, token)

        fresh = GlmConnectorMetadata(NS, loads=[load("fresh")], saves=[save], weights=(token2,))
        w.start_load_kv(fresh)
        w.wait_for_save(fresh)
        assert wait_load(w, "fresh")
        assert w.wait_for_pending_saves() and _objects(server.url, NS) == held + 1
        unknown = GlmConnectorMetadata(NS, loads=[load("unknown")], weights=UNVERIFIED)  # after a reset
        w.start_load_kv(unknown)
        assert not wait_load(w, "unknown")

        # vLLM 0.33's sleep hooks: woken (restore_kv_caches), the worker names its weights
        # again by itself, even where they were written without load_weights
        w.build_connector_worker_meta()
        w.unregister_kv_caches()
        with torch.no_grad():
            model.embed.weight.data[1, 2] = 5.0
        w.restore_kv_caches()
        w.start_load_kv(GlmConnectorMetadata(NS, weights=(token2,)))
        _, token3 = w.build_connector_worker_meta().weights[0]
        assert token3 not in (None, token, token2)
    finally:
        w.shutdown()


# Weights at run time: the scheduler -------------------------------------------------------------

def _report(side, reports: dict[int, tuple[int, str | None]]) -> None:
    """A step's output as vLLM hands it to the scheduler side, with the workers' weights."""
    from vllm.v1.outputs import KVConnectorOutput

    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=GlmWorkerMeta([], reports)))


def _handshake(side, limit_s: float = 10.0) -> str:
    deadline = time.monotonic() + limit_s
    while not side._ready():
        assert time.monotonic() < deadline, "no handshake"
        time.sleep(0.01)
    return side.namespace


def _admit(side, req, computed: int = 0, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    while (out := side.get_num_new_matched_tokens(req, computed))[0] is None:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.01)
    return out


def _step(side):
    from testing.sched_harness import step

    return step(side, {})


def test_the_scheduler_moves_to_the_namespace_its_workers_report(sides, server):
    """A rank's new weights move the namespace (a new handshake under it), requests under
    way are not cached further, the plan names the weights; the start-up weights name the
    start-up namespace again, and a replica whose workers report the same weights is in the
    same namespace."""
    tokens = list(range(16, 16 + 3 * C + 10))
    side, replica = sides(chunk_keys="lmcache"), sides(chunk_keys="lmcache")
    start = side.namespace
    assert start and replica.namespace == start
    blocks = Blocks().bind(side)
    under_way = request("under-way", tokens, "rt")
    assert _admit(side, under_way) == (0, False)
    side.update_state_after_alloc(under_way, blocks.allocate("under-way", 4), 0)

    _report(side, {0: (0, "d1")})
    assert side.namespace == "" and side.remote.session is None  # nothing is asked under the old name
    moved = _handshake(side)
    assert moved not in ("", start) and moved in CacheClient(server.url, timeout_s=60).stats()["namespaces"]
    assert side._requests["under-way"].bypass is not None
    meta = _step(side)
    assert meta.weights == ("d1",) and meta.namespace == moved
    assert side.get_num_new_matched_tokens(under_way, 0) == (0, False)  # never looked up again

    _report(replica, {0: (0, "d1")})
    assert _handshake(replica) == moved  # updated to the same weights: shared again
    _report(side, {0: (0, None)})
    assert _handshake(side) == start and _step(side).weights is None


def test_a_reset_keeps_the_servers_objects_and_waits_for_the_workers(sides, server):
    """vLLM's sleep and pause clear caches through reset_cache: the shared namespace keeps
    its objects (other replicas use them); until every worker has named its weights again
    nothing is looked up or saved, and the weights they name decide the namespace."""
    from testing.sched_harness import store

    side = sides(chunk_keys="lmcache")
    start = side.namespace
    tokens = list(range(16, 16 + 3 * C + 10))
    hashes = chunk_hashes(tokens, C, "reset")[:3]
    store(server.url, start, [ObjectMove(h, 1, [1], parent=p) for h, p in zip(hashes, [None, *hashes[:-1]])])
    held = _objects(server.url, start)
    assert held >= 3

    assert side.reset_cache() is True
    assert _objects(server.url, start) == held  # not cleared
    meta = _step(side)
    assert (meta.weights, meta.weights_seq, meta.saves) == (UNVERIFIED, 1, [])
    req = request("after-reset", tokens, "reset")
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # waits for the workers
    _report(side, {0: (0, None)})  # an answer to an earlier question: still waiting
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    _report(side, {0: (1, None)})  # unchanged
    assert side.namespace == start and _step(side).weights is None
    assert _admit(side, req)[0] is not None

    side.reset_cache()
    _report(side, {0: (2, "after-update")})  # a pause, then a weight update
    assert _handshake(side) not in ("", start)


def test_tp_ranks_name_their_own_shards():
    """With TP every rank names its own shard: one rank's change moves the namespace at
    once, a reset is answered only when every rank has answered it, and each rank reads its
    own token in the plan."""
    from connector.live_weights import expected_token
    from connector.weights_view import WeightsView, runtime_identity

    view = WeightsView(2)
    assert view.expected() is None and expected_token(None, 1) is None
    assert view.report({0: (0, "r0")}) == ((None, None), ("r0", None), False)
    assert view.expected() == ("r0", None) and expected_token(view.expected(), 0) == "r0"
    assert expected_token(view.expected(), 1) is None and expected_token(view.expected(), 2) == UNVERIFIED
    view.reset()
    assert view.expected() == UNVERIFIED and expected_token(UNVERIFIED, 0) == UNVERIFIED
    assert view.report({0: (1, "r0")}) is None  # rank 1 has not answered
    assert view.report({1: (1, "r1")}) == (("r0", None), ("r0", "r1"), True)
    base = {"weights": "files-digest", "snapshot": None}
    assert runtime_identity(base, (None, None)) is base
    moved = runtime_identity(base, ("r0", None))
    assert moved["weights"].startswith("live:") and moved != runtime_identity(base, ("r0", "r1"))
    assert runtime_identity({"weights": "other-files", "snapshot": None}, ("r0", None)) != moved  # rank 1's files
    assert runtime_identity(base, ("r0", "unnamed")) is None


def test_after_a_change_requests_resuming_from_vllms_stale_prefix_cache_are_not_cached(sides):
    """Weights changed without a reset: vLLM's prefix cache still holds blocks of the old
    weights, so a request it resumes is served without the external cache (its saves would
    carry them into the new namespace) until vLLM resets its prefix cache; a reset between
    the change and the next step leaves nothing stale."""
    from vllm.v1.core.block_pool import BlockPool

    side = sides(chunk_keys="lmcache")
    blocks = Blocks().bind(side)
    blocks.block_pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=C)  # vLLM's own
    tokens = list(range(16, 16 + 3 * C + 10))
    _report(side, {0: (0, "reloaded")})  # reload_weights: seen by the workers, no reset
    _handshake(side)
    local = request("local-hit", tokens, "stale")
    assert _admit(side, local, computed=C) == (0, False)
    assert side._requests["local-hit"].bypass is not None
    cold = request("no-local-hit", tokens, "stale")
    _admit(side, cold, computed=0)
    assert side._requests["no-local-hit"].bypass is None  # computes everything with the new weights
    assert blocks.block_pool.reset_prefix_cache()  # LLM.reset_prefix_cache()
    later = request("after-local-reset", tokens, "stale")
    _admit(side, later, computed=C)
    assert side._requests["after-local-reset"].bypass is None

    # reload_weights, then LLM.reset_prefix_cache() before the next step: nothing it holds
    # was computed by the old weights
    _step(side)
    assert blocks.block_pool.reset_prefix_cache()
    _step(side)
    _report(side, {0: (0, "reloaded-again")})
    _handshake(side)
    resumed = request("reset-before-the-step", tokens, "stale")
    _admit(side, resumed, computed=C)
    assert side._requests["reset-before-the-step"].bypass is None


# Weights at run time: a real engine -----------------------------------------------------------

PROMPT = random_prompt(1100, 5)  # strict prefix 4 chunks: 1024 tokens


def _settle(url: str, timeout_s: float = 60.0) -> int:
    """The server's object count once background saves stopped changing it (the same in
    two reads 0.2 s apart), polled for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    seen = [_objects(url)]
    while len(seen) < 3 or seen[-1] != seen[-2]:
        assert time.monotonic() < deadline, f"the saves did not settle within {timeout_s}s: objects {seen[-3:]}"
        time.sleep(0.2)
        seen.append(_objects(url))
    return seen[-1]


def _run(llm, salt: str):
    tokens, _, cached = generate_one(llm, PROMPT, salt, 8)
    return tokens, cached


@pytest.fixture(scope="module")
def engine(tmp_path_factory, server):
    """One engine on checkpoint A (the tiny GLM, seed 3); B is another of the same shape
    (seed 4). ``A0``: the prompt's cold continuation on A, saved to the server."""
    a, b = tmp_path_factory.mktemp("weights_a"), tmp_path_factory.mktemp("weights_b")
    glm5next_tiny.main([str(a), "--seed", "3"])
    glm5next_tiny.main([str(b), "--seed", "4"])
    llm = connector_engine(a, server.url, dtype="float32", max_num_batched_tokens=C,
                           prefix_cache_retention_interval=C, seed=0)
    try:
        a0, cached = _run(llm, "w")
        assert cached == 0
        _settle(server.url)
        yield SimpleNamespace(llm=llm, a=a, b=b, a0=a0)
    finally:
        stop_engine(llm)
        del llm
        gc.collect()


@pytest.mark.engine
def test_reload_weights_moves_the_engine_to_the_new_weights_namespace(engine, server):
    """``reload_weights`` (vLLM's in-place reload, the same load_weights lifecycle its NCCL
    and IPC weight transfer engines run): the engine leaves A's namespace at once (nothing of
    A resumes under B), a request vLLM resumes from its own stale prefix cache saves none of
    those blocks, and reloading A, then B again, finds each one's objects again."""
    llm, a0 = engine.llm, engine.a0
    from glm5next_plugin import NUMERICS_VERSION

    assert model_numerics_version(llm.llm_engine.vllm_config) == f"glm5next_plugin/{NUMERICS_VERSION}"
    llm.reset_prefix_cache()
    assert _run(llm, "w") == (a0, 4 * C)  # A's objects, from the server
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.b)})
        _run(llm, "w")  # resumed from vLLM's prefix cache (A's blocks): must not be saved under B
        _settle(server.url)
        llm.reset_prefix_cache()
        b0, cached = _run(llm, "w")
        assert cached == 0  # neither A's objects nor A's blocks saved under B
        b_cold, cold_cached = _run(llm, "w-cold")
        assert cold_cached == 0 and b0 == b_cold != a0
        _settle(server.url)

        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.a)})
        llm.reset_prefix_cache()
        assert _run(llm, "w") == (a0, 4 * C)  # A again: the start-up namespace
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.b)})
        llm.reset_prefix_cache()
        assert _run(llm, "w") == (b0, 4 * C)  # B again: B's namespace, where b0 was saved
    finally:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.a)})
        llm.reset_prefix_cache()


@pytest.mark.engine
def test_sleep_keeps_the_servers_objects_and_wakes_under_the_weights_it_has(engine, server):
    """Sleep clears caches through reset_cache: the server keeps every replica's objects,
    and the engine goes on under the weights its workers name after waking. Level 1 (the
    same weights) finds A's objects; level 2 woken with other weights (reloaded while
    asleep; on CPU sleep frees nothing, the reload is what a GPU engine runs) computes with
    them and resumes nothing of A; woken with A again, A's objects."""
    llm, a0 = engine.llm, engine.a0
    held = _settle(server.url)
    llm.sleep(level=1)
    llm.wake_up()
    assert _objects(server.url) == held  # not cleared: other replicas use them
    assert _run(llm, "w") == (a0, 4 * C)
    try:
        llm.sleep(level=2)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.b)})
        llm.wake_up()
        b_ref, cached = _run(llm, "sleep-ref")
        assert cached == 0 and b_ref != a0
        assert _run(llm, "w")[0] == b_ref  # B's continuation: nothing of A's objects resumed
        llm.sleep(level=2)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.a)})
        llm.wake_up()
        assert _run(llm, "w") == (a0, 4 * C)
    finally:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.a)})
        llm.reset_prefix_cache()
