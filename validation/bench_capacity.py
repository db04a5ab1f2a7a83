"""Capacity benchmark: resumable conversation tokens per GB, this project's
storing and retention against an LMCache-style baseline, on real glm-cache-server processes
with the same byte budget.

    python -m validation.bench_capacity [--scale 512] [--block 1152] [--shares 0.3 0.5]
        [--kv-cache-dtypes auto fp8] [--plot validation/bench_capacity.png]

What it exercises and what it imitates. There is no engine here (GLM-5.3-Flash at TP 4
does not run on this machine); the driver plays vLLM's part:

* Real: two ``glm-cache-server`` processes (``cache_server.cli``, one per policy, same
  ``--l1-size-gb``), the connector's client (:class:`cache_server.client.CacheClient`: hello,
  lookup, put with ``prev`` and ``parent``), its keys (:func:`cache_server.chunk_keys.chunk_hashes`),
  its strict-prefix rule (:func:`connector.geometry.strict_prefix_chunks`), and the object
  sizes per group of vLLM's native GLM-5.3-Flash at TP 4 (from
  ``testing/glm_flash_kv_layouts.py``, the same numbers ``geometry_report`` prints:
  block 1152 tokens (seed 003's), two attention object groups stored once (MLA latent,
  indexer cache), four KDA state groups per rank).
* Imitated: the scheduler side's decisions, written out here the way
  ``GlmCacheConnector`` makes them: a lookup of ``floor((N-1)/C)`` chunks per turn, then
  attention saves for the prompt's whole chunks past the hit (rank 0 only for the replicated
  group, as ``wait_for_save`` does) and one state save per rank at the prompt's replay
  boundary ``C*floor((N-1)/C)`` (what vLLM 0.32 retains with the default
  ``prefix_cache_retention_interval=0``), linked by ``prev`` to the state it resumed from
  and by ``parent`` to the previous chunk (``_state_saves``, ``_attention_saves``). Loads
  (``get``) are not issued: the lookup already refreshes what a load would.
* Baseline (LMCache-style, as LMCache stores them): attention and a KDA state object with
  every chunk, on every rank (no replicated-group dedup), no ``prev``/``parent`` and no
  declared layout, so that server applies plain LRU, as LMCache's does.
* This project's storing, under several server settings, each its own server with the same
  budget, fed the same turns: ``ours-lru`` (retention classes, LRU within each:
  ``--eviction-policy LRU``), ``ours-value`` (classes, then recency with prefill saved per
  byte: the default), and ``ours-value-s<f>`` (the same with ``--l1-state-share f``).

Byte sizes are divided by ``--scale`` (and so is the budget), so everything fits this
machine; results are reported at full scale (tokens per GB of the unscaled budget).

KV cache dtype (``--kv-cache-dtypes``, default ``auto fp8``): every phase runs once per
dtype, each with the object sizes of an engine serving that ``--kv-cache-dtype``, and a
last table puts FP8's resumable tokens per GB next to bf16's. ``auto`` is the bf16 latent
(11,264 B/token); ``fp8`` the native model's plain per-tensor fp8 latent (one byte a
value, 5,632 B/token; the FlashInfer sparse backend's format, as the plugin's fp8 rows are
one byte a value), the indexer cache fp8 with scales either way, the KDA state never fp8.
vLLM's block alignment then takes a longer block (2176 tokens: the attention page must
still cover the state page), so the chunk is longer too. Derived from geometry (vLLM's
spec and alignment code over the served config, ``testing/glm_flash_kv_layouts.py``, no
fp8 engine was run at TP 4): the block, the bytes per token and per object, and the
attention-only bound printed per dtype; measured (real servers, this driver's turns):
the resumable tokens per GB in the tables. FlashMLA's packed ``fp8_ds_mla`` (656 B/token)
is not modelled.

Phases: (a) the production incident's workload ("seed 000" in the output): six three-turn
sessions growing to about 20k tokens, one 308k-token prompt, then each session's next turn
(a probe is warm when it resumes at or past the state its previous turn left); (b) steady
mixes: many sessions, each turn adding one to three chunks, at 20k-token and 100k-token
conversations. At the end of each phase every
conversation is looked up (same order for both policies) and its resumable depth summed.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass, field

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from connector.geometry import strict_prefix_chunks
from testing.server_process import ServerProcess

GB = 1e9
GIB = 1 << 30
GROUP_NAMES = ("mla_latent", "indexer_cache", "kda_state")


@dataclass(frozen=True)
class Sizes:
    """Per-object bytes at full scale, from vLLM's native GLM-5.3-Flash TP 4 layout."""

    chunk: int  # tokens per chunk (= vLLM's unified block)
    world: int
    attn: dict[int, int]  # group -> bytes per chunk object (replicated: one copy)
    state: dict[int, int]  # group -> bytes per rank
    names: dict[int, str]  # group -> object group name (kda_state, mla_latent, indexer_cache)

    @property
    def state_bytes_all_ranks(self) -> int:
        return sum(self.state.values()) * self.world


