"""Tensor parallelism for the plugin: which rank this is, how full tensors are cut, and the
one collective the model needs.

The layers are plain ``nn.Linear`` modules built at their per-rank size (not vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear``), so the model still loads checkpoints by
name (:func:`glm5next_plugin.weight_loading.load_by_name`) and TP 1 is byte-for-byte the unsharded
model. A module that holds sharded parameters lists them in ``tp_shards``
(``{parameter name: Shard}``); the loader cuts this rank's piece out of the full checkpoint
tensor, which is the same file for every TP size.

Row-parallel outputs (KDA and MLA ``o_proj``, MLP ``down_proj``, the experts' ``down_proj``)
are partial sums; :class:`glm5next_plugin.model.DecoderLayer` all-reduces each block's
output once (:meth:`TPInfo.all_reduce`). Everything else is replicated and computed
identically on every rank, in particular the MLA latent and the indexer, whose cache rows
must be the same bytes on every rank (an external cache stores them once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Shard:
    """How a parameter is cut: along ``dim``, which holds ``parts`` equal segments laid end
    to end (q|k|v of the KDA conv: 3; gate|up of the fused experts: 2). Each segment is
    split into ``size`` equal pieces and rank ``r`` keeps piece ``r`` of every segment, so a
    fused tensor stays fused per rank."""

    dim: int
    parts: int = 1


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group (``size`` 1: no parallelism)."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> int:
        """``n / size``, refusing sizes that do not divide (named in the message)."""
        if n % self.size:
            raise ValueError(f"glm5next plugin: {what} = {n} is not divisible by tensor parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of all ranks (identity at TP 1).

        vLLM's TP all-reduce leaves the same sum on every rank, which the replicated parts
        downstream (mHC, router, indexer, MLA cache rows) rely on to stay identical."""
        if self.size == 1:
            return x
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)


TP1 = TPInfo()


def tp_info(vllm_config: VllmConfig | None) -> TPInfo:
    """The rank and size vLLM runs this worker with. At TP 1 the distributed state is not
    touched (a model may be built where vLLM's groups were never initialised)."""
    if vllm_config is None:
        return TP1
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return TP1
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != size:
        raise RuntimeError(
            f"glm5next plugin: vLLM's TP group has {get_tensor_model_parallel_world_size()} ranks, "
            f"config says {size}"
        )
    return TPInfo(get_tensor_model_parallel_rank(), size)


def shard_tensor(full: torch.Tensor, shard: Shard, tp: TPInfo) -> torch.Tensor:
    """Rank ``tp.rank``'s piece of the full tensor ``full`` (see :class:`Shard`)."""
    if tp.size == 1:
        return full
    n = full.shape[shard.dim]
    if n % (shard.parts * tp.size):
        # would silently misplace channels between segments or ranks
        raise ValueError(
            f"glm5next plugin: cannot shard dim {shard.dim} of {tuple(full.shape)} "
            f"into {shard.parts} segment(s) x {tp.size} ranks"
        )
    seg, step = n // shard.parts, n // (shard.parts * tp.size)
    pieces = [full.narrow(shard.dim, p * seg + tp.rank * step, step) for p in range(shard.parts)]
    return torch.cat(pieces, dim=shard.dim) if len(pieces) > 1 else pieces[0]
