"""The plugin's engine configuration on CPUs with and without AMX.

vLLM 0.32's CPU platform branches on AMX for MLA models (a 16-token block, and without AMX
prefix caching and chunked prefill switched off). The plugin makes GLM-5.3-Flash non-MLA to
vLLM, so both kinds of CPU get one configuration. Only one kind is under any test run, so
the probe vLLM calls (``torch.cpu._is_amx_tile_supported``) is set both ways here: the
condition this machine lacks is created, not assumed.

Each case runs in a fresh interpreter: vLLM's config objects and plugin registration are
process-global.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs in a child process: argv = checkpoint, amx (0/1), dtype, ssm dtype, keep the plugin's
# not-MLA mark (0/1). Prints one JSON line with what vLLM decided.
_PROBE = r"""
import json, sys
import torch
ckpt, amx, dtype, ssm, keep_mark = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5] == "1"
torch.cpu._is_amx_tile_supported = lambda: amx
import glm5next_plugin
if not keep_mark:  # the control: what vLLM does without the plugin's fix
    glm5next_plugin.mark_not_mla = lambda: None
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
out = {}
try:
    cfg = EngineArgs(model=ckpt, dtype=dtype, enable_prefix_caching=True, max_model_len=4096,
                     gpu_memory_utilization=0.15, mamba_ssm_cache_dtype=ssm).create_engine_config()
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
from glm5next_plugin.mla_layer import SparseMLALayer
from glm5next_plugin.kda_layer import KDAStateLayer
with set_current_vllm_config(cfg):
    from glm5next_plugin.model import Glm5NextForConditionalGeneration
    model = Glm5NextForConditionalGeneration(vllm_config=cfg)
    current_platform.update_block_size_for_backend(cfg)
    mla = next(m for m in model.modules() if isinstance(m, SparseMLALayer))
    kda = next(m for m in model.modules() if isinstance(m, KDAStateLayer))
    mla_spec, kda_spec = mla.get_kv_cache_spec(cfg), kda.get_kv_cache_spec(cfg)
cc, sc = cfg.cache_config, cfg.scheduler_config
print(json.dumps({
    "use_mla": cfg.model_config.use_mla,
    "prefix_caching": cc.enable_prefix_caching,
    "chunked_prefill": sc.enable_chunked_prefill,
    "max_num_batched_tokens": sc.max_num_batched_tokens,
    "mamba_cache_mode": cc.mamba_cache_mode,
    "ssm_dtype": cc.mamba_ssm_cache_dtype,
    "block_size": cc.block_size,
    "mamba_block_size": cc.mamba_block_size,
    "row_size": mla.row_size,
    "mla_page": mla_spec.page_size_bytes,
    "mla_real_page": mla_spec.real_page_size_bytes,
    "kda_page": kda_spec.page_size_bytes,
    "kda_real_page": kda_spec.real_page_size_bytes,
    "kda_dtypes": [str(d) for d in kda_spec.dtypes],
}))
"""


def _probe(ckpt, amx: bool, dtype: str = "float32", ssm: str = "auto", keep_mark: bool = True) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ckpt), str(int(amx)), dtype, ssm, str(int(keep_mark))],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def decided(ckpt):
    return {amx: _probe(ckpt, amx) for amx in (True, False)}


def test_cpus_with_and_without_amx_get_the_same_prefix_caching_config(decided):
    with_amx, without_amx = decided[True], decided[False]
    assert with_amx == without_amx
    assert without_amx["use_mla"] is False
    assert without_amx["prefix_caching"] is True
    assert without_amx["chunked_prefill"] is True
    assert without_amx["mamba_cache_mode"] == "align"
    assert without_amx["mamba_block_size"] == without_amx["block_size"]


def test_page_is_the_plugins_real_row_and_the_padding_ratio_is_pinned(decided):
    """fp32 tiny checkpoint: row = kv_lora_rank 32 + 2 x index_head_dim 16 = 64 values =
    256 B a token. KDA state per slot: conv (3, 96) + recurrent (2, 16, 16), fp32 = 3,200 B.
    vLLM picks the smallest 128-aligned block whose attention page holds a state: 128
    tokens, a 32,768 B page. The MLA page carries no padding (ratio 1.0); the state page is
    padded 10.24x, the cost of align mode's shared block grid at toy sizes."""
    d = decided[False]
    assert d["row_size"] == 64
    assert d["block_size"] == 128
    assert d["mla_page"] == d["mla_real_page"] == 128 * 64 * 4 == 32768
    assert d["kda_real_page"] == (3 * 96 + 2 * 16 * 16) * 4 == 3200
    assert d["kda_page"] == d["mla_page"]
    assert d["kda_page"] / d["kda_real_page"] == pytest.approx(10.24)


def test_without_the_plugins_fix_vllm_breaks_prefix_caching_on_cpus_without_amx(ckpt):
    """The control: vLLM's own decision for this model type, which the plugin's non-MLA mark
    overrides."""
    d = _probe(ckpt, amx=False, keep_mark=False)
    assert "error" in d or d["prefix_caching"] is False, d
    if "error" in d:
        assert "prefix caching" in d["error"] or "prefix-caching" in d["error"]


def test_bf16_recurrent_state_dtype_is_honoured(ckpt):
    d = _probe(ckpt, amx=False, dtype="bfloat16", ssm="bfloat16")
    assert d["ssm_dtype"] == "bfloat16"
    assert d["kda_dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
    # bf16 rows: 64 values x 2 B; the state page shrinks with the recurrent dtype
    assert d["kda_real_page"] == (3 * 96 + 2 * 16 * 16) * 2
    assert d["mla_page"] == d["block_size"] * 64 * 2
