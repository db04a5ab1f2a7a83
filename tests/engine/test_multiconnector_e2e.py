"""GlmCacheConnector composed with another of vLLM's connectors by vLLM's ``MultiConnector``
(issue 34, item 4), in both orders, on the CPU build.

The other connector is vLLM's ``NixlConnector`` with ``kv_buffer_device: cpu``: on vLLM
0.32 it is the one of vLLM's connectors that both runs on the CPU platform and supports
the hybrid KV cache manager (``SupportsHMA``), which a hybrid model needs and which
``MultiConnector`` grants only when every child has it (``all_children_support_hma``).
The others fail on this build (see docs/pd-composition.md): ``ExampleConnector`` is not
HMA, ``OffloadingConnector`` refuses non-CUDA platforms, ``SimpleCPUOffloadConnector``
and ``ExampleHiddenStatesConnector`` create CUDA streams, ``DecodeBenchConnector`` fills
the cache with dummy values. NIXL is not a dependency of this project: the module is
skipped unless ``import nixl`` works (``pip install nixl nixl-cu12``; UCX runs on CPU).

Two ``vllm serve`` engines of the tiny GLM-5.3-Flash (float32, chunk 128 = vLLM's block),
one after the other, on one real glm-cache-server:

* ``glm_first``: ``[GlmCacheConnector kv_both, NixlConnector kv_both]``;
* ``nixl_first``: ``[NixlConnector kv_both, GlmCacheConnector kv_consumer]``: each child
  gets its own ``KVTransferConfig`` (multi_connector.py builds one per entry), so ours
  runs as a decode instance (loads, never saves) beside NIXL's ``kv_both``, under a
  ``MultiConnector`` that is itself ``kv_both``.

What is shown: greedy tokens and first-token log-probs after a reload equal a cold run;
after vLLM's prefix-cache reset the resend is served from our server
(``cached_tokens`` = the strict prefix, 256 of 300); what our server stores and serves,
and what our connector counts, equal a GlmCacheConnector-alone run of the same prompt
(measured: 8 objects / 150272 bytes saved, 6 objects / 140672 bytes loaded), so neither is
doubled; vLLM counts 256 external hit tokens, not 512 (one child loads); the NIXL child
moved nothing for these requests; a ``do_remote_decode`` request on ``glm_first`` gets
NIXL's hand-off parameters and ours (``glm_handoff``, ``glm_chunks``) back, and is saved by
ours with its PD hand-off, both children acting on one request (ours answers with its own
keys only: were it to answer with vLLM's ``do_remote_*`` too, MultiConnector would raise a
key clash and the engine core die, docs/pd-composition.md). Ours as ``kv_consumer`` saves
nothing.

Module time: 129-206 s on 2 shared cores (two engine starts, one at a time).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testing.engines import random_prompt
from testing.server_process import ServerProcess
from testing.stalls import StallWatch
from validation.serving import VllmServer, complete, metric_sum, post_json, scrape_metrics

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                       reason="vLLM's NixlConnector needs NIXL: pip install nixl nixl-cu12"),
]

C = 128
N = 300
RESUMED = C * ((N - 1) // C)  # 256: the strict prefix
TOKENS = 8
PROMPT = random_prompt(N, 34)
OTHER = random_prompt(N, 35)
SALT = "composition"
# GlmCacheConnector alone (kv_both), same server flags and engine arguments, this prompt:
# what the cold run stores (4 groups x 2 chunks) and what the reload after a reset loads
# (the two attention groups' 2 chunks, the two state groups' state at 256)
SINGLE = {"saved_objects": 8, "saved_bytes": 150272, "loaded_objects": 6, "loaded_bytes": 140672}
GLM_ROLE_NIXL_FIRST = "kv_consumer"


# This module checks how the two connectors compose, not deadlines: its requests get 60 s, not
# the default 2. Its CI runs' "did not answer 'lookup' within 30.0s (connected throughout)" and
# "not reachable (no connection within 30.0s)", with the server logging the same request as
# queued 30 s (or nothing, for a connection), were the whole machine standing still for
# about 30 s (testing/stalls.py: every process's heartbeat late by the same 26-31 s at the
# same second): late on both sides, lost on neither. Twice that is what a request gets here.
TIMEOUT_S = 60.0
# A CPU that stood still this long inside a connection's wait explains it (_unreachable)
STALL_EXPLAINS_S = 10.0


RETRY_AFTER_S = 1.0  # the connector's back-off after a failed lookup (5 s by default)


def _glm(server_url: str, role: str) -> dict[str, Any]:
    return {"kv_connector": "GlmCacheConnector", "kv_role": role,
            "kv_connector_extra_config": {"server": server_url, "timeout_s": TIMEOUT_S,
                                          "retry_after_s": RETRY_AFTER_S}}


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def _multi(children: list[dict[str, Any]]) -> str:
    """The MultiConnector's config: a failed load recomputes (a child's own setting reaches
    only its copy of the config: docs/pd-composition.md)."""
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"connectors": children}})


class Snapshot:
    """The server's /status and the engine's /metrics at one moment."""

    def __init__(self, srv: ServerProcess, engine: VllmServer) -> None:
        self.server = srv.status()
        self.metrics = scrape_metrics(engine.base_url)

    def glm(self, name: str) -> float:
        return metric_sum(self.metrics, f"vllm:glm_cache_{name}_total")

    def metric(self, name: str) -> float:
        return metric_sum(self.metrics, name)


def _delta(after: Snapshot, before: Snapshot) -> dict[str, Any]:
    """What one request changed: on the server, in our connector's counters, in vLLM's."""
    s0, s1 = before.server, after.server
    return {
        "objects": s1["objects"] - s0["objects"],
        "used_bytes": s1["used_bytes"] - s0["used_bytes"],
        "puts_stored": s1["puts_stored"] - s0["puts_stored"],
        "puts_existing": s1["puts_existing"] - s0["puts_existing"],
        "stored_bytes": s1["stored_bytes_total"] - s0["stored_bytes_total"],
        "get_hits": s1["get_hits"] - s0["get_hits"],
        "served_bytes": s1["served_bytes_total"] - s0["served_bytes_total"],
        "objects_by_group": {g: n - s0["objects_by_group"].get(g, 0) for g, n in s1["objects_by_group"].items()},
        **{k: after.glm(k) - before.glm(k) for k in ("saved_objects", "saved_bytes", "loaded_objects",
                                                       "loaded_bytes", "load_failures", "save_failures")},
        "external_hits": (after.metric("vllm:external_prefix_cache_hits_total")
                          - before.metric("vllm:external_prefix_cache_hits_total")),
        "nixl_transfers": (after.metric("vllm:nixl_bytes_transferred_count")
                           - before.metric("vllm:nixl_bytes_transferred_count")),
    }


def _settled(srv: ServerProcess, engine: VllmServer, before: Snapshot, saves: int = 0,
             timeout_s: float = 120.0) -> Snapshot:
    """Once the saves have landed and been counted: the server has received at least
    ``saves`` objects since ``before`` (the request's saves travel after its response: on a
    loaded machine they land seconds later, and a second without any is no proof that none
    is coming), its stored objects and our connector's saved count agree, and all stay put
    for a second. The worker's counters reach vLLM's metrics only with a step's output: a
    save that completed after the request's last step (CI at ac6daac: a 29 s machine stall
    in the cold request) is counted at the next step, so while the server's count stands
    still above ours, a short request (nothing saved) makes one."""
    deadline = time.monotonic() + timeout_s
    last: Snapshot | None = None
    while time.monotonic() < deadline:
        snap = Snapshot(srv, engine)
        d = _delta(snap, before)
        if (last is not None and d == _delta(last, before) and d["saved_objects"] == d["puts_stored"]
                and d["puts_stored"] + d["puts_existing"] >= saves):
            return snap
        if last is not None and snap.server["puts_stored"] == last.server["puts_stored"] \
                and d["saved_objects"] < d["puts_stored"]:
            _warm_up(engine)
        last = snap
        time.sleep(1.0)
    assert last is not None
    return last


def _engine(ckpt: Any, kv_transfer_config: str, log_path: Any) -> VllmServer:
    return VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(C),
                      "--prefix-cache-retention-interval", str(C), "--dtype", "float32", "--max-num-seqs", "4",
                      kv_transfer_config=kv_transfer_config, max_model_len=4096,
                      env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, log_path=log_path)


def _warm_up(e: VllmServer) -> None:
    """One short request (no whole chunk: nothing saved or loaded): the connector looks up and
    saves only once the workers have named their weights, in the output of the first step
    after a start or a reset (connector.live_weights)."""
    complete(e.base_url, random_prompt(5, 5), max_tokens=1)


LOOKUP_COUNTERS = ("lookups_sent", "lookups_in_time", "lookups_late", "lookups_unanswered", "lease_releases_failed")


def _lookup_counts(engine: VllmServer) -> dict[str, float]:
    """The engine's lookup outcomes (connector.remote.RemoteCache.counters) on its /metrics."""
    metrics = scrape_metrics(engine.base_url)
    return {k: metric_sum(metrics, f"vllm:glm_cache_{k}_total") for k in LOOKUP_COUNTERS}


