"""vLLM engines with GlmCacheConnector, as the end-to-end tests start them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def connector_engine(model: str | Path, server_url: str, *, dtype: str = "bfloat16",
                     connector: dict[str, Any] | None = None, **engine_args: Any) -> Any:
    """A CPU ``vllm.LLM`` with prefix caching and the connector. ``connector`` goes into
    ``kv_connector_extra_config`` (``timeout_s``, ``retry_after_s``, ...); other keyword
    arguments go to ``vllm.LLM``."""
    from vllm import LLM

    return LLM(
        model=str(model),
        dtype=dtype,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.15,
        max_model_len=4096,
        enforce_eager=True,
        kv_transfer_config={
            "kv_connector": "GlmCacheConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"server": server_url, **(connector or {})},
        },
        **engine_args,
    )
