"""What a client sends cannot stop the engine or plant bytes under another image's name:
the scheduler side's request handling, on a real glm-cache-server process, with real
scheduler sides and real vLLM requests (testing/sched_harness.py).

- Per-request values (``kv_transfer_params``) are parsed once, bounded and typed; nothing a
  client sends raises, and a hook that still raises on a request's data serves that
  request without the external cache (counted, one log line a minute), never an error in
  vLLM's scheduler.
- The media ledger: with ``trust_media_ids`` false, a request's saves stop before an image
  whose identifier vLLM's caches hold for other pixels (a client's uuid), so a forged
  uuid cannot make the connector save one image's rows under another image's pixels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping

import pytest
import torch

from testing.sched_harness import Blocks, image_feature, request, step, store

C = 256  # the shared server fixture's minimum chunk (conftest.py)


def _answer(side, req, computed=0):
    first = side.get_num_new_matched_tokens(req, computed)
    if first[0] is not None:
        return first
    lookup = side._requests[req.request_id].lookup
    if lookup is not None:
        lookup.future.result()
    return side.get_num_new_matched_tokens(req, computed)


@pytest.mark.parametrize(("value", "count"), [
    (300, 300), (300.0, 300), ("300", 300), (0, 0), (10**40, 1 << 40), (10**400, 1 << 40), (1e300, 1 << 40),
    (math.inf, None), (-math.inf, None), (math.nan, None), (-5, None), (12.5, None), (True, None),
    ("1e999", None), ("x" * 10_000, None), ([1], None), ({"a": 1}, None), (None, None),
])
def test_a_clients_token_count_is_a_bounded_int_or_nothing(value, count):
    from connector.lmcache_settings import token_count

    assert token_count(value) == count


def _deep(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("params", [
    {"lmcache.max_offload_tokens": math.inf},
    {"lmcache.max_offload_tokens": _deep(5000)},
    {"lmcache.skip_load": _deep(5000)},
    {"lmcache.skip_load": "t" * 1_000_000},
    {("tuple", "key"): 1, 7: 2, "lmcache.x": [math.nan]},
    [1, 2, 3],
    "lmcache.skip_load",
    math.inf,
])
def test_request_params_never_raise(params):
    from connector.lmcache_settings import request_params

    cap, skip, _ = request_params(params)
    assert cap is None and skip is False


def test_an_infinite_offload_cap_is_not_honoured_and_the_request_is_served(sides, server):
    """Before: ``int(inf)`` raised OverflowError in get_num_new_matched_tokens and again in
    build_connector_meta, inside vLLM's scheduler (a fatal EngineCore error)."""
    side = sides()
    tokens = list(range(1000, 1000 + 3 * C + 7))
    req = request("inf", tokens, "hostile-inf", hash_block=C)
    req.kv_transfer_params = {"lmcache.max_offload_tokens": math.inf}
    assert _answer(side, req) == (0, False)
    alloc = Blocks().bind(side).allocate("inf", 4)
    side.update_state_after_alloc(req, alloc, 0)
    meta = step(side, {"inf": (0, len(tokens))})
    assert len([m for m in meta.saves if m.group_id == 1]) == 3  # saved as with no cap
    assert side.save_stats["params_ignored"] == 1 and side.save_stats["request_errors"] == 0


class _RaisingParams(Mapping):
    """A stand-in for a fault no JSON body can cause any more: reading it raises."""

    def __getitem__(self, key):
        raise RuntimeError("boom")

    def __iter__(self) -> Iterator:
        raise RuntimeError("boom")

    def __len__(self) -> int:
        return 1


def test_a_hook_that_raises_on_request_data_serves_that_request_cold_and_counts_it(sides, caplog):
    side = sides()
    tokens = list(range(5000, 5000 + 2 * C + 3))
    with caplog.at_level(logging.WARNING, logger="glm_cache_connector"):
        for i in range(3):
            req = request(f"bad{i}", tokens, "hostile-raise", hash_block=C)
            req.kv_transfer_params = _RaisingParams()
            assert side.get_num_new_matched_tokens(req, 0) == (0, False)
            alloc = Blocks().bind(side).allocate(f"bad{i}", 3)
            side.update_state_after_alloc(req, alloc, 0)
            assert step(side, {f"bad{i}": (0, len(tokens))}).saves == []  # never saved
    assert side.save_stats["request_errors"] == 3
    lines = [r for r in caplog.records if "serving it without the external cache" in r.getMessage()]
    assert len(lines) == 1  # one line a minute per hook, however many requests
    # the next request is served with the cache as usual
    good = request("good", tokens, "hostile-raise", hash_block=C)
    assert _answer(side, good) == (0, False)
    side.update_state_after_alloc(good, Blocks().bind(side).allocate("good", 3), 0)
    assert len(step(side, {"good": (0, len(tokens))}).saves) >= 2


