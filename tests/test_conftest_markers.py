"""tests/conftest.py's ``vllm_free`` marking: a test reaching vLLM by any route runs on both
vLLM versions; only tests of glm-cache-server alone run once."""

from __future__ import annotations

import conftest


def test_server_tests_are_vllm_free_and_the_rest_are_not():
    assert not conftest._touches_vllm("tests.test_store")
    assert not conftest._touches_vllm("tests.test_l2")
    assert conftest._touches_vllm("tests.test_connector_glm")  # `from engines import` (tests/ on sys.path)
    assert conftest._touches_vllm("tests.test_notebooks")  # runs notebooks that start vLLM
    assert conftest._touches_vllm("tests.test_demo")  # runs the demo
    assert conftest._touches_vllm("tests.test_handoff")  # imports the connector package
    assert conftest._touches_vllm("tests.test_pd_e2e")  # starts vllm serve (validation.serving)


def test_a_fixture_that_imports_the_connector_counts():
    assert "testing.sched_harness" in conftest._conftest_fixture_imports()["sides"]
