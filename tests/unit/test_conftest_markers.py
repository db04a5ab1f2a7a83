"""tests/conftest.py's ``vllm_free`` marking: a test reaching vLLM by any route runs on both
vLLM versions; only tests of glm-cache-server alone run once."""

from __future__ import annotations

from tests import conftest  # the suite's root conftest.py (each folder has one too)


def test_server_tests_are_vllm_free_and_the_rest_are_not():
    assert not conftest._touches_vllm("tests.unit.test_store")
    assert not conftest._touches_vllm("tests.server.test_l2")
    assert conftest._touches_vllm("tests.engine.test_connector_glm")  # `from testing.engines import`
    assert conftest._touches_vllm("tests.engine.test_notebooks")  # runs notebooks that start vLLM
    assert conftest._touches_vllm("tests.engine.test_demo")  # runs the demo
    assert conftest._touches_vllm("tests.unit.test_handoff")  # imports the connector package
    assert conftest._touches_vllm("tests.engine.test_pd_e2e")  # starts vllm serve (validation.serving)


def test_a_fixture_that_imports_the_connector_counts():
    assert "testing.sched_harness" in conftest._conftest_fixture_imports()["sides"]
