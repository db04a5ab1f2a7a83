"""Scheduler side: what it knows of the weights its workers compute with
(:class:`WeightsView`), the identity those weights give the namespace
(:func:`runtime_identity`), and what an in-place change does to the requests under way
(:func:`connector.loads.fence_under_way`). The workers' half is :mod:`connector.live_weights`.

The namespace names the weights the workers compute with (the workers name them by content
and report changes with each step's output). After an in-place change the engine moves to
the new weights' namespace: requests under way are not cached further (their KV mixes both
weights), loads planned for the old weights fail (vLLM recomputes), saves planned for them
are dropped, and until vLLM's prefix cache is reset, requests resuming from it are not
cached (it holds blocks of the old weights: :meth:`WeightsView.stale_map`). Each step's plan
names the weights it was made for (:meth:`WeightsView.stamp`), so a worker whose weights
changed before the scheduler heard of it moves nothing of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blake3 import blake3

from connector.metadata import UNNAMED, UNVERIFIED

if TYPE_CHECKING:
    from connector.metadata import GlmConnectorMetadata


class WeightsView:
    """What the scheduler side knows of its workers' weights: one token per rank (None:
    as loaded at start-up), and whether it knows them at all (``verified``: False from a
    reset until every rank answered it). It also keeps vLLM's prefix-cache map (a new
    object after each reset of that cache) as of the last two plans and the last reset,
    which tell whether that cache holds blocks of old weights after a change."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tokens: tuple[str | None, ...] = (None,) * world_size
        self.seq = 0
        self.verified = True
        self._answers: dict[int, tuple[int, str | None]] = {}
        self._last_map: Any = None  # vLLM's prefix-cache map at the last plan
        self._prev_map: Any = None  # and at the plan before
        self._reset_fresh = False  # the last reset replaced it

    def expected(self) -> tuple[str | None, ...] | str | None:
        """The plan's ``weights``: None while every rank has its start-up weights."""
        if not self.verified:
            return UNVERIFIED
        return None if all(t is None for t in self.tokens) else self.tokens

    def stamp(self, meta: GlmConnectorMetadata, block_map: Any) -> bool:
        """Name in a step's plan the weights it is made for, noting vLLM's prefix-cache map
        ``block_map`` at this step; False (nothing may be saved) while they are not known."""
        meta.weights, meta.weights_seq = self.expected(), self.seq
        self._prev_map, self._last_map = self._last_map, block_map
        return self.verified

    def reset(self, block_map: Any = None) -> None:
        """vLLM cleared its caches (a sleep, a pause before a weight update): the weights
        may change before the next step; ask every rank. ``block_map``: vLLM's prefix-cache
        map now (another object than at the last plan where the reset replaced it)."""
        self._reset_fresh = block_map is not self._last_map
        self.seq += 1
        self.verified = False

    def report(self, reports: dict[int, tuple[int, str | None]]) -> tuple[tuple, tuple, bool] | None:
        """Take the workers' reports; ``(old tokens, new tokens, answered a reset)`` when
        the scheduler learned something (the weights changed, or every rank answered the
        outstanding reset), else None."""
        for rank, (seq, token) in reports.items():
            if 0 <= rank < self.world_size:
                self._answers[rank] = (seq, token)
        latest = tuple(self._answers.get(r, (0, self.tokens[r]))[1] for r in range(self.world_size))
        if not self.verified:
            if any(self._answers.get(r, (-1, None))[0] != self.seq for r in range(self.world_size)):
                return None
            self.verified = True
            old, self.tokens = self.tokens, latest
            return old, latest, True
        if latest == self.tokens:
            return None
        old, self.tokens = self.tokens, latest
        return old, latest, False

    def stale_map(self, current: Any, answered_reset: bool) -> Any:
        """After the weights changed (``answered_reset``: seen as every rank answered a
        reset): vLLM's prefix-cache map ``current`` where it still holds blocks of the old
        weights, None where what it holds was computed by the weights the workers just
        named: after a reset that replaced it, or when it was replaced between the last two
        steps (``LLM.reset_prefix_cache()`` after ``reload_weights``: no step ran in between)."""
        replaced = current is not None and current is self._last_map and self._last_map is not self._prev_map
        return None if (answered_reset and self._reset_fresh) or replaced else current


def change_line(tokens: tuple[str | None, ...], answered_reset: bool, before: str | None, after: str,
                under_way: int, stale_map: bool) -> str:
    """The log line of an in-place change to weights ``tokens`` (seen as every rank answered
    a reset, or after ``load_weights``): the namespace ``before`` and ``after``, how many
    requests were under way, and whether vLLM's prefix cache still holds old blocks."""
    seen = "seen after a reset" if answered_reset else "seen after load_weights"
    stale = ("; vLLM's prefix cache still holds blocks of the old weights: requests resuming from it are not "
             "cached until it is reset") if stale_map else ""
    return (f"GlmCacheConnector: the weights changed in place ({seen}, content digests "
            f"{[t or 'start-up' for t in tokens]}): namespace {before} -> {after}; {under_way} request(s) under "
            f"way are not cached further{stale}")


def runtime_identity(identity: dict[str, Any] | None, tokens: tuple[str | None, ...]) -> dict[str, Any] | None:
    """The identity for weights ``tokens``: the start-up one while every rank has its
    start-up weights; else the same with the weights named by every rank's content digest
    (replicas updated in place to the same weights, on the same layout, share this
    namespace); None where a rank cannot name its weights."""
    if identity is None or any(t == UNNAMED for t in tokens):
        return None
    if all(t is None for t in tokens):
        return identity
    startup = f"files:{identity.get('weights')}"  # a rank still on its start-up weights: the files' digest
    live = blake3("|".join(startup if t is None else t for t in tokens).encode()).hexdigest()[:32]
    changed = {**identity, "weights": f"live:{live}", "snapshot": None}
    if isinstance(changed.get("draft"), dict):  # the live digest covers the drafter's parameters too
        changed["draft"] = {**changed["draft"], "weights": "live"}
    return changed
