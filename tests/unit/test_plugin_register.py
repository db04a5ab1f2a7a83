"""Plugin registration and the hybrid-state declarations vLLM sizes its cache from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import glm5next_plugin
from glm5next_plugin import choose_impl


def test_impl_choice_defaults_to_native_on_cuda_and_rocm_and_plugin_elsewhere(monkeypatch):
    monkeypatch.delenv("GLM5NEXT_IMPL", raising=False)
    assert choose_impl(is_cuda=True) == "native"
    assert choose_impl(is_cuda=False) == "plugin"
    monkeypatch.setenv("GLM5NEXT_IMPL", "plugin")
    assert choose_impl(is_cuda=True) == "plugin"
    monkeypatch.setenv("GLM5NEXT_IMPL", "native")
    assert choose_impl(is_cuda=True) == "native"
    with pytest.raises(ValueError, match="needs CUDA or ROCm"):
        choose_impl(is_cuda=False)
    monkeypatch.setenv("GLM5NEXT_IMPL", "fast")
    with pytest.raises(ValueError, match="expected"):
        choose_impl(is_cuda=False)


@pytest.mark.parametrize("platform,expected", [("cuda", "native"), ("rocm", "native"), ("cpu", "plugin")])
def test_auto_asks_vllm_for_a_cuda_alike_platform(monkeypatch, platform, expected):
    """ROCm has vLLM's native GLM5-Next kernels too (``vllm/models/glm5next/amd``)."""
    from vllm.platforms import PlatformEnum, current_platform

    monkeypatch.delenv("GLM5NEXT_IMPL", raising=False)
    monkeypatch.setattr(type(current_platform), "_enum", getattr(PlatformEnum, platform.upper()))
    assert choose_impl(glm5next_plugin._platform_is_cuda()) == expected


def test_register_is_idempotent_and_registers_the_plugin_class_on_cpu(monkeypatch):
    from vllm import ModelRegistry

    from glm5next_plugin.model import Glm5NextForCausalLM, Glm5NextForConditionalGeneration
    from glm5next_plugin.mtp import Glm5NextMTPModel

    monkeypatch.delenv("GLM5NEXT_IMPL", raising=False)
    monkeypatch.setattr(glm5next_plugin, "_registered_impl", None)
    calls = []
    real = ModelRegistry.register_model
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a: (calls.append(a), real(*a)))
    glm5next_plugin.register()
    glm5next_plugin.register()
    assert calls == [
        ("Glm5NextForConditionalGeneration", Glm5NextForConditionalGeneration),
        ("Glm5NextForCausalLM", Glm5NextForCausalLM),
        ("Glm5NextMTPModel", Glm5NextMTPModel),
    ]
    assert ModelRegistry._try_load_model_cls("Glm5NextForConditionalGeneration") is Glm5NextForConditionalGeneration
    assert ModelRegistry._try_load_model_cls("Glm5NextForCausalLM") is Glm5NextForCausalLM


def test_plugin_marks_only_glm5next_model_types_as_not_mla(tmp_path):
    """vLLM's model-type list says glm5_next is DeepSeek-MLA; with the plugin serving it,
    ``use_mla`` is False for GLM-5.3-Flash configs and unchanged for other MLA models."""
    from transformers import DeepseekV3Config
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS as table
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase as base

    import glm5next_tiny

    glm5next_plugin.register()
    glm5next_plugin.mark_not_mla()  # idempotent: a second call wraps nothing twice
    tok = glm5next_tiny.build_tokenizer(0, 512)
    cfg = glm5next_tiny.build_config(tok)
    for hf, text in ((cfg, cfg.text_config), (cfg.text_config, cfg.text_config)):
        convertor = table[hf.model_type](hf, text)
        assert convertor.is_deepseek_mla() is False
        assert type(convertor).__mro__[1] is base  # wrapped once, around vLLM's default
    deepseek = DeepseekV3Config(kv_lora_rank=32, q_lora_rank=32)
    assert table.get("deepseek_v3", base)(deepseek, deepseek).is_deepseek_mla() is True