def native_tp4_sizes(block: int | None = None, cache_dtype: str = "auto") -> Sizes:
    """``block`` None: vLLM's unified block as derived by the fixture for the served
    checkpoint with the attention cache in ``cache_dtype`` (1152 at TP 4 for ``auto``, as
    seed 003 logs it; 2176 for ``fp8``); else that many tokens a chunk, attention bytes
    scaled per token, the KDA state (one per block position) unchanged."""
    from testing import glm_flash_kv_layouts as L

    built = L.build("native", 4, num_blocks=1, cfg=L.text_config(), cache_dtype=cache_dtype)
    geo = L.resolve(built)
    assert all(g.replicated_across_tp for g in geo.attn_groups)
    chunk = block or built.block_size
    return Sizes(chunk, 4, {g.group_id: g.object_bytes_per_block * chunk // built.block_size for g in geo.attn_groups},
                 {g.group_id: g.object_bytes_per_block for g in geo.state_groups},
                 {g.group_id: g.name for g in geo.groups})


@dataclass
class Conversation:
    name: str
    rng: random.Random
    tokens: list[int] = field(default_factory=list)
    last_state_chunk: dict[str, int] = field(default_factory=dict)  # policy -> chunk of its newest state

    def extend(self, n: int) -> None:
        self.tokens.extend(self.rng.randrange(1, 150_000) for _ in range(n))


class Policy:
    """One server and the save rules of one policy."""

    def __init__(self, name: str, sizes: Sizes, scale: int, budget_bytes: int, ours: bool,
                 server_args: tuple[str, ...] = ()) -> None:
        self.name, self.sizes, self.scale, self.ours = name, sizes, scale, ours
        self.budget_bytes = budget_bytes
        scaled = budget_bytes // scale
        max_obj = max(max(sizes.attn.values()), max(sizes.state.values())) // scale + 1
        self.server = ServerProcess("--separate-object-groups", "--l1-size-gb", f"{scaled / GIB:.12f}",
                                    "--max-object-size-mb", f"{max(max_obj / (1 << 20), 0.01):.6f}",
                                    "--max-message-mb", "256", "--log-level", "WARNING", *server_args).start()
        self.client = CacheClient(self.server.url, timeout_s=60.0)
        self.ns = f"bench-{name}"
        groups = [*sizes.attn, *sizes.state]
        if ours:
            self.client.hello(self.ns, sizes.chunk, sizes.world, list(sizes.attn),
                              attn_groups=list(sizes.attn), state_groups=list(sizes.state), group_names=sizes.names)
        else:
            self.client.hello(self.ns, sizes.chunk, sizes.world)
        self._payload = {g: bytes(self._obj(g)) for g in groups}
        self.attn_groups, self.state_groups = list(sizes.attn), list(sizes.state)

    def _obj(self, group: int) -> int:
        full = self.sizes.attn.get(group) or self.sizes.state[group]
        return max(1, full // self.scale)

    def lookup(self, conv: Conversation, max_chunks: int) -> int:
        hashes = chunk_hashes(conv.tokens[: max_chunks * self.sizes.chunk], self.sizes.chunk)
        if not hashes:
            return 0
        n, _ = self.client.lookup(self.ns, hashes, self.attn_groups, self.state_groups, self.sizes.world,
                                  lease=False, replicated_groups=list(self.sizes.attn) if self.ours else [])
        return n

    def turn(self, conv: Conversation) -> int:
        """One prompt of ``conv`` through the connector's decisions; returns the hit in chunks."""
        C, N = self.sizes.chunk, len(conv.tokens)
        hit = self.lookup(conv, strict_prefix_chunks(N, C))
        whole = N // C
        hashes = chunk_hashes(conv.tokens[: whole * C], C)
        items: list[tuple[bytes, int, int, bytes]] = []
        prevs: list[bytes | None] = []
        parents: list[bytes | None] = []
        state_at = strict_prefix_chunks(N, C)  # vLLM's replay boundary, in chunks
        for k in range(hit, whole):
            parent = hashes[k - 1] if k else None
            for g in self.attn_groups:
                for r in (range(1) if self.ours else range(self.sizes.world)):
                    items.append((hashes[k], g, r, self._payload[g]))
                    prevs.append(None)
                    parents.append(parent)
            if not self.ours or k + 1 == state_at:  # baseline: a state with every chunk
                prev = None
                if self.ours and hit:
                    prev = hashes[hit - 1]
                for g in self.state_groups:
                    for r in range(self.sizes.world):
                        items.append((hashes[k], g, r, self._payload[g]))
                        prevs.append(prev)
                        parents.append(parent)
            if len(items) >= 64:
                self._put(items, prevs, parents)
                items, prevs, parents = [], [], []
        if items:
            self._put(items, prevs, parents)
        conv.last_state_chunk[self.name] = max(state_at, hit) if state_at > hit else hit
        return hit

    def _put(self, items, prevs, parents) -> None:
        if self.ours:
            self.client.put(self.ns, items, prev=prevs, parent=parents)
        else:
            self.client.put(self.ns, items)

    def bytes_by_group(self) -> dict[str, int]:
        """Resident bytes per object group name, at full scale (the baseline declares no
        names to its server, so they come from the sizes here)."""
        st = self.client.stats()
        out = dict.fromkeys(GROUP_NAMES, 0)
        for g, b in st["bytes_by_group"].items():
            out[self.sizes.names[int(g)]] += b * self.scale
        return out

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def resumable_tokens(policy: Policy, convs: list[Conversation]) -> int:
    C = policy.sizes.chunk
    return sum(policy.lookup(c, strict_prefix_chunks(len(c.tokens) + 1, C)) * C for c in convs)


def phase_seed000(policies: list[Policy], seed: int) -> dict[str, dict]:
    """Six ~20k-token three-turn sessions, one 308k prompt, then the six next turns."""
    rng = random.Random(seed)
    sessions = [Conversation(f"s{i}", random.Random(rng.random())) for i in range(6)]
    for c in sessions:
        c.extend(16_000)
    for _turn in range(3):
        for c in sessions:
            for p in policies:
                p.turn(c)
            c.extend(1_300)  # the answer and the next user message
    long = Conversation("long", random.Random(rng.random()))
    long.extend(308_000)
    for p in policies:
        p.turn(long)
    out: dict[str, dict] = {}
    for p in policies:
        warm = 0
        for c in sessions:
            expected = c.last_state_chunk[p.name]
            warm += p.lookup(c, strict_prefix_chunks(len(c.tokens), p.sizes.chunk)) >= expected > 0
        out[p.name] = {"warm": warm, "resumable": resumable_tokens(p, [*sessions, long]),
                       "bytes": p.bytes_by_group()}
    return out


def phase_steady(policies: list[Policy], seed: int, sessions: int, start_tokens: int, turns: int,
                 unit: int | None = None) -> dict[str, dict]:
    """Many sessions; each turn of a random session adds one to three chunks (of ``unit``
    tokens, the policies' chunk unless given: the same conversations for every dtype)."""
    rng = random.Random(seed)
    C = unit or policies[0].sizes.chunk
    convs = [Conversation(f"m{i}", random.Random(rng.random())) for i in range(sessions)]
    for c in convs:
        c.extend(start_tokens)
    for _ in range(turns):
        c = convs[min(int(rng.expovariate(1 / (sessions / 3))), sessions - 1)]  # some sessions busier
        for p in policies:
            p.turn(c)
        c.extend(rng.randint(1, 3) * C)
    return {p.name: {"resumable": resumable_tokens(p, convs), "bytes": p.bytes_by_group()} for p in policies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=512, help="divide every byte size and the budget by this")
    ap.add_argument("--budget-gb", type=float, nargs=3, default=(6.0, 24.0, 48.0),
                    help="full-scale L1 budgets (GB) of phases a, b-20k and b-100k")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--block", type=int, default=None,
                    help="tokens a chunk/block (default: vLLM's block for the served checkpoint at TP 4, 1152, "
                         "as seed 003 logs it)")
    ap.add_argument("--shares", type=float, nargs="*", default=[0.3, 0.5],
                    help="--l1-state-share values to run as extra policies (ours-value-s<f>)")
    ap.add_argument("--sweep-gb", type=float, nargs="*", default=[3.0, 4.0, 5.0],
                    help="full-scale budgets below phase a's at which seed 000 is replayed again "
                         "(lmcache, ours-lru, ours-value only)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"], choices=["auto", "fp8"],
                    help="object sizes of an engine with this --kv-cache-dtype; each runs every phase "
                         "(--block sets the first one's block; the others take the block vLLM derives)")
    ap.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_capacity.png"))
    args = ap.parse_args()
    t0 = time.monotonic()
    dtypes = list(dict.fromkeys(args.kv_cache_dtypes))
    all_rows: dict[str, list] = {}
    unit = 0
    for i, cache_dtype in enumerate(dtypes):
        sizes = native_tp4_sizes(args.block if i == 0 else None, cache_dtype)
        per_token = {sizes.names[g]: b / sizes.chunk for g, b in sizes.attn.items()}
        attn_per_token = sum(per_token.values())
        print(f"native TP 4, --kv-cache-dtype {cache_dtype} (derived from geometry): chunk {sizes.chunk} tokens, "
              "attention " + ", ".join(f"{n} {v:.0f} B/token" for n, v in per_token.items()) + " (stored once), "
              f"state {sum(sizes.state.values()) / 1e6:.1f} MB/rank x {sizes.world} ranks "
              f"({sizes.state_bytes_all_ranks / sizes.chunk:,.0f} B/token if kept every chunk); attention alone "
              f"{GB / attn_per_token:,.0f} tokens/GB; bytes scaled 1/{args.scale}")
        unit = unit if i else sizes.chunk  # conversations grow by the first dtype's chunks in every run
        all_rows[cache_dtype] = _run_phases(args, sizes, cache_dtype, unit)
    _print_tables(all_rows)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.plot:
        _plot([r for r in all_rows[dtypes[0]] if r[0] != "sweep"], args.plot)
        print(f"plot: {args.plot}")


