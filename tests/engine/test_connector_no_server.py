"""GlmCacheConnector with glm-cache-server absent at engine start-up: vLLM starts, answers
every request cold (equal outputs, no stall), and picks the server up once it appears.

Its own engine (the other module's engine has a live server from the start)."""

from __future__ import annotations

import random
import time

import pytest

from cache_server.client import CacheClient
from testing.engines import connector_engine, stop_engine
from testing.server_process import ServerProcess, free_port
from testing.tiny_qwen3_next import BLOCK_SIZE, make_tiny_qwen3_next

pytestmark = pytest.mark.engine

RETRY_S = 2.0
TIMEOUT_S = 5.0  # the connector's: what an absent server costs at start-up and on the first lookup
HIT_TRIES = 5  # a reload that missed only because a stall made its save or lookup late is tried again


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2048) for _ in range(n)]


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, port):
    model_dir = make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    # With no server the start-up handshake and the first lookup each wait out timeout_s, then
    # the back-off serves cold without asking: a short timeout_s keeps that wait short, and
    # the second test's hit check tries again where a stall made a lookup or a save late.
    engine = connector_engine(model_dir, f"tcp://127.0.0.1:{port}",
                              connector={"timeout_s": TIMEOUT_S, "retry_after_s": RETRY_S}, block_size=BLOCK_SIZE)
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, prompt, salt, max_tokens=32):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params,
                        use_tqdm=False)
    c = o.outputs[0]
    return list(c.token_ids), c.logprobs[0][c.token_ids[0]].logprob, o.num_cached_tokens or 0


def test_absent_server_serves_cold_without_stalling(llm):
    """Both requests return (a stall would be pytest-timeout's), cold and equal."""
    prompt = _prompt(800, seed=3)
    first = _run(llm, prompt, salt="absent")
    llm.reset_prefix_cache()
    second = _run(llm, prompt, salt="absent")
    assert first[2] == second[2] == 0
    assert second[0] == first[0] and second[1] == first[1]


def _negotiated(url: str) -> bool:
    """Whether the engine's handshake reached the server (a namespace with its chunk size)."""
    with CacheClient(url, timeout_s=60) as c:
        return any(v["chunk_size"] is not None for v in c.stats()["namespaces"].values())


def test_server_started_later_is_picked_up(llm, port):
    prompt = _prompt(800, seed=4)
    with ServerProcess("--separate-object-groups", "--chunk-size", "256", "--l1-size-gb", "1",
                       port=port) as srv:
        # Short requests of their own until the connector has shaken hands with the server:
        # it tries again once the back-off from its last failure (retry_after_s) has passed.
        deadline = time.monotonic() + 120
        for i in range(1_000_000):
            if _negotiated(srv.url):
                break
            assert time.monotonic() < deadline, "the connector never shook hands with the server started later"
            _run(llm, _prompt(300, seed=100 + i), salt=f"late-warm-{i}", max_tokens=1)  # a whole chunk: looked up
            time.sleep(0.2)
        for attempt in range(HIT_TRIES):
            cold = _run(llm, prompt, salt=f"late-{attempt}")
            llm.reset_prefix_cache()
            reloaded = _run(llm, prompt, salt=f"late-{attempt}")
            assert cold[2] == 0
            assert reloaded[0] == cold[0] and reloaded[1] == cold[1]
            if reloaded[2] == 768:
                break
            assert reloaded[2] in (0, 256, 512), reloaded[2]  # a strict prefix of whole chunks, or none
    assert reloaded[2] == 768