def test_register_makes_the_connector_name_known_without_a_module_path(monkeypatch):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from connector.glm_connector import GlmCacheConnector

    monkeypatch.setattr(glm5next_plugin, "_registered_impl", None)
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop("GlmCacheConnector", None)
    glm5next_plugin.register()
    config = KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is GlmCacheConnector
    glm5next_plugin.register_connector_name()  # a second call (another process's plugin load) is harmless
    assert KVConnectorFactory.get_connector_class(config) is GlmCacheConnector
    assert KVConnectorFactory.supports_hma_config(config)


def _vllm_config(linear_heads=2, head_dim=16, kernel=4, tp=1, ssm_dtype="auto"):
    text = SimpleNamespace(linear_num_heads=linear_heads, linear_head_dim=head_dim, linear_conv_kernel_dim=kernel)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text, dtype=torch.float32),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        speculative_config=None,
    )


def test_kda_state_shapes_and_dtypes_follow_vllm_kda_layout():
    from glm5next_plugin.model import Glm5NextForConditionalGeneration as M

    # tiny checkpoint: conv keeps W-1 = 3 raw q|k|v inputs (3 * 2 * 16 channels, "SD"),
    # recurrent is [H, V, K] fp32
    assert M.get_mamba_state_shape_from_config(_vllm_config()) == ((3, 96), (2, 16, 16))
    assert M.get_mamba_state_dtype_from_config(_vllm_config()) == (torch.float32, torch.float32)
    # GLM-5.3-Flash: 64 heads x 128
    assert M.get_mamba_state_shape_from_config(_vllm_config(64, 128)) == ((3, 24576), (64, 128, 128))
    assert M.get_mamba_state_dtype_from_config(_vllm_config(ssm_dtype="bfloat16"))[1] == torch.bfloat16
    conv_copy, rec_copy = M.get_mamba_state_copy_func()
    assert conv_copy.__name__ == "get_conv_copy_spec" and rec_copy.__name__ == "get_temporal_copy_spec"


def test_model_declares_hybrid_state_and_prefix_caching_support():
    from vllm.model_executor.models.interfaces import has_inner_state, is_hybrid

    from glm5next_plugin.model import Glm5NextForConditionalGeneration as M

    assert is_hybrid(M) and has_inner_state(M)
    assert M.supports_mamba_prefix_caching is True


def test_parallelism_and_shared_indexers_are_refused_by_name_and_drafts_are_not(tmp_path):
    from transformers import AutoConfig

    import glm5next_tiny
    from glm5next_plugin.model import check_supported

    ckpt = glm5next_tiny.write_checkpoint(tmp_path / "c", seed=0)
    cfg = AutoConfig.from_pretrained(ckpt)
    single = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    check_supported(cfg, SimpleNamespace(speculative_config=None, parallel_config=single))
    # speculative decoding (MTP, ngram) runs: tests/unit/test_plugin_spec_decode.py, test_plugin_mtp.py
    check_supported(cfg, SimpleNamespace(speculative_config=object(), parallel_config=single))
    tp2 = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    check_supported(cfg, SimpleNamespace(speculative_config=None, parallel_config=tp2))  # TP 2 runs
    pp2 = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)
    with pytest.raises(NotImplementedError, match="pipeline parallelism is not supported"):
        check_supported(cfg, SimpleNamespace(speculative_config=None, parallel_config=pp2))
    # tiny checkpoint: 2 KDA heads, 4 MLA heads; TP 4 cannot split the KDA heads
    tp4 = SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1)
    with pytest.raises(NotImplementedError, match=r"size 4 does not divide \{'linear_num_heads': 2\}"):
        check_supported(cfg, SimpleNamespace(speculative_config=None, parallel_config=tp4))
    cfg.text_config.indexer_types = ["full", "full", "full", "full", "shared"]
    with pytest.raises(NotImplementedError, match=r"'shared' indexer layers \[4\]"):
        check_supported(cfg)
