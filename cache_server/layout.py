"""Which objects a prefix needs, and how deep a resume can go.

An object is addressed by ``(namespace, chunk hash, group, rank)``. A chunk's objects are
one per group and rank: every rank below the tensor-parallel world size, except that a
group identical on every rank (*replicated*) is stored once, at rank 0. Attention groups
need an object for every chunk of a prefix; a recurrent-state group only at the chunk where
the prefix is resumed. These rules are written once here and used by the store (lookups,
``held``, the chunk tree) and by the L2 tier (promotion).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple


class StoreKey(NamedTuple):
    """The address of one object. A tuple (hashes and compares as the plain 4-tuple, which
    the wire format and callers still build), read by field name."""

    namespace: str
    chunk: bytes  # the chunk's hash
    group: int
    rank: int


def group_ranks(groups: Iterable[int], world_size: int, replicated: Collection[int]) -> list[tuple[int, int]]:
    """Every ``(group, rank)`` holding an object of one chunk: each rank below
    ``world_size``, rank 0 only for a group in ``replicated``."""
    return [(g, r) for g in groups for r in range(1 if g in replicated else world_size)]


def copy_count(groups: Iterable[int], world_size: int, replicated: Collection[int]) -> int:
    """How many objects :func:`group_ranks` lists, counted without listing them (what a
    request claims is checked with this before anything is built from it)."""
    return sum(1 if g in replicated else world_size for g in groups)


def attention_depth(start: int, n: int, has_attn: Callable[[int], bool]) -> int:
    """The first chunk at or after ``start`` (below ``n``) without its attention; ``n`` if none."""
    depth = start
    while depth < n and has_attn(depth):
        depth += 1
    return depth


def resume_depth(start: int, n: int, has_attn: Callable[[int], bool],
                 has_state: Callable[[int], bool] | None) -> int:
    """The resume rule on any presence test: the deepest ``j`` (``start < j <= n``) with
    attention for chunks ``start .. j-1`` and, unless the model has no state groups
    (``has_state`` None), a state at chunk ``j-1``; ``start`` (or less) if there is none."""
    depth = attention_depth(start, n, has_attn)
    if has_state is not None:
        while depth > start and not has_state(depth - 1):
            depth -= 1
    return depth


@dataclass(frozen=True, slots=True)
class Layout:
    """What an engine declared about a namespace at hello: which groups are attention
    (needed for every chunk) and which are state (needed at the resume point), on how
    many ranks, which are stored once, the chunk size in tokens, and what each group
    holds (``group_names``: ``(group, name)`` pairs, e.g. ``kda_state``, ``mla_latent``,
    ``indexer_cache``; empty when the engine named none)."""

    attn_groups: frozenset[int]
    state_groups: frozenset[int]
    world_size: int
    replicated_groups: frozenset[int]
    chunk_tokens: int
    group_names: tuple[tuple[int, str], ...] = ()

    def name_of(self, group: int) -> str:
        """The group's name, or ``group_<id>`` when the engine named none."""
        return dict(self.group_names).get(group, f"group_{group}")

    def ranks(self, groups: Iterable[int]) -> list[tuple[int, int]]:
        """The ``(group, rank)`` pairs of ``groups`` that one chunk holds."""
        return group_ranks(groups, self.world_size, self.replicated_groups)

    def copies(self, groups: Iterable[int]) -> int:
        """How many objects ``groups`` make up in one chunk."""
        return copy_count(groups, self.world_size, self.replicated_groups)
