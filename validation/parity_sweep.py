"""The plugin against transformers on every shape the tiny checkpoint can take.

For each shape (a tiny checkpoint written with those sizes: pool size, top-k, indexer heads
and head dim, rope key part, KDA heads and head dim) and each prompt length, float32
log-probs of the plugin and of ``transformers.Glm5NextForConditionalGeneration`` are
compared:

- one-shot: the plugin's standalone model (:mod:`glm5next_plugin.standalone`, every layer
  over the whole prompt) against the reference's full log-prob rows ``[T, vocab]``;
- chunked (``--engine``): a vLLM engine with ``max_num_batched_tokens`` 128, one block a
  step, so ``SparseMLALayer.forward_paged`` and the KDA state layer continue from the rows
  and states of earlier steps; its prompt log-probs (the log-prob of each actual next
  prompt token, what vLLM returns) against the reference's at the same tokens.

Tie order. Indexer scores are sums of ReLU'd products weighted by signed head weights, so
with few heads many pools score exactly 0 and the pools a query keeps are decided by the
order among equal scores. The plugin documents it (lower pool index first,
``sparse_mla.top_pools`` / ``top_pool_set``); transformers' indexer takes
``index_scores.topk(select_k)``, whose order among ties is unspecified. The reference is
run with that one call replaced by a stable descending sort's first ``select_k``
(:class:`StableTopK`, the same documented order), which also counts the *boundary ties*
it sees: query rows where the ``select_k``-th and the next best visible pool score are
equal, so the tie order decides what the query attends to.

Near ties. Two float32 implementations compute a pool's score with different summation
orders from hidden states that already differ by ~1e-6, so two pools whose scores differ
by less than that can rank one way in the plugin and the other way in the reference: the
query then attends to another pool, its output moves by whole nats, and through the KDA
state every later position moves too. Neither side is wrong. Where the plugin's chosen set
differs from the reference's, the reference adopts the plugin's set for that query row if
it is a top set of the reference's own scores up to ``NEAR_TIE`` (relative to the row's
largest visible score) and no pool it swaps scores exactly 0 (exact zeros are the ties the
documented order decides; they are never adopted, so a plugin with another tie order still
differs). Adopted rows are counted and reported with their largest score gap.

Rope. transformers' attention implements ``qk_rope_head_dim > 0`` but its config class
refuses it ("Expecting NoPE"); :func:`rope_configs_allowed` lifts that one check (every
other check of ``validate_architecture`` still runs) while a checkpoint with a rope part is
loaded, by the reference here and by vLLM's config loading in the engine.

Run from the repository root (about 1 minute one-shot on 2 cores; ``--engine`` adds three
engine starts, 3.5 minutes in all)::

    python -m validation.parity_sweep [--engine] [--out validation/results/parity_sweep.md]

``tests/engine/test_plugin_parity_sweep.py`` runs the same sweep and asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import glm5next_tiny
from glm5next_plugin.standalone import load_standalone

ROOT = Path(__file__).resolve().parents[1]

# float32 on both sides; what is left is summation order (5 layers, unit-scale random
# weights, 20 Sinkhorn iterations per mHC), measured up to 5.6e-4 (rope16-k8-kda4x8, 128
# tokens); a differently chosen pool moves log-probs by whole nats.
TOL = 1e-3
CHUNK = 128  # the engine's tokens per step: one block
# Largest score gap (relative to the row's largest visible score) within which a choice is
# float32 rounding's to make: pool scores of the two implementations differ by up to ~7e-5
# relative on the same pool in the last MLA layer (measured, rope8-k4-h2 at 4096); real
# score differences between pools are mostly far larger.
NEAR_TIE = 1e-4


@dataclass(frozen=True)
class Shape:
    """One tiny checkpoint: ``sizes`` are :func:`glm5next_tiny.write_checkpoint` keywords
    (config names); ``lengths`` the one-shot prompt lengths, ``engine_lengths`` the chunked
    ones (only shapes that have them get an engine)."""

    name: str
    sizes: dict
    lengths: tuple[int, ...]
    engine_lengths: tuple[int, ...] = ()
    ties_expected: bool = False  # few indexer heads: boundary ties must be seen
    seed: int = 2

    def describe(self) -> str:
        s = {**DEFAULTS, **self.sizes}
        return (f"kpool {s['index_kpool']}, topk {s['index_topk']}, idx {s['index_n_heads']}x{s['index_head_dim']}, "
                f"rope {s['qk_rope_head_dim']}, KDA {s['linear_num_heads']}x{s['linear_head_dim']}")


DEFAULTS = {k: p.default for k, p in inspect.signature(glm5next_tiny.build_config).parameters.items()}

# Lengths: 1 and below one pool, multiples and non-multiples of the pool and of the block
# (128), below and past the sparse regime (a query keeps every pool until it sees more than
# index_topk // index_kpool), and 4096 and past. The chunked lengths are some of them.
SHAPES = [
    Shape("default", {}, (1, 3, 4, 127, 128, 131, 1000, 2048)),
    Shape("k4-h2", dict(index_topk=64, index_n_heads=2), (1, 7, 128, 257, 1001, 4099), (1001, 4099), True),
    Shape("k8-h4-d32", dict(index_kpool=8, index_topk=64, index_n_heads=4, index_head_dim=32), (5, 8, 129, 640, 1200)),
    Shape("k16-h2-d8", dict(index_kpool=16, index_n_heads=2, index_head_dim=8), (1, 15, 16, 255, 256, 1500),
          ties_expected=True),
    Shape("rope8-k4-h2", dict(qk_rope_head_dim=8, index_topk=32, index_n_heads=2), (1, 2, 130, 1024, 4096),
          (1024, 4096), True),
    Shape("rope16-k8-kda4x8", dict(qk_rope_head_dim=16, index_kpool=8, index_n_heads=8, linear_num_heads=4,
                                    linear_head_dim=8), (3, 128, 900)),
    Shape("k16-h1-kda1x32", dict(index_kpool=16, index_topk=256, index_n_heads=1, linear_num_heads=1,
                                  linear_head_dim=32), (1, 17, 384, 2048), (384, 2048), True),
]
assert all(set(s.engine_lengths) <= set(s.lengths) for s in SHAPES)


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` token ids (no special tokens), reproducible by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


# --- the reference, with the plugin's documented tie order --------------------------------


class StableTopK(TorchFunctionMode):
    """``topk`` (largest, last dim) as a stable descending sort's first ``k``: among equal
    scores the lower index first. Counts the rows it ranks and their boundary ties.

    ``adopt``: the plugin's chosen pools per call (``[T, keep]``, ``-1`` unused), in call
    order; where a row's choice differs and is a near tie (module docstring), the plugin's
    set is returned for it."""

    def __init__(self, adopt: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.adopt = adopt
        self.calls = 0
        self.rows = 0  # rows that see more pools than they keep (the selection matters)
        self.ties = 0  # of those, rows whose k-th and (k+1)-th best scores are equal
        self.adopted = 0  # rows given the plugin's set (a near tie)
        self.max_gap = 0.0  # largest relative score gap of an adopted row

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        scores, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
        assert kwargs.get("dim", -1) in (-1, scores.dim() - 1) and kwargs.get("largest", True) and len(args) <= 2
        order = scores.sort(dim=-1, descending=True, stable=True)
        values, indices = order.values[..., :k], order.indices[..., :k].clone()
        if k < scores.shape[-1]:
            hidden = torch.finfo(scores.dtype).min  # the indexer's score for pools a query cannot see
            ranked = order.values[..., k] > hidden
            self.rows += int(ranked.sum())
            self.ties += int((ranked & (order.values[..., k - 1] == order.values[..., k])).sum())
            if self.adopt is not None:
                assert scores.shape[0] == 1, "one sequence"
                self._adopt(scores[0], indices[0], ranked[0], self.adopt[self.calls], hidden)
        self.calls += 1
        return torch.return_types.topk((values, indices))

    def _adopt(self, scores, indices, ranked, plugin_chosen, hidden) -> None:
        """Give near-tie rows (``ranked`` rows whose sets differ) the plugin's set, in place."""
        n_pools, k = scores.shape[1], indices.shape[1]
        for row in ranked.nonzero().flatten().tolist():
            plugin_pools = plugin_chosen[row][plugin_chosen[row] >= 0]
            ref_set = torch.zeros(n_pools, dtype=torch.bool)
            ref_set[indices[row]] = True
            plugin_set = torch.zeros(n_pools, dtype=torch.bool)
            plugin_set[plugin_pools] = True
            if plugin_pools.numel() != k or torch.equal(ref_set, plugin_set):
                continue
            s = scores[row]
            visible = s > hidden
            if not bool(visible[plugin_set].all()) or bool((s[ref_set ^ plugin_set] == 0).any()):
                continue  # a pool the query cannot see, or a tie the documented order decides
            # how far the plugin's set is from being a top set of these scores
            gap = (s[visible & ~plugin_set].max() - s[plugin_set].min()).item() / s[visible].abs().max().item()
            if gap <= NEAR_TIE:
                indices[row] = plugin_pools
                self.adopted += 1
                self.max_gap = max(self.max_gap, gap)