def _server_late(srv: ServerProcess) -> dict[str, float]:
    """The server's requests answered after their client's deadline, or skipped for it."""
    text = urllib.request.urlopen(srv.http_url + "/metrics", timeout=60).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "glm_cache_late_requests_total":
                key = f"{sample.labels['op']}:{sample.labels['outcome']}"
                out[key] = out.get(key, 0) + sample.value
    return out


def _unreachable(engine: VllmServer, stalls: list[tuple[int | None, float, float]]) -> list[str]:
    """The engine's log lines saying its connector could not reach the server, but for those
    whose wait a CPU of the machine standing still explains (``testing.stalls``: at least
    ``STALL_EXPLAINS_S`` of it inside the wait; its threads, or the server's, waited for the
    host to run that CPU again: CI at 51cba8a, a lookup with "no connection within 60.0s"
    while cpu 1 stood still 39 s and more, the kernel's "workqueue lockup")."""
    out = []
    for line in engine.log().splitlines():
        m = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) .*is not reachable \(no connection within ([0-9.]+)s", line)
        if m is None:
            continue
        end = datetime.datetime.strptime(f"{datetime.date.today().year}-{m[1]}", "%Y-%m-%d %H:%M:%S").timestamp() + 1
        start = end - float(m[2]) - 1  # the log's clock has whole seconds
        if not any(min(end, t + d) - max(start, t) >= STALL_EXPLAINS_S for _, t, d in stalls):
            out.append(line[-200:])
    return out


def _reload(srv: ServerProcess, e: VllmServer, before: Snapshot, retries: list[dict[str, Any]],
            reset: bool) -> tuple[Any, Snapshot, Snapshot]:
    """PROMPT resent to be served from the server (after vLLM's prefix-cache reset when
    ``reset``): the reply, and the snapshots around the attempt that counts. An attempt
    whose lookup was not answered in time (the engine's ``lookups_sent`` grew past its
    ``lookups_in_time``: a late or lost lookup, which its counters and the server's say)
    is served cold, correctly, but exercises nothing here: it is recorded in ``retries``
    and the request is sent again once a lookup is sent (after the connector's back-off);
    ``test_every_lookup_was_answered_in_time`` accounts for every such retry."""
    deadline = time.monotonic() + 120
    while True:
        if reset:
            assert e.reset_prefix_cache()
            _warm_up(e)
        counts = _lookup_counts(e)
        reply = complete(e.base_url, PROMPT, max_tokens=TOKENS, cache_salt=SALT)
        after = _settled(srv, e, before)
        d = {k: v - counts[k] for k, v in _lookup_counts(e).items()}
        if d["lookups_sent"] and d["lookups_sent"] == d["lookups_in_time"]:
            return reply, before, after
        assert time.monotonic() < deadline, f"no lookup answered in time within 120 s: {retries}"
        if d["lookups_sent"]:  # one was sent and not answered in time (none sent: in back-off)
            retries.append({"lookups": d, "cached_tokens": reply.cached_tokens, "server_late": _server_late(srv)})
        before, reset = after, True


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """Both orders, one engine at a time, on one server; what each request changed."""
    from glm5next_tiny import ensure_checkpoint

    tmp = tmp_path_factory.mktemp("multiconnector")
    ckpt = ensure_checkpoint(tmp / "glm5next-tiny")
    out: dict[str, Any] = {"late_retries": []}
    t0 = time.monotonic()
    with StallWatch() as watch, ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        # -- Glm first: it saves the cold run, then serves the resend after the reset
        e = _engine(ckpt, _multi([_glm(srv.url, "kv_both"), NIXL]), tmp / "glm_first.log")
        e.start(progress=False)
        try:
            _warm_up(e)
            s0 = Snapshot(srv, e)
            cold = complete(e.base_url, PROMPT, max_tokens=TOKENS, cache_salt=SALT)
            s1 = _settled(srv, e, s0, saves=SINGLE["saved_objects"])
            warm, s1r, s2 = _reload(srv, e, s1, out["late_retries"], reset=True)
            # NIXL's producer side on the same request our connector saves
            body = {"model": "model", "prompt": OTHER, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                    "cache_salt": SALT, "kv_transfer_params": {"do_remote_decode": True}}
            out["glm_first"] = {"cold": cold, "warm": warm, "save": _delta(s1, s0), "load": _delta(s2, s1r)}
            try:  # last on this engine: a child's failure here kills the engine core
                out["glm_first"]["handoff"] = post_json(e.base_url + "/v1/completions", body, timeout_s=300)
                chunks = RESUMED // C
                out["glm_first"]["handoff_save"] = _delta(
                    _settled(srv, e, s2, saves=SINGLE["saved_objects"] * (chunks + 1) // chunks), s2)
            except urllib.error.HTTPError as err:
                clash = [line for line in e.log().splitlines() if "Key clash" in line]
                out["glm_first"]["handoff_error"] = f"{err}: {clash[-1] if clash else e.log_tail(5)}"
            out["glm_first"]["lookups"] = _lookup_counts(e)
            out["glm_first"]["unreachable"] = _unreachable(e, watch.stalls)
        finally:
            e.stop()
        # -- NIXL first, ours a consumer: a fresh engine finds the prompt on our server
        e = _engine(ckpt, _multi([NIXL, _glm(srv.url, GLM_ROLE_NIXL_FIRST)]), tmp / "nixl_first.log")
        e.start(progress=False)
        try:
            _warm_up(e)
            s0 = Snapshot(srv, e)
            cold = complete(e.base_url, PROMPT, max_tokens=TOKENS, cache_salt="cold-nixl-first")
            s1 = _settled(srv, e, s0)  # a consumer: saves nothing
            first, s1r, s2 = _reload(srv, e, s1, out["late_retries"], reset=False)
            again, s2r, s3 = _reload(srv, e, s2, out["late_retries"], reset=True)
            out["nixl_first"] = {"cold": cold, "first": first, "again": again, "cold_delta": _delta(s1, s0),
                                 "load": _delta(s2, s1r), "load_again": _delta(s3, s2r), "lookups": _lookup_counts(e),
                                 "unreachable": _unreachable(e, watch.stalls)}
        finally:
            e.stop()
        out["server_late"] = _server_late(srv)
    out["module_s"] = time.monotonic() - t0
    print(f"\nmulticonnector: both engines and requests in {out['module_s']:.0f} s")
    return out


def _assert_same_generation(reloaded, cold) -> None:
    assert cold.cached_tokens == 0
    assert len(cold.token_ids) == TOKENS
    assert reloaded.token_ids == cold.token_ids, "continuation differs from the cold run"
    assert reloaded.token_logprobs[0] == cold.token_logprobs[0]


def _assert_single_connector_save(d: dict[str, Any], handoff: bool = False) -> None:
    """Stored once, as by GlmCacheConnector alone: one object per group per chunk (and per
    group for a PD hand-off, a chunk's size: connector.handoff)."""
    chunks = RESUMED // C + handoff
    assert d["objects"] == d["puts_stored"] == d["saved_objects"] == SINGLE["saved_objects"] * chunks // (RESUMED // C)
    assert d["used_bytes"] == d["stored_bytes"] == d["saved_bytes"] == SINGLE["saved_bytes"] * chunks // (RESUMED // C)
    assert d["puts_existing"] == 0, "an object was sent twice"
    assert set(d["objects_by_group"].values()) == {chunks}
    assert d["save_failures"] == 0


def _assert_single_connector_load(d: dict[str, Any]) -> None:
    """Loaded once, by our child only, as by GlmCacheConnector alone."""
    assert d["external_hits"] == RESUMED, "vLLM counted the external hit once per child"
    assert d["get_hits"] == d["loaded_objects"] == SINGLE["loaded_objects"]
    assert d["served_bytes"] == d["loaded_bytes"] == SINGLE["loaded_bytes"]
    assert d["load_failures"] == 0
    assert d["puts_stored"] == d["puts_existing"] == d["saved_objects"] == 0, "a reload saved again"
    assert d["nixl_transfers"] == 0


def test_glm_first_saves_once_and_serves_the_reset_resend(composed):
    r = composed["glm_first"]
    _assert_single_connector_save(r["save"])
    assert r["warm"].cached_tokens == RESUMED
    _assert_same_generation(r["warm"], r["cold"])
    _assert_single_connector_load(r["load"])


def test_glm_first_nixl_child_keeps_its_producer_side(composed):
    """NIXL (second) answers a ``do_remote_decode`` request with its hand-off (the blocks a
    decode instance would pull) while ours (first) saves the same request to the server,
    with our own hand-off: both answers reach the client, under keys that do not clash."""
    r = composed["glm_first"]
    assert "handoff_error" not in r, r.get("handoff_error")
    params = r["handoff"].get("kv_transfer_params") or {}
    assert params.get("do_remote_prefill") is True and params.get("remote_engine_id")
    assert params.get("remote_block_ids"), params
    assert params.get("glm_handoff") is True and params.get("glm_chunks") == RESUMED // C + 1
    _assert_single_connector_save(r["handoff_save"], handoff=True)


def test_nixl_first_loads_from_glm_once(composed):
    """NIXL, asked first, matches nothing; ours is asked next and loads from the server
    what the first engine saved: a fresh engine, so no local prefix cache helped."""
    r = composed["nixl_first"]
    assert r["first"].cached_tokens == RESUMED
    _assert_same_generation(r["first"], r["cold"])
    _assert_single_connector_load(r["load"])
    # and again after vLLM's prefix-cache reset
    assert r["again"].cached_tokens == RESUMED
    _assert_same_generation(r["again"], r["cold"])
    _assert_single_connector_load(r["load_again"])


def test_nixl_first_glm_child_keeps_its_consumer_role(composed):
    """Ours is ``kv_consumer`` inside a ``kv_both`` MultiConnector: its cold request (a
    miss) saved nothing, while NIXL beside it is ``kv_both``."""
    d = composed["nixl_first"]["cold_delta"]
    assert composed["nixl_first"]["cold"].cached_tokens == 0
    assert d["get_hits"] == 0 and d["loaded_objects"] == 0
    assert d["objects"] == d["puts_stored"] == d["saved_objects"] == 0, "a kv_consumer child saved"


def test_both_orders_generate_alike(composed):
    """The two engines' cold runs agree (the same model, greedy, one request at a time)."""
    assert composed["nixl_first"]["cold"].token_ids == composed["glm_first"]["cold"].token_ids
    assert composed["nixl_first"]["cold"].token_logprobs[0] == composed["glm_first"]["cold"].token_logprobs[0]


def test_every_lookup_was_answered_in_time(composed):
    """Each engine's lookups were all answered within their deadline: none late (the
    server answered, or skipped, it after the engine gave up), none unanswered (lost), and
    the server counted no late request. CI's earlier "did not answer 'lookup'" failures of
    this module are told apart by these counters: late on the server's side or lost. A
    reload whose lookup was not answered in time was sent again (``_reload``): each such
    retry must be a lookup the server counted late (it reached the server after the
    engine's deadline), never a lost one."""
    report = {name: composed[name]["lookups"] for name in ("glm_first", "nixl_first")}
    retries = composed["late_retries"]
    late_on_server = sum(v for k, v in composed["server_late"].items() if k.startswith("lookup:"))
    for name, counts in report.items():
        assert counts["lookups_sent"] > 0, report
        assert counts["lookups_unanswered"] == 0, ("lost", name, report, composed["server_late"], retries)
        assert not composed[name]["unreachable"], (name, composed[name]["unreachable"])
    assert late_on_server >= len(retries), (report, composed["server_late"], retries)
    assert sum(c["lookups_late"] for c in report.values()) <= late_on_server, (report, composed["server_late"])
    if retries:
        print(f"\nmulticonnector: {len(retries)} reload(s) sent again after a late lookup: {retries}")
