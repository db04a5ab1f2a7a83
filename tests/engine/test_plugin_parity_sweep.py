"""The plugin matches transformers on every shape the tiny checkpoint can take.

The sweep of ``validation/parity_sweep.py`` (its docstring says how the reference is run:
the plugin's documented tie order, near ties, the rope config): float32 log-probs within
``TOL`` for every shape and length one-shot (full ``[T, vocab]`` rows of the plugin's
standalone model), and for three shapes chunked through a vLLM engine that prefills 128
tokens a step (the log-prob of each actual next prompt token, what vLLM returns): pools
of 4 with 2 indexer heads, a rope key part, pools of 16 with one indexer head and other
KDA head dims. Shapes with few indexer heads must see boundary ties (the k-th and next
best visible pool scores equal), so the tie order is really exercised. The table (shape x
length, max |dlogprob|, boundary ties) is printed at the end.
"""

from __future__ import annotations

import pytest

from validation import parity_sweep as sweep

ENGINE_SHAPES = [s for s in sweep.SHAPES if s.engine_lengths]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(shape)``: the shape's checkpoint and both models, built once per module."""
    root = tmp_path_factory.mktemp("parity_sweep")
    built: dict[str, sweep.ShapeRun] = {}

    def get(shape: sweep.Shape) -> sweep.ShapeRun:
        if shape.name not in built:
            built[shape.name] = sweep.ShapeRun.create(shape, root)
        return built[shape.name]

    return get


@pytest.fixture(scope="module")
def engine_rows() -> list[sweep.Row]:
    return []


@pytest.mark.parametrize("shape", sweep.SHAPES, ids=lambda s: s.name)
def test_one_shot_logprobs_match_transformers(runs, shape):
    rows = [runs(shape).one_shot(n) for n in shape.lengths]
    bad = [r for r in rows if not r.max_diff < sweep.TOL]
    assert not bad, sweep.table(bad, [shape])
    if shape.ties_expected:
        assert sum(r.ties for r in rows) > 0, f"{shape.name}: no boundary ties seen"


@pytest.fixture(scope="module", params=ENGINE_SHAPES, ids=lambda s: s.name)
def chunked(request, runs):
    """(shape run, engine prefilling 128 tokens a step): one engine start per shape."""
    run = runs(request.param)
    llm = sweep.chunked_engine(run.ckpt, max(request.param.engine_lengths))
    yield run, llm
    sweep.shutdown(llm)


@pytest.mark.engine
def test_chunked_engine_prompt_logprobs_match_transformers(chunked, engine_rows):
    run, llm = chunked
    sched = llm.llm_engine.vllm_config.scheduler_config
    assert sched.max_num_batched_tokens == sweep.CHUNK and sched.enable_chunked_prefill
    rows = [run.chunked(llm, n) for n in run.shape.engine_lengths]
    engine_rows.extend(rows)
    bad = [r for r in rows if not r.max_diff < sweep.TOL]
    assert not bad, sweep.table(bad, [run.shape])
    assert sum(r.ties for r in rows) > 0  # every engine shape has few indexer heads


def test_sweep_table(runs, engine_rows, capsys):
    """The table, printed (one-shot rows are cached, so this only formats them unless run
    alone); engine rows appear when the engine tests ran before it."""
    rows = [runs(s).one_shot(n) for s in sweep.SHAPES for n in s.lengths] + engine_rows
    text = sweep.table(rows)
    with capsys.disabled():
        print(f"\n{text}\n")
    assert all(r.max_diff < sweep.TOL for r in rows)
    with_ties = {r.shape for r in rows if r.ties}
    assert {s.name for s in sweep.SHAPES if s.ties_expected} <= with_ties
