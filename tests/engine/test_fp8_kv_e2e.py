"""An FP8 KV cache (``kv_cache_dtype="fp8"``) served and cached end to end: the tiny
GLM-5.3-Flash (float32 weights) on vLLM's CPU build with its sparse-MLA rows stored as
float8_e4m3fn bytes, GlmCacheConnector and a real glm-cache-server. One engine.

What is shown: the engine allocates ``uint8`` pages of one byte a value and the connector
resolves its geometry over them (read from the engine, through a worker extension, and
from the server's stored objects); those are half the bytes per token of an engine with
the default cache at bfloat16 and a quarter of one at float32 (the plugin's own
``get_kv_cache_spec`` at those dtypes, the spec vLLM sizes such an engine's pages from);
prompts computed cold and reloaded from the server after ``reset_prefix_cache`` continue
with the same greedy tokens and the same first-token log-prob, exactly (the fp8 engine's
own cold run is the reference). The quantiser, the namespace and the page layout without
an engine: ``tests/unit/test_fp8_kv_rows.py``.
"""

from __future__ import annotations

import pytest

from testing.engines import assert_boundary_reloads_equal_cold, generate_one, random_prompt, stop_engine, tiny_glm_engine

pytestmark = pytest.mark.engine

C = 256  # the tiny checkpoint's unified block stays 128 with fp8 rows (its KDA state page is small)
CONTINUATION = 32
MLA_LAYER = "model.language_model.layers.2.self_attn"  # the tiny checkpoint's first sparse-MLA layer


class Fp8Probe:
    """A vLLM worker extension (``worker_extension_cls``): what this worker holds for the
    sparse-MLA layers and the geometry its connector resolved."""

    def fp8_probe(self) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        runner = self.model_runner  # type: ignore[attr-defined]
        ctx = runner.compilation_config.static_forward_context
        layer = ctx[MLA_LAYER]
        geometry = get_kv_transfer_group()._worker._geometry
        return {
            "cache_dtype": str(layer.kv_cache.dtype),
            "cache_shape": list(layer.kv_cache.shape),
            "row_size": layer.row_size,
            "k_scale": float(layer.k_scale),
            "groups": [
                {"id": g.group_id, "name": g.name, "is_state": g.is_state, "block_size": g.block_size,
                 "bytes_per_block": g.object_bytes_per_block, "dtypes": sorted({p.dtype for p in g.layers})}
                for g in geometry.groups
            ],
        }


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C, kv_cache_dtype="fp8",
                             worker_extension_cls=f"{__name__}.Fp8Probe")
    yield engine
    stop_engine(engine)
    del engine


def _run(llm, prompt, salt, max_tokens=CONTINUATION):
    return generate_one(llm, prompt, salt, max_tokens)


def _auto_bytes_per_token(llm, dtype) -> float:
    """Bytes a token of one sparse-MLA layer takes with ``--kv-cache-dtype auto`` at model
    dtype ``dtype``: the plugin's ``get_kv_cache_spec`` for this checkpoint's config, the
    spec vLLM sizes that engine's pages from (built on the meta device, no engine)."""
    from testing import glm_flash_kv_layouts as L

    cfg = llm.llm_engine.vllm_config.model_config.hf_text_config
    specs = L.plugin_specs(cfg, 1, 128, "auto", model_dtype=dtype)
    spec = specs[MLA_LAYER]
    return spec.real_page_size_bytes / spec.block_size


def test_fp8_engine_pages_are_one_byte_a_value_half_of_bf16(llm):
    import torch

    (probe,) = llm.collective_rpc("fp8_probe")
    assert probe["cache_dtype"] == "torch.uint8" and probe["cache_shape"][-1] == probe["row_size"]
    assert probe["k_scale"] == 1.0  # the tiny checkpoint carries no k_scale: vLLM's uncalibrated 1.0
    attn = {g["name"]: g for g in probe["groups"] if not g["is_state"]}
    assert set(attn) == {"mla_latent", "indexer_cache"}
    assert all(g["dtypes"] == ["uint8"] for g in attn.values())
    block = attn["mla_latent"]["block_size"]
    per_token = sum(g["bytes_per_block"] for g in attn.values()) / block  # every MLA layer's row
    n_mla = per_token / probe["row_size"]
    assert n_mla == int(n_mla) >= 1  # one byte a value
    fp8_layer = per_token / n_mla
    assert fp8_layer * 2 == _auto_bytes_per_token(llm, torch.bfloat16)
    assert fp8_layer * 4 == _auto_bytes_per_token(llm, torch.float32)


def test_fp8_reloads_equal_the_fp8_cold_run_and_the_server_holds_fp8_bytes(llm, server):
    from cache_server.client import CacheClient

    for k in (1, 2):
        assert_boundary_reloads_equal_cold(llm, _run, random_prompt, C, k, seed=90 + 10 * k, salt="fp8-sweep")
    (probe,) = llm.collective_rpc("fp8_probe")
    attn = {g["name"]: g for g in probe["groups"] if not g["is_state"]}
    with CacheClient(server.url, timeout_s=10.0) as c:
        st = c.stats()
    ns = [n for n, v in st["namespaces"].items() if v.get("chunk_size")]
    assert len(ns) == 1 and st["namespaces"][ns[0]]["chunk_size"] == C
    # what the server stores per chunk object of each attention group is the engine's fp8
    # page bytes of a chunk (C tokens): one byte a value, nothing converted on the way
    for name, g in attn.items():
        gid = str(g["id"])
        objects, stored = st["objects_by_group"][gid], st["bytes_by_group"][gid]
        assert objects >= 1 and stored == st["bytes_by_group_name"][name]
        assert stored / objects == g["bytes_per_block"] * C / g["block_size"], (name, st)