def _run_phases(args: argparse.Namespace, sizes: Sizes, cache_dtype: str, unit: int) -> list:
    """Every phase, then the smaller-budget sweep, with one dtype's sizes: the table rows
    (and ``("sweep", budget, policy, tokens per GB, warm, None)`` rows)."""
    phases = [("a: seed 000", args.budget_gb[0], lambda ps: phase_seed000(ps, args.seed)),
              ("b: 20k sessions", args.budget_gb[1], lambda ps: phase_steady(ps, args.seed, 120, 19_000, 600, unit)),
              ("b: 100k sessions", args.budget_gb[2], lambda ps: phase_steady(ps, args.seed, 60, 98_000, 240, unit))]
    rows = []
    for label, budget_gb, run in phases:
        budget = int(budget_gb * GB)
        ps = [Policy("lmcache", sizes, args.scale, budget, ours=False),
              Policy("ours-lru", sizes, args.scale, budget, ours=True, server_args=("--eviction-policy", "LRU")),
              Policy("ours-value", sizes, args.scale, budget, ours=True,
                     server_args=("--eviction-policy", "value"))]
        ps += [Policy(f"ours-value-s{f:g}", sizes, args.scale, budget, ours=True,
                      server_args=("--eviction-policy", "value", "--l1-state-share", str(f))) for f in args.shares]
        try:
            t = time.monotonic()
            res = run(ps)
            status = {p.name: p.client.stats()["namespaces"][p.ns]["usable_prefixes"] for p in ps if p.ours}
        finally:
            for p in ps:
                p.close()
        for name, r in res.items():
            rows.append((label, budget_gb, name, r["resumable"] / budget_gb, r.get("warm"), r["bytes"]))
        print(f"  phase {label}: {time.monotonic() - t:.1f} s; server /status usable_prefixes:")
        for name, u in status.items():
            print(f"    {name:16} {u}")
    for budget_gb in args.sweep_gb:
        budget = int(budget_gb * GB)
        ps = [Policy("lmcache", sizes, args.scale, budget, ours=False),
              Policy("ours-lru", sizes, args.scale, budget, ours=True, server_args=("--eviction-policy", "LRU")),
              Policy("ours-value", sizes, args.scale, budget, ours=True,
                     server_args=("--eviction-policy", "value"))]
        try:
            res = phase_seed000(ps, args.seed)
        finally:
            for p in ps:
                p.close()
        for p in ps:
            rows.append(("sweep", budget_gb, p.name, res[p.name]["resumable"] / budget_gb, res[p.name]["warm"], None))
    print(f"  --kv-cache-dtype {cache_dtype}: phases done")
    return rows


