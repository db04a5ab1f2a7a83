"""What differs between the vLLM releases this project supports (0.32 and 0.33), in one place.

* KV cache planning: vLLM 0.33 moved ``get_kv_cache_groups``,
  ``get_kv_cache_config_from_groups``, ``_get_kv_cache_bytes_per_block`` and
  ``kv_cache_groups_tp_replicas`` from ``vllm.v1.core.kv_cache_utils`` to
  ``vllm.v1.core.kv_cache_planning`` (same signatures). Import them from here.
* Align-mode state snapshots: vLLM 0.32 honours ``--mamba-cache-mode``; 0.33 ignores it
  (deprecated, "no effect: Mamba prefix caching follows --enable-prefix-caching",
  vllm/engine/arg_utils.py:462-465) and selects align mode whenever prefix caching is on.
  :func:`align_mode_flags` names the flags that give align mode on the installed vLLM.
"""

from __future__ import annotations

from importlib.util import find_spec

if find_spec("vllm.v1.core.kv_cache_planning") is not None:  # vLLM >= 0.33
    from vllm.v1.core.kv_cache_planning import (
        _get_kv_cache_bytes_per_block,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        kv_cache_groups_tp_replicas,
    )
else:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[no-redef]
        _get_kv_cache_bytes_per_block,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        kv_cache_groups_tp_replicas,
    )

__all__ = [
    "_get_kv_cache_bytes_per_block",
    "align_mode_flags",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "kv_cache_groups_tp_replicas",
    "mamba_cache_mode_flag_honoured",
]


def mamba_cache_mode_flag_honoured(version: str | None = None) -> bool:
    """Whether ``--mamba-cache-mode`` still selects the state cache mode (vLLM before 0.33)."""
    from packaging.version import Version

    if version is None:
        import vllm

        version = vllm.__version__
    return Version(version).release[:2] < (0, 33)


def align_mode_flags(version: str | None = None) -> str:
    """The ``vllm serve`` flags that give recurrent layers align-mode snapshots."""
    if mamba_cache_mode_flag_honoured(version):
        return "--enable-prefix-caching --mamba-cache-mode align"
    return "--enable-prefix-caching"
