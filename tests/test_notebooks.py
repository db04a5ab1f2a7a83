"""The validation notebooks run headless on the generated checkpoint and hold their claims.

Each notebook starts its own glm-cache-server and vllm serve, and asserts what it shows
(reloaded hits are the strict prefix, reloaded outputs equal cold), so a regression in
the connector, the plugin or the server fails here as a CellExecutionError.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

from validation.build_notebooks import NOTEBOOKS, PARAMETERS, SMALL, build, execute

pytestmark = pytest.mark.engine

VALIDATION = Path(__file__).resolve().parent.parent / "validation"


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_committed_notebook_is_current_and_carries_its_outputs(name):
    committed = nbformat.read(VALIDATION / f"{name}.ipynb", as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in build(name).cells], (
        f"{name}.ipynb is stale: run python -m validation.build_notebooks --execute {name}")
    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the committed notebook has no plot"


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_executes_headless(name):
    """Every cell runs, on smaller sizes than the committed run, and the notebook's own
    asserts (strict-prefix hits, reloaded == cold) hold; its tables and plots come out."""
    assert SMALL[name].keys() == PARAMETERS[name].keys()
    nb = copy.deepcopy(build(name, SMALL[name]))
    execute(nb)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot"
    assert any("text/markdown" in o.get("data", {}) for o in outputs), "no table"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Resolved geometry:" in text  # the start-up line it quotes