@contextlib.contextmanager
def stable_tie_order(reference, adopt: list[torch.Tensor] | None = None):
    """Run every indexer of the transformers model ``reference`` under one
    :class:`StableTopK` (yielded, for its counts); the indexers' forward is restored after."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    mode = StableTopK(adopt)
    indexers = [m for m in reference.modules() if isinstance(m, Glm5NextTextIndexer)]

    def wrapped(forward):
        def run(*args, **kwargs):
            with mode:
                return forward(*args, **kwargs)

        return run

    for ix in indexers:
        ix.forward = wrapped(ix.forward)
    try:
        yield mode
    finally:
        for ix in indexers:
            del ix.forward  # the class's forward again


@contextlib.contextmanager
def plugin_choices():
    """Record the pools the plugin's sparse-MLA layers choose (``sparse_mla.select_pools``'
    results, in call order) while active; yields the list."""
    from glm5next_plugin import sparse_mla

    real = sparse_mla.select_pools
    seen: list[torch.Tensor] = []

    def recording(*args, **kwargs):
        chosen = real(*args, **kwargs)
        seen.append(chosen)
        return chosen

    sparse_mla.select_pools = recording
    try:
        yield seen
    finally:
        sparse_mla.select_pools = real


@contextlib.contextmanager
def rope_configs_allowed():
    """While active, ``Glm5NextTextConfig`` accepts ``qk_rope_head_dim > 0``: its
    ``validate_architecture`` runs with the rope dim seen as 0, every other check intact."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig as cls

    saved = cls.__class_validators__
    original = cls.validate_architecture

    def validate_architecture(cfg) -> None:
        rope = cfg.qk_rope_head_dim
        object.__setattr__(cfg, "qk_rope_head_dim", 0)
        try:
            original(cfg)
        finally:
            object.__setattr__(cfg, "qk_rope_head_dim", rope)

    cls.__class_validators__ = [validate_architecture if v is original else v for v in saved]
    try:
        yield
    finally:
        cls.__class_validators__ = saved


