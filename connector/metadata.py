"""What the two halves of the connector pass each other, as plain picklable data: the plan
the scheduler side hands the worker side each step (which objects to load into which
blocks, which blocks to save under which keys), and the saves the workers report as not
landed."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ObjectMove:
    """One cache object and the blocks it maps to; None blocks are skipped on load
    (pages vLLM already holds from its local prefix cache)."""

    chunk_hash: bytes
    group_id: int
    block_ids: list[int | None]
    # State saves only: the hash of the previous state on this request's path, so the
    # server can evict the superseded one first (snapshot-aware retention).
    prev: bytes | None = None
    # Saves only: the hash of the chunk before this one (None: the first chunk; b"": not
    # known), so the server knows which prefixes are resumable and what nothing can resume.
    parent: bytes | None = b""
    # Saves only: the request whose blocks these are, so a failed save can be traced
    # back to it ("" : none, e.g. a local state offered again; its failure is only logged).
    req_id: str = ""


@dataclass
class LoadJob:
    """The objects of one request's hit. ``refused`` (the hit cannot be loaded as
    planned): the worker loads nothing and reports the load failed, so vLLM recomputes."""

    req_id: str
    objects: list[ObjectMove]
    refused: str | None = None


# What a plan or a report says of weights besides a content digest (None: as loaded at
# start-up): connector.live_weights names them on the worker side, connector.weights_view
# on the scheduler side.
UNNAMED = "unnamed"  # a worker that cannot read its weights' content
UNVERIFIED = "unverified"  # the scheduler does not know the weights (after a reset)


@dataclass
class GlmConnectorMetadata(KVConnectorMetadata):
    namespace: str = ""
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[ObjectMove] = field(default_factory=list)
    # The weights this step's loads and saves were planned for
    # (connector.weights_view.WeightsView.expected): None, every rank's weights as loaded
    # at start-up; a tuple, each rank's content digest after an in-place change; a string
    # (UNVERIFIED), not known (plan nothing).
    # A worker whose weights are other moves nothing of this step.
    weights: tuple[str | None, ...] | str | None = None
    # Bumped by every reset of the connector (sleep, a pause that clears caches): the
    # workers name their weights again and answer with it.
    weights_seq: int = 0


# Why a save did not land on the server. Transient ones are retried by the scheduler
# while the request still holds its blocks; the others end this request's saves.
SAVE_DROPPED = "drop"  # over max_pending_save_bytes: never copied, never sent
SAVE_TIMEOUT = "timeout"  # the server did not answer within the batch's deadline
SAVE_NO_SPACE = "no_space"  # the server's budget was held by leased objects
SAVE_TOO_LARGE = "too_large"  # larger than the server accepts: retrying cannot help
SAVE_SERVER_ERROR = "server_error"  # an error reply (unauthorized included)
TRANSIENT_SAVE_FAILURES = frozenset({SAVE_DROPPED, SAVE_TIMEOUT, SAVE_NO_SPACE, SAVE_SERVER_ERROR})


@dataclass(frozen=True)
class SaveFailure:
    req_id: str
    chunk_hash: bytes
    group_id: int
    reason: str


@dataclass
class GlmWorkerMeta(KVConnectorWorkerMetadata):
    """Saves that did not land since the last step, from every worker rank."""

    failed_saves: list[SaveFailure] = field(default_factory=list)
    # Each rank's weights, when they changed or the scheduler asked: rank -> (the
    # weights_seq answered, the rank's token: connector.live_weights.LiveWeights).
    weights: dict[int, tuple[int, str | None]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, GlmWorkerMeta):
            return GlmWorkerMeta(self.failed_saves + other.failed_saves, {**self.weights, **other.weights})
        return self
