"""The validation notebooks run headless on the generated checkpoint and hold their claims.

Each notebook's setup cell starts the same glm-cache-server and ``vllm serve``; here the
three share one kernel, so that setup runs once (and its teardown once, at the end) and
each notebook's own cells run after it, in a namespace put back to what the setup left.
The module starts three engines instead of five (the shared one, cold_vs_reload's drafts
engine, boundary_sweep's loose engine, each extra one beside the shared one as in the
notebooks). Each notebook asserts what it shows (reloaded hits are the strict prefix,
reloaded outputs equal cold), so a regression in the connector, the plugin or the server
fails here as a CellExecutionError. Every request a notebook sends names a fresh
``cache_salt``, so nothing an earlier notebook stored can be a hit in a later one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from validation.build_notebooks import NOTEBOOKS, PARAMETERS, SETUP, SMALL, TEARDOWN, build

pytestmark = pytest.mark.engine

VALIDATION = Path(__file__).resolve().parents[2] / "validation"

# Appended to the shared setup: the names it leaves and the objects they name.
RECORD = "_setup_ns = {k: v for k, v in globals().items() if not k.startswith('_')}\n"

# After each notebook, passed or failed: stop an engine it left running (a failing cell
# before its stop(); at most two engines at once, as in the notebooks), drop its names,
# and fail if it rebound one of the setup's (the next notebook would run on that).
AFTER = '''\
for _v in list(globals().values()):
    if isinstance(_v, VllmServer) and _v is not engine:
        _v.stop()
_rebound = sorted(k for k, v in _setup_ns.items() if globals().get(k) is not v)
for _k in [k for k in globals() if not k.startswith("_") and k not in _setup_ns]:
    del globals()[_k]
globals().update(_setup_ns)
assert not _rebound, f"the notebook rebound the setup's {_rebound}"
'''


def _run(client: NotebookClient, source: str) -> nbformat.NotebookNode:
    client.nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    return client.execute_cell(client.nb.cells[0], 0)


@pytest.fixture(scope="module")
def kernel():
    """One kernel in validation/ that has run the notebooks' setup cell: (client, the
    setup's outputs); the notebooks' teardown cell runs in it after the module."""
    client = NotebookClient(nbformat.v4.new_notebook(), timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(VALIDATION)}})
    with client.setup_kernel():
        setup = _run(client, SETUP + RECORD)
        yield client, setup.outputs
        _run(client, TEARDOWN)


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_committed_notebook_is_current_and_carries_its_outputs(name):
    committed = nbformat.read(VALIDATION / f"{name}.ipynb", as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in build(name).cells], (
        f"{name}.ipynb is stale: run python -m validation.build_notebooks --execute {name}")
    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the committed notebook has no plot"


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_executes_headless(name, kernel):
    """Every cell runs, on smaller sizes than the committed run (the setup and teardown
    once for all three notebooks), and the notebook's own asserts (strict-prefix hits,
    reloaded == cold) hold; its tables and plots come out."""
    client, setup_outputs = kernel
    assert SMALL[name].keys() == PARAMETERS[name].keys()
    nb = copy.deepcopy(build(name, SMALL[name]))
    sources = [c.source for c in nb.cells]
    # What the shared kernel skips is exactly the setup and teardown it ran for all.
    assert sources.count(SETUP) == 1 and sources.count(TEARDOWN) == 1 and sources[-1] == TEARDOWN
    own = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source not in (SETUP, TEARDOWN)]
    try:
        client.nb = nb
        for i in own:
            client.execute_cell(nb.cells[i], i)
    finally:
        _run(client, AFTER)
    outputs = [o for i in own for o in nb.cells[i].outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot"
    assert any("text/markdown" in o.get("data", {}) for o in outputs), "no table"
    text = "".join(o.get("text", "") for o in setup_outputs if o.output_type == "stream")
    assert "Resolved geometry:" in text  # the start-up line the notebooks quote
