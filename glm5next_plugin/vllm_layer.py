"""What the plugin's cache-holding layers share as vLLM layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def register_layer(layer: object, vllm_config: VllmConfig | None, prefix: str) -> None:
    """Put ``layer`` in vLLM's static forward context under ``prefix``: vLLM finds the layers
    it binds caches and per-step metadata to there. A second layer under one name would take
    the first one's cache, so it is refused. Without ``vllm_config`` (a layer built outside
    an engine) nothing is registered."""
    if vllm_config is None:
        return
    ctx = vllm_config.compilation_config.static_forward_context
    if prefix in ctx:
        raise ValueError(f"Duplicate layer name: {prefix}")
    ctx[prefix] = layer
