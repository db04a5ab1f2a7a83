"""A vLLM worker extension (``worker_extension_cls="testing.tp_worker_probe.PluginTPProbe"``) that
lets a test look inside each TP rank through ``LLM.collective_rpc``: the per-rank layer
sizes, and the sparse-MLA cache rows each rank wrote.

Rows are recorded by a forward hook on every ``SparseMLALayer``: after the layer ran, the
rows at this step's ``slot_mapping`` are read back from the rank's cache, so the record is
exactly what the rank stored, step by step, whatever else shares the cache allocation (the
hybrid groups overlay one buffer, so reading whole cache tensors would mix in KDA state
bytes, which differ between ranks by design).
"""

from __future__ import annotations

from typing import Any

import torch


class PluginTPProbe:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``)."""

    def _plugin_model(self):
        return self.model_runner.model  # type: ignore[attr-defined]

    def glm_layer_sizes(self) -> dict[str, Any]:
        """This rank's TP place and the per-rank sizes of the first KDA and MLA layers."""
        from glm5next_plugin.kda_layer import KDAStateLayer
        from glm5next_plugin.mla_layer import SparseMLALayer

        model = self._plugin_model()
        kda = next(m for m in model.modules() if isinstance(m, KDAStateLayer))
        mla = next(m for m in model.modules() if isinstance(m, SparseMLALayer))
        mlp = model.model.language_model.layers[0].mlp
        return {
            "rank": model.tp.rank,
            "size": model.tp.size,
            "kda_heads": kda.num_heads,
            "kda_q_proj": list(kda.q_proj.weight.shape),
            "kda_recurrent_state": list(kda.kv_cache[1].shape[1:]),
            "kda_conv_state": list(kda.kv_cache[0].shape[1:]),
            "mla_heads": mla.num_heads,
            "mla_kv_a_proj": list(mla.kv_a_proj_with_mqa.weight.shape),
            "mlp_gate_proj": list(mlp.gate_proj.weight.shape),
        }

    def glm_record_mla_rows(self) -> None:
        """Start recording the rows every sparse-MLA layer writes (from now on)."""
        from vllm.forward_context import get_forward_context

        from glm5next_plugin.mla_layer import SparseMLALayer

        self._glm_rows: dict[str, list[torch.Tensor]] = {}

        def hook(layer, _inputs, _output) -> None:
            metadata = get_forward_context().attn_metadata
            if metadata is None:
                return
            md = metadata[layer.prefix]
            slots = md.slot_mapping.long()
            slots = slots[slots >= 0]
            cache = layer.kv_cache[:, 0]
            bs = cache.shape[1]
            self._glm_rows.setdefault(layer.prefix, []).append(cache[slots // bs, slots % bs].clone())

        for m in self._plugin_model().modules():
            if isinstance(m, SparseMLALayer):
                m.register_forward_hook(hook)

    def glm_mla_rows(self) -> dict[str, list[list[float]]]:
        """Every recorded row per layer, in the order written (plain lists: any fp32 value
        survives the RPC exactly)."""
        return {name: torch.cat(parts).float().tolist() for name, parts in sorted(self._glm_rows.items())}

    def glm_record_pool_choices(self) -> None:
        """Start recording, for every query row that chooses among more pools than it keeps
        (the sparse rows), its position, the pools it kept and how close the choice was: the
        relative gap between the last kept and the best dropped score (0 is a tie). Summation
        order differs between TP sizes, so a choice this close may go either way."""
        from glm5next_plugin import sparse_mla

        self._glm_choices: list[dict[str, list]] = []
        select_pools, top_pool_set = sparse_mla.select_pools, sparse_mla.top_pool_set
        gaps: list[torch.Tensor] = []

        def recording_top_pool_set(scores: torch.Tensor, keep: int) -> torch.Tensor:
            best = scores.topk(keep + 1, dim=-1).values  # every row here sees more than keep pools
            gaps.append((best[:, keep - 1] - best[:, keep]) / best[:, keep - 1].abs().clamp(min=1e-30))
            return top_pool_set(scores, keep)

        def recording_select_pools(index_q, head_weights, pooled, positions, kpool, topk, *args, **kw):
            gaps.clear()
            chosen = select_pools(index_q, head_weights, pooled, positions, kpool, topk, *args, **kw)
            sparse = ((positions + 1) // kpool).clamp(max=pooled.shape[0]) > topk // kpool
            if sparse.any():
                self._glm_choices.append({
                    "positions": positions[sparse].tolist(),
                    "chosen": chosen[sparse].tolist(),
                    "gaps": torch.cat(gaps).tolist(),
                })
            return chosen

        sparse_mla.top_pool_set = recording_top_pool_set
        sparse_mla.select_pools = recording_select_pools

    def glm_pool_choices(self) -> list[dict[str, list]]:
        """What :meth:`glm_record_pool_choices` recorded, call by call (layers in order)."""
        return self._glm_choices
