"""A KV connector that does nothing, for ``validation/bench_overhead.py``.

vLLM runs its own connector machinery whenever any connector is configured (scheduler
hooks, per-step connector metadata and outputs, a different block-freeing rule for
``kv_both``). An engine with this connector next to one without any and one with
``GlmCacheConnector`` splits the throughput cost into vLLM's share (null / off) and
ours (GlmCacheConnector / null). It finds nothing, loads nothing and saves nothing."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # as GlmCacheConnector

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return False, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
