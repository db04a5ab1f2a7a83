"""A hit the scheduler side cannot load as planned fails closed: no exception inside
vLLM's scheduler, and vLLM gets a load to wait for that the worker reports failed (so it
recomputes), never a request waiting for a load nobody runs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from connector.requests import Hit
from testing.sched_harness import request, scheduler_side

C = 256


def _blocks(state_null: bool, n_blocks: int = 4):
    def block(i: int, null: bool = False):
        return SimpleNamespace(block_id=0 if null else i + 1, is_null=null)

    state = [block(i, state_null) for i in range(n_blocks)]
    attn = [block(10 + i) for i in range(n_blocks)]
    return SimpleNamespace(blocks=[state, attn])


def _grid(side, chunk_size):
    """The side's session, on a grid of ``chunk_size``."""
    return replace(side._session, geometry=side._session.geometry.with_chunk_size(chunk_size))


def _allocated(side, req, hit, blocks, external):
    state = side._requests.of(req)
    state.hit = hit
    side.update_state_after_alloc(req, blocks, external)
    return side._pending_loads[-1], state


def test_a_null_state_block_at_the_resume_point_is_a_refused_load(server):
    side = scheduler_side(server.url, block=C, chunk_keys="lmcache")
    try:
        req = request("r", list(range(16, 16 + 3 * C + 5)))
        job, state = _allocated(side, req, Hit(0, 2, 0, 0, False, _grid(side, C)), _blocks(state_null=True), 2 * C)
        assert job.req_id == "r" and job.objects == [] and "no state block" in job.refused
        assert state.load_in_flight and state.loaded_tokens == 0  # vLLM waits for the report
        ok, state = _allocated(side, request("s", list(range(16, 16 + 3 * C + 5))),
                               Hit(0, 2, 0, 0, False, _grid(side, C)), _blocks(state_null=False), 2 * C)
        assert ok.refused is None and len(ok.objects) == 2 + 1 and state.loaded_tokens == 2 * C
    finally:
        side.shutdown()


def test_a_hit_of_another_grid_or_trimmed_by_vllm_is_refused(server):
    side = scheduler_side(server.url, block=C, chunk_keys="lmcache")
    try:
        tokens = list(range(16, 16 + 3 * C + 5))
        job, _ = _allocated(side, request("g", tokens), Hit(0, 1, 0, 0, False, _grid(side, 2 * C)), _blocks(False), 2 * C)
        assert "chunks of 512" in job.refused
        job, _ = _allocated(side, request("t", tokens), Hit(0, 2, 0, 0, False, _grid(side, C)), _blocks(False), C)
        assert "external tokens" in job.refused
    finally:
        side.shutdown()
