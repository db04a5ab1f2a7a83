"""GlmCacheConnector with glm-cache-server absent at engine start-up: vLLM starts, answers
every request cold (equal outputs, no stall), and picks the server up once it appears.

Its own engine (the other module's engine has a live server from the start)."""

from __future__ import annotations

import random
import time

import pytest
from engines import connector_engine, stop_engine
from tiny_qwen3_next import BLOCK_SIZE, make_tiny_qwen3_next

from testing.server_process import ServerProcess, free_port

pytestmark = pytest.mark.engine

RETRY_S = 2.0


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2048) for _ in range(n)]


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, port):
    model_dir = make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    engine = connector_engine(model_dir, f"tcp://127.0.0.1:{port}",
                              connector={"timeout_s": 1.0, "retry_after_s": RETRY_S}, block_size=BLOCK_SIZE)
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
    prompt = _prompt(800, seed=3)
    t0 = time.monotonic()
    first = _run(llm, prompt, salt="absent")
    llm.reset_prefix_cache()
    second = _run(llm, prompt, salt="absent")
    elapsed = time.monotonic() - t0
    assert first[2] == second[2] == 0
    assert second[0] == first[0] and second[1] == first[1]
    assert elapsed < 60, f"two short requests took {elapsed:.1f}s with the server absent"


def test_server_started_later_is_picked_up(llm, port):
    prompt = _prompt(800, seed=4)
    with ServerProcess("--separate-object-groups", "--chunk-size", "256", "--l1-size-gb", "1",
                       port=port):
        time.sleep(RETRY_S + 0.5)  # the connector's back-off from the failed handshake
        cold = _run(llm, prompt, salt="late")
        llm.reset_prefix_cache()
        reloaded = _run(llm, prompt, salt="late")
    assert cold[2] == 0
    assert reloaded[2] == 768
    assert reloaded[0] == cold[0] and reloaded[1] == cold[1]