class _RaisingBlocks:
    @property
    def blocks(self):
        raise RuntimeError("a fault inside allocation")


def test_a_failure_after_a_hit_hands_vllm_a_refused_load_so_it_recomputes(sides, server):
    """vLLM waits for a load once it was promised external tokens: an error while planning
    it must still end in a load the worker reports failed (vLLM then recomputes)."""
    side = sides()
    tokens = list(range(7000, 7000 + 3 * C + 5))
    req = request("w", tokens, "hostile-alloc", hash_block=C)
    assert _answer(side, req) == (0, False)
    alloc = Blocks().bind(side).allocate("w", 4)
    side.update_state_after_alloc(req, alloc, 0)
    offers = {"w": [(0, alloc.blocks[0][2].block_id, 3 * C)]}  # vLLM's state at the strict prefix
    assert set(store(server.url, side.namespace, step(side, {"w": (0, len(tokens))}, offers).saves)) == {"stored"}

    again = request("r", tokens, "hostile-alloc", hash_block=C)
    n, load_async = _answer(side, again)
    assert (n, load_async) == (3 * C, True)
    side.update_state_after_alloc(again, _RaisingBlocks(), n)
    (job,) = step(side, {}).loads
    assert job.req_id == "r" and job.refused and not job.objects
    assert side.save_stats["request_errors"] == 1


def test_unhonoured_param_names_said_in_the_log_are_bounded(sides, caplog):
    side = sides()
    with caplog.at_level(logging.WARNING, logger="glm_cache_connector"):
        for i in range(200):
            req = request(f"k{i}", list(range(10, 60)), None)
            req.kv_transfer_params = {f"lmcache.{'n' * 500}{i}": 1}
            side.get_num_new_matched_tokens(req, 0)
    lines = [r.getMessage() for r in caplog.records if "ignoring kv_transfer_params" in r.getMessage()]
    assert 0 < len(lines) <= 32 and len(side._rules.warned_params) <= 32
    assert max(len(line) for line in lines) < 400  # client-chosen names are cut
    assert side.save_stats["params_ignored"] >= 200  # every one counted


def test_a_local_state_resave_stops_at_the_clients_cap(sides, server):
    """vLLM resumes from its own cache where the server lost the state: the state there is
    offered again, unless the request's lmcache.max_offload_tokens ends before it."""
    tokens = list(range(20_000, 20_000 + 3 * C + 9))
    for cap, expect in ((C, 0), (None, 1)):
        side = sides()
        salt = f"hostile-cap-{cap}"
        req = request("x", tokens, salt, hash_block=C)
        if cap is not None:
            req.kv_transfer_params = {"lmcache.max_offload_tokens": cap}
        assert _answer(side, req, computed=2 * C)[0] == 0
        side.update_state_after_alloc(req, Blocks().bind(side).allocate("x", 4), 0)
        states = [m for m in side._pending_saves if m.group_id == 0]
        assert len(states) == expect, cap


# The media ledger ------------------------------------------------------------------------

PROMPT = list(range(16, 1016))  # 1000 tokens: 3 whole chunks
AT, LENGTH = 300, 64  # one image's placeholders, inside chunk 1


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(64, 1176, generator=torch.Generator().manual_seed(seed))


def _image_request(rid: str, pixels: torch.Tensor, identifier: str, salt: str):
    return request(rid, PROMPT, salt, hash_block=C, mm_features=[image_feature(identifier, AT, LENGTH, pixels)])


def _run(side, req, *, local: int = 0, encoded: bool) -> list:
    """Admit ``req`` with vLLM's local hit ``local``, then compute the rest in one step, its
    image encoded in that step or not (vLLM's encoder cache held its identifier); returns
    the attention chunks the connector plans to save."""
    rid = req.request_id
    assert _answer(side, req, computed=local)[0] == 0
    alloc = Blocks().bind(side).allocate(rid, 4)
    side.update_state_after_alloc(req, alloc, 0)
    meta = step(side, {rid: (local, len(PROMPT) - local)}, encoder_inputs={rid: [0]} if encoded else None)
    return [m for m in side._pending_saves + meta.saves if m.group_id == 1]


