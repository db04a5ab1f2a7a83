"""A server that comes back with another chunk size: saves go on under the new grid's
keys, nothing resumes on the other grid, and reloads equal the cold runs."""

from __future__ import annotations

import time

import pytest

import glm5next_tiny
from cache_server.client import CacheClient
from testing.engines import TIMEOUT_S, connector_engine, generate_one, random_prompt, stop_engine
from testing.server_process import ServerProcess

pytestmark = pytest.mark.engine

C = 256  # the engine's block; the restarted server negotiates 2 * C
RETRY_S = 0.5


def _server(*args: str, **kw) -> ServerProcess:
    return ServerProcess("--separate-object-groups", "--l1-size-gb", "1", *args, **kw).start()


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(ids: list[int], salt: str):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids, cache_salt=salt)


def _wait_for(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s"
        time.sleep(0.02)


def test_a_chunk_size_change_mid_run_never_mixes_grids(tmp_path, capfd):
    """The server dies while a long prompt prefills and comes back with twice the chunk
    size: every output equals its cold run, the connector hands over to the new grid, and
    every reload resumes on the new grid only (a multiple of the new chunk)."""
    ckpt = tmp_path / "model"
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    first = _server("--chunk-size", str(C))
    llm = connector_engine(ckpt, first.url, dtype="float32", max_num_batched_tokens=C,
                           prefix_cache_retention_interval=C, seed=0,
                           connector={"retry_after_s": RETRY_S})  # timeout_s: engines.TIMEOUT_S (hits checked)
    second = None
    outputs: dict[str, object] = {}
    log = ""
    engine = llm.llm_engine

    def step_until(done, timeout_s: float = 60.0) -> None:
        nonlocal log
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out after {timeout_s}s"
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            captured = capfd.readouterr()
            log += captured.out + captured.err

    try:
        prompts = [random_prompt(3800, 50 + i) for i in range(3)]
        cold = [generate_one(llm, p, f"grid-cold-{i}", 8)[0] for i, p in enumerate(prompts)]
        with CacheClient(first.url, timeout_s=60) as c:
            stored = c.stats()["puts_stored"]
            engine.add_request("long-0", _prompt(prompts[0], "grid-0"), _params(8))
            _wait_for(lambda: c.stats()["puts_stored"] > stored)  # it prefills, saving chunks of C
        first.kill()
        # A lookup against the dead server fails: the link backs off and forgets the handshake.
        engine.add_request("probe", _prompt(random_prompt(700, 6), "grid-probe"), _params(1))
        # after timeout_s: no answer from the dead server
        step_until(lambda: "lookup failed" in log, timeout_s=TIMEOUT_S + 120)
        second = _server("--chunk-size", str(2 * C), port=first.port, http_port=first.http_port)
        time.sleep(RETRY_S + 0.2)
        for i in (1, 2):
            engine.add_request(f"long-{i}", _prompt(prompts[i], f"grid-{i}"), _params(8))
        step_until(lambda: {"long-0", "long-1", "long-2", "probe"} <= outputs.keys(), timeout_s=120)
        assert f"now negotiates chunk size {2 * C} (was {C})" in log
        for i in range(3):
            assert list(outputs[f"long-{i}"].outputs[0].token_ids) == cold[i], i

        llm.reset_prefix_cache()
        hits = []
        for i, p in enumerate(prompts):
            reloaded, _, cached = generate_one(llm, p, f"grid-{i}", 8)
            assert reloaded == cold[i], i
            assert cached % (2 * C) == 0, (i, cached)  # never a resume on the old grid
            hits.append(cached)
        assert max(hits) == 2 * C * ((3800 - 1) // (2 * C))  # the new grid's saves resume
    finally:
        stop_engine(llm)
        first.stop()
        if second is not None:
            second.stop()
