# The two commands of the README: `make demo` and `make test`. Both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-server test bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) validation/demo.py

demo-server: setup
	$(PY) validation/demo_server.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) validation/bench_server.py

clean:
	rm -rf $(VENV) build *.egg-info