def test_a_forged_media_id_cannot_plant_rows_under_another_images_pixels(sides, server):
    """A (the attacker's picture) under B's identifier, encoded: A's rows are saved under A's
    pixels. B with that identifier then resumes from A's rows in vLLM's cache (and its
    encoder cache): nothing of B is saved at or after the image. Before the ledger, B's
    chunks 1 and 2 (A's rows) were saved under the keys that name B's pixels."""
    side = sides()
    salt = "hostile-plant"
    a = _image_request("a", _pixels(1), "digest-of-b", salt)
    saved_a = _run(side, a, encoded=True)
    assert len(saved_a) == 3
    assert set(store(server.url, side.namespace, saved_a)) == {"stored"}

    b = _image_request("b", _pixels(2), "digest-of-b", salt)
    assert _run(side, b, local=3 * C, encoded=False) == []  # chunk 0 is on the server already
    assert side._requests["b"].media_limit == AT
    assert side.save_stats["media_withheld"] == 1
    b_cold = _image_request("b-cold", _pixels(2), "digest-of-b", "hostile-plant-2")
    assert len(_run(side, b_cold, encoded=False)) == 1  # the text chunk before the image only


def test_the_ledger_vouches_for_one_digest_and_a_second_poisons_the_id_for_good(sides):
    side = sides()
    # the same picture under one identifier, encoded once and reused: every chunk saved
    assert len(_run(side, _image_request("p1", _pixels(3), "same-id", "hostile-v1"), encoded=True)) == 3
    assert len(_run(side, _image_request("p2", _pixels(3), "same-id", "hostile-v2"), encoded=False)) == 3
    assert len(_run(side, _image_request("p3", _pixels(3), "same-id", "hostile-v3"), local=3 * C,
                    encoded=False)) == 3
    # other pixels encoded under that identifier: it vouches for nothing from now on
    assert len(_run(side, _image_request("q", _pixels(4), "same-id", "hostile-v4"), encoded=True)) == 1
    assert len(_run(side, _image_request("p4", _pixels(3), "same-id", "hostile-v5"), encoded=False)) == 1
    assert len(_run(side, _image_request("q2", _pixels(4), "same-id", "hostile-v6"), encoded=False)) == 1
    # trusting the clients' media ids: vLLM's caches are trusted as they are
    trusting = sides(trust_media_ids=True)
    assert len(_run(trusting, _image_request("t", _pixels(5), "same-id", "hostile-v7"), encoded=False)) == 3


def test_the_ledger_is_bounded_and_forgets_into_vouching_for_nothing():
    from connector.media import MediaItem, MediaLedger

    ledger = MediaLedger(capacity=4)
    items = [MediaItem(0, 0, 1, f"id{i}", bytes([i])) for i in range(6)]
    for it in items:
        ledger.record(it.identifier, it.digest)
    assert len(ledger) == 4
    assert not ledger.vouches(items[0]) and ledger.vouches(items[5])
    ledger.record("id5", b"other")
    assert not ledger.vouches(items[5])
    ledger.record("id5", items[5].digest)
    assert not ledger.vouches(items[5])  # poisoned for good


@pytest.mark.parametrize("chunk", [float("inf"), 256.0, "256", None, True, [256], -256, 100])
def test_a_servers_odd_chunk_size_refuses_the_handshake(chunk):
    """A peer's hello: a chunk size that is not a positive integer multiple of the engine's
    block refuses the session (GeometryError, which the link treats as a failed handshake:
    serve cold, try again later) instead of raising what ``int()`` of it would."""
    from connector.config import Settings
    from connector.geometry import CacheGroup, Geometry, GeometryError, LayerPage
    from connector.remote import RemoteCache

    geo = Geometry((CacheGroup(0, False, 16, (LayerPage("a.0", 8, "float32", 16, 16, "FullAttentionSpec"),)),),
                   (16,), 16, 16)
    remote = RemoteCache(Settings(), True, 1, geo, "ns")
    try:
        with pytest.raises(GeometryError):
            remote._open({"chunk_size": chunk})
        assert remote.session is None
        assert remote._open({"chunk_size": 256}).chunk_size == 256  # the same link takes a good one
    finally:
        remote.shutdown()
