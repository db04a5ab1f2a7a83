"""A vLLM worker extension (``worker_extension_cls="tp_worker_probe.PluginTPProbe"``) that
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