def _print_tables(all_rows: dict[str, list]) -> None:
    """The first dtype's tables as before, then each other dtype's resumable tokens per GB
    next to the first's."""
    first = next(iter(all_rows))
    rows = [r for r in all_rows[first] if r[0] != "sweep"]
    sweep = [r for r in all_rows[first] if r[0] == "sweep"]
    print(f"\n--kv-cache-dtype {first}:")
    print(f"{'phase':18} {'budget':>7} {'policy':16} {'resumable tok/GB':>17} {'ratio':>6} {'probes warm':>11} "
          f"{'latent GB':>9} {'indexer GB':>10} {'state GB':>9}")
    for label, budget_gb, name, per_gb, warm, by in rows:
        base = next(r[3] for r in rows if r[0] == label and r[2] == "lmcache")
        ratio = f"{per_gb / base:.1f}x" if base else ("inf" if per_gb else "-")
        print(f"{label:18} {budget_gb:6.0f}G {name:16} {per_gb:17,.0f} {ratio:>6} "
              f"{'' if warm is None else f'{warm} of 6':>11} {by['mla_latent'] / GB:9.2f} "
              f"{by['indexer_cache'] / GB:10.2f} {by['kda_state'] / GB:9.2f}")
    if sweep:
        print("\nseed 000 at smaller budgets (probes warm of 6 / resumable tokens per GB):")
        print(f"{'budget':>7} {'lmcache':>16} {'ours-lru':>16} {'ours-value':>16}")
        for budget_gb in dict.fromkeys(r[1] for r in sweep):
            print(f"{budget_gb:6.1f}G " + " ".join(f"{r[4]:>6}/6 {r[3]:8,.0f}" for r in sweep if r[1] == budget_gb))
    for other, other_rows in all_rows.items():
        if other == first:
            continue
        print(f"\nresumable tokens per GB, --kv-cache-dtype {other} next to {first} (measured; same budgets, "
              "same conversations, each dtype's own chunk):")
        print(f"{'phase':18} {'budget':>7} {'policy':16} {first + ' tok/GB':>14} {other + ' tok/GB':>14} "
              f"{'ratio':>6} {'warm ' + first:>10} {'warm ' + other:>10}")
        for label, budget_gb, name, per_gb, warm, _ in all_rows[first]:
            match = next((r for r in other_rows if r[:3] == (label, budget_gb, name)), None)
            if match is None:
                continue
            ratio = f"{match[3] / per_gb:.2f}x" if per_gb else ("inf" if match[3] else "-")
            print(f"{label:18} {budget_gb:6.1f}G {name:16} {per_gb:14,.0f} {match[3]:14,.0f} {ratio:>6} "
                  f"{'' if warm is None else f'{warm} of 6':>10} {'' if match[4] is None else f'{match[4]} of 6':>10}")


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[2] for r in rows))
    legend = {"lmcache": "LMCache-style (state every chunk, every rank, LRU)",
              "ours-lru": "this project, classes then LRU",
              "ours-value": "this project, classes then recency + prefill saved per byte"}
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [next(r[3] for r in rows if r[0] == lab and r[2] == name) for lab in labels]
        warm = [next(r[4] for r in rows if r[0] == lab and r[2] == name) for lab in labels]
        bars = ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(labels))], vals, width,
                      label=legend.get(name, f"this project, value order, state share {name.rsplit('-s', 1)[-1]}"))
        ax.bar_label(bars, [f"{v / 1000:.0f}k" + ("" if w is None else f"\n{w}/6") for v, w in zip(vals, warm)],
                     fontsize=6)
    ax.set_xticks(range(len(labels)), [f"{lab}\n({next(r[1] for r in rows if r[0] == lab):.0f} GB)"
                                       for lab in labels])
    ax.set_ylabel("resumable tokens per GB")
    ax.set_title("GLM-5.3-Flash, native TP 4 sizes: what a cache budget can resume")
    ax.set_ylim(0, max(r[3] for r in rows) * 1.5)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
