"""A connector scheduler side without an engine, for tests and benchmarks: hand-built vLLM
configs (the shapes vLLM hands the connector), real ``vllm.v1.request.Request`` objects."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


@cache
def weights_dir() -> Path:
    """A model directory with one small safetensors file (the connector names the weights
    by their content), removed when the process exits."""
    from safetensors.torch import save_file

    path = Path(tempfile.mkdtemp(prefix="glm-sched-weights-"))
    atexit.register(shutil.rmtree, path, True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    return path


def scheduler_side(url: str, *, block: int = 256, tp: int = 1, timeout_s: float = 1.0,
                   retry_after_s: float = 1.0, hash_algo: str = "sha256", latent_rows: bool = False,
                   chunk_keys: str = "auto", hash_block: int | None = None, speculative: Any = None):
    """A :class:`connector.scheduler.SchedulerSide` for one state group and one attention
    group of ``block`` tokens, TP ``tp``, talking to the server at ``url``; ``hash_algo`` is
    vLLM's ``--prefix-caching-hash-algo``. ``latent_rows``: the attention group has the
    sparse-MLA plugin's shape (one K-only row per token, the same bytes on every rank), so
    it is stored once for all ranks, as GLM-5.3-Flash's is. ``chunk_keys``: the connector's
    setting of that name; ``hash_block``: the tokens per vLLM block hash (default ``block``);
    ``speculative``: vLLM's ``speculative_config`` (None: drafts off)."""
    from vllm.v1 import kv_cache_interface as vkv

    from connector.config import Settings
    from connector.geometry import resolve_geometry
    from connector.scheduler import SchedulerSide

    state = vkv.MambaSpec(block_size=block, shapes=((3, 64), (2, 16, 16)),
                          dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")
    attn = vkv.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                 **({"head_size_v": 0} if latent_rows else {}))
    kv = vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec(["layers.0"], state), vkv.KVCacheGroupSpec(["layers.1"], attn)],
    )
    vllm = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto", mamba_cache_dtype="auto",
                                     mamba_ssm_cache_dtype="auto", block_size=block, mamba_block_size=block,
                                     prefix_caching_hash_algo=hash_algo),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=tp,
                                        pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(weights_dir()), revision=None, dtype=torch.float32,
                                     served_model_name="tiny-sched"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=block),
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        speculative_config=speculative,
    )
    kv.hash_block_size = hash_block or block  # what vLLM's engine core sets at start-up
    geo = resolve_geometry(vllm, kv)
    settings = Settings(url=url, timeout_s=timeout_s, retry_after_s=retry_after_s, chunk_keys=chunk_keys)
    return SchedulerSide(vllm, kv, settings, geo, None)


def request(req_id: str, token_ids: list[int], salt: str | None = None, hash_block: int | None = None):
    """A vLLM request; with ``hash_block``, its ``block_hashes`` computed as vLLM's engine
    does on arrival (sha256, the default algorithm), at that many tokens per block."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from testing.vllm_keys import vllm_hashed_request

    if hash_block is not None:
        return vllm_hashed_request(req_id, token_ids, hash_block, salt)
    return Request(req_id, token_ids, SamplingParams(max_tokens=1), None, cache_salt=salt)
