"""GlmCacheConnector on the generated GLM-5.3-Flash checkpoint (the project's plugin:
KDA state groups + sparse-MLA group), with a real glm-cache-server.

The tiny checkpoint's unified block N is 128 while the server's minimum chunk is 256, so
C = 2N: a chunk spans two attention blocks, and vLLM keeps state snapshots on its own
128-token grid. The engine therefore runs with ``max_num_batched_tokens`` = C and
``prefix_cache_retention_interval`` = C, so prefill steps end, and states are kept, on
chunk boundaries (the connector warns at start-up when they are not). Requests are
compared one at a time (see test_connector_e2e.py for why).
"""

from __future__ import annotations

import pytest
from engines import assert_boundary_reloads_equal_cold, generate_one, random_prompt, stop_engine, tiny_glm_engine

pytestmark = pytest.mark.engine

C = 256
CONTINUATION = 16


_prompt = random_prompt


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C)
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, prompt, salt, max_tokens=CONTINUATION):
    return generate_one(llm, prompt, salt, max_tokens)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_glm_boundary_sweep_reloaded_equals_cold(llm, k):
    assert_boundary_reloads_equal_cold(llm, _run, _prompt, C, k, seed=40 * k, salt="glm-sweep")


def test_glm_reload_of_a_longer_prompt_mid_chunk(llm):
    """1200 tokens: the strict prefix (1024) is a chunk boundary but not vLLM's replay
    boundary (1152): the state there exists only because steps end on chunks."""
    prompt = _prompt(1200, seed=77)
    cold = _run(llm, prompt, "glm-1200", max_tokens=16)
    llm.reset_prefix_cache()
    reloaded = _run(llm, prompt, "glm-1200", max_tokens=16)
    assert reloaded[2] == 1024
    assert reloaded[0] == cold[0] and reloaded[1] == cold[1]
