"""vLLM KV-transfer connector for glm-cache-server.

``GlmCacheConnector`` is resolved lazily: vLLM's factory does
``getattr(import_module("connector"), "GlmCacheConnector")``, while users of the light
parts (``connector.keys``) must not pay for importing vLLM and torch.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "GlmCacheConnector":
        from connector.glm_connector import GlmCacheConnector

        return GlmCacheConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