# --- one shape ------------------------------------------------------------------------------


@dataclass
class Row:
    shape: str
    path: str  # "one-shot" or "chunked 128"
    length: int
    max_diff: float  # max |plugin - reference| over the compared log-probs
    ties: int  # boundary ties the reference saw on this prompt
    ranked: int  # query rows x MLA layers that saw more pools than they keep
    adopted: int  # near-tie rows where the reference took the plugin's set
    max_gap: float  # their largest relative score gap


@dataclass
class ShapeRun:
    """One shape's checkpoint, both models, and the reference's log-probs per prompt length
    (computed once, shared by the one-shot and the chunked comparison)."""

    shape: Shape
    ckpt: Path
    reference: object = None
    plugin: object = None
    _ref: dict = field(default_factory=dict)

    @classmethod
    def create(cls, shape: Shape, root: Path) -> "ShapeRun":
        from transformers import Glm5NextForConditionalGeneration

        ckpt = glm5next_tiny.write_checkpoint(root / shape.name, seed=shape.seed, **shape.sizes)
        with rope_configs_allowed():
            ref = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
            plugin = load_standalone(ckpt)
        return cls(shape, ckpt, ref, plugin)

    def ids(self, n: int) -> list[int]:
        return prompt(n, seed=1000 * n + self.shape.seed)

    def compare(self, n: int) -> tuple[Row, torch.Tensor]:
        """The one-shot row of prompt ``n`` and the reference's ``[n, vocab]`` log-probs
        (with the plugin's near-tie choices adopted)."""
        if n not in self._ref:
            ids = torch.tensor(self.ids(n))
            with torch.no_grad(), plugin_choices() as chosen:
                ours = self.plugin.logprobs(ids)
            with torch.no_grad(), stable_tie_order(self.reference, adopt=chosen) as mode:
                ref = self.reference(input_ids=ids[None]).logits[0].float().log_softmax(-1)
            diff = (ours - ref).abs().max().item()
            row = Row(self.shape.name, "one-shot", n, diff, mode.ties, mode.rows, mode.adopted, mode.max_gap)
            self._ref[n] = (row, ref)
        return self._ref[n]

    def one_shot(self, n: int) -> Row:
        return self.compare(n)[0]

    def chunked(self, llm, n: int) -> Row:
        """vLLM's prompt log-probs against the reference's at the prompt's own tokens (the
        reference as adopted for the one-shot run of the same prompt)."""
        ids = self.ids(n)
        one, ref = self.compare(n)
        got = engine_prompt_logprobs(llm, ids)
        want = ref[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
        diff = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
        return Row(self.shape.name, f"chunked {CHUNK}", n, diff, one.ties, one.ranked, one.adopted, one.max_gap)


# --- the vLLM engine path -----------------------------------------------------------------


def chunked_engine(ckpt: Path, max_len: int):
    """A float32 CPU ``vllm.LLM`` on ``ckpt`` that prefills ``CHUNK`` tokens a step.

    The config is parsed here, with :func:`rope_configs_allowed`, and reaches the engine's
    processes parsed (pickled); they parse a config again only to pick the tokenizer class,
    from its ``model_type``, so the tokenizer comes from a copy of its files whose
    ``config.json`` names only the model type (a rope checkpoint's own config would be
    refused there, in processes this one cannot reach)."""
    import json
    import shutil

    from vllm import LLM

    tokenizer = ckpt.with_name(ckpt.name + "-tokenizer")
    tokenizer.mkdir(exist_ok=True)
    for f in [*ckpt.glob("tokenizer*.json"), *ckpt.glob("*.jinja"), *ckpt.glob("special_tokens_map.json")]:
        shutil.copy(f, tokenizer / f.name)
    model_type = json.loads((ckpt / "config.json").read_text())["model_type"]
    (tokenizer / "config.json").write_text(json.dumps({"model_type": model_type}))
    with rope_configs_allowed():
        return LLM(model=str(ckpt), tokenizer=str(tokenizer), dtype="float32", gpu_memory_utilization=0.15,
                   enforce_eager=True, enable_prefix_caching=True, max_num_batched_tokens=CHUNK,
                   max_model_len=max_len + 1, seed=0)


def engine_prompt_logprobs(llm, ids: list[int]) -> list[float]:
    """vLLM's log-prob of each actual next prompt token (positions 1..n-1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


# --- the table --------------------------------------------------------------------------------


def table(rows: list[Row], shapes: list[Shape] = SHAPES) -> str:
    """Markdown: one line per shape, path and length; then the shapes."""
    lines = ["| shape | path | length | max abs dlogprob | boundary ties / ranked rows | near ties adopted (max gap) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        adopted = f"{r.adopted} ({r.max_gap:.1e})" if r.adopted else "0"
        lines.append(f"| {r.shape} | {r.path} | {r.length} | {r.max_diff:.2e} | {r.ties} / {r.ranked} | {adopted} |")
    lines += ["", "| shape | sizes |", "|---|---|"]
    lines += [f"| {s.name} | {s.describe()} |" for s in shapes]
    total = sum(r.ties for r in rows)
    lines += [
        "",
        "Boundary ties / ranked rows: query rows x MLA layers of the reference whose select_k-th and next best "
        "visible pool scores are equal / that see more pools than they keep. Near ties adopted: rows where the "
        "reference took the plugin's set, its scores being within NEAR_TIE of each other (largest relative gap).",
        "",
        f"Boundary ties seen: {total}" + (" (none in this sweep)" if total == 0 else "") + ".",
    ]
    return "\n".join(lines)


def run(root: Path, shapes: list[Shape], engine: bool, log=print) -> list[Row]:
    rows = []
    for shape in shapes:
        t0 = time.time()
        sr = ShapeRun.create(shape, root)
        rows += [sr.one_shot(n) for n in shape.lengths]
        if engine and shape.engine_lengths:
            llm = chunked_engine(sr.ckpt, max(shape.engine_lengths))
            try:
                rows += [sr.chunked(llm, n) for n in shape.engine_lengths]
            finally:
                shutdown(llm)
        log(f"{shape.name}: {time.time() - t0:.1f} s")
    return rows


def main(argv: list[str] | None = None) -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="store_true", help="also the chunked vLLM engine path (3 engine starts)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = p.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="parity-sweep-") as tmp:
        rows = run(Path(tmp), SHAPES, args.engine)
    text = table(rows)
    cmd = "python -m validation.parity_sweep" + (" --engine" if args.engine else "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    text = (f"# Plugin vs transformers, float32 prompt log-probs\n\n`{cmd}` at {commit.stdout.strip() or '?'} "
            f"({time.time() - t0:.0f} s on {os.cpu_count()} cores, torch {torch.__version__}); tolerance {TOL:g}, "
            f"NEAR_TIE {NEAR_TIE:g}.\n\n{text}\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    bad = [r for r in rows if not r.max_diff < TOL]
    if bad:
        raise SystemExit(f"{len(bad)} rows at or over {TOL:g}")


if __name__ == "__main__":
    main()
