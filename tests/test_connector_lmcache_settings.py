"""LMCacheMPConnector's settings work with GlmCacheConnector: switching is the connector's
name only. Keys with the same meaning set ours, values that say what this connector does
anyway are accepted, everything else is refused by name at start-up; per request,
``lmcache.max_offload_tokens`` and ``lmcache.skip_load`` are honoured.

The last test starts a real engine with an LMCache-style ``--kv-transfer-config`` (the
keys seed 003's recipe and LMCache's docs use, on this module's real server)."""

from __future__ import annotations

import pytest

from tests.engines import random_prompt


def _settings(extra):
    from vllm.config import KVTransferConfig

    from connector.config import Settings

    return Settings.from_config(KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both",
                                                 kv_connector_extra_config=extra))


def test_host_port_and_decode_saves_mean_ours():
    s = _settings({"lmcache.mp.host": "tcp://10.0.0.7", "lmcache.mp.port": 6001,
                   "lmcache.mp.save_decode_cache": True})
    assert (s.url, s.save_decode) == ("tcp://10.0.0.7:6001", True)
    assert _settings({"lmcache.mp.port": "5557"}).url == "tcp://localhost:5557"  # LMCache's default host
    assert _settings({"lmcache.mp.host": "10.0.0.7"}).url == "tcp://10.0.0.7:5555"
    assert _settings({"lmcache.mp.server_urls": "tcp://10.0.0.8:5555"}).url == "tcp://10.0.0.8:5555"
    assert _settings({}).url == "tcp://127.0.0.1:5555" and not _settings({}).save_decode
    # the same URL both ways is fine; two different ones are not
    assert _settings({"server": "tcp://10.0.0.7:6001", "lmcache.mp.host": "tcp://10.0.0.7",
                      "lmcache.mp.port": 6001}).url == "tcp://10.0.0.7:6001"
    with pytest.raises(ValueError, match="server"):
        _settings({"server": "tcp://10.0.0.9:6001", "lmcache.mp.port": 6001})


def test_values_that_are_what_we_do_are_accepted():
    s = _settings({"lmcache.mp.hash_algorithm": "blake3", "lmcache.mp.nonblocking_lookup_status": True,
                   "lmcache.mp.eager_prefetch": False, "lmcache.mp.lazy_offload": False,
                   "lmcache.mp.mp_transfer_mode": "engine_driven", "lmcache.mp.autostart": False})
    assert s.url == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize("extra, named", [
    ({"lmcache.mp.hash_algorithm": "sha256_cbor"}, "lmcache.mp.hash_algorithm"),
    ({"lmcache.mp.mq_timeout": 30}, "lmcache.mp.mq_timeout"),
    ({"lmcache.mp.heartbeat_interval": 10}, "lmcache.mp.heartbeat_interval"),
    ({"lmcache.mp.lazy_offload": True}, "lmcache.mp.lazy_offload"),
    ({"lmcache.mp.lazy_offload_policy": "FIFO"}, "lmcache.mp.lazy_offload_policy"),
    ({"lmcache.mp.mp_transfer_mode": "lmcache_driven"}, "lmcache.mp.mp_transfer_mode"),
    ({"lmcache.mp.autostart": True}, "lmcache.mp.autostart"),
    ({"lmcache.mp.server_urls": "tcp://a:1,tcp://b:1"}, "lmcache.mp.server_urls"),
    ({"lmcache.mp.save_decode_cache": "yes"}, "lmcache.mp.save_decode_cache"),
    ({"lmcache.chunk_size": 256}, "lmcache.chunk_size"),
    ({"lmcache.mp.some_future_knob": 1}, "lmcache.mp.some_future_knob"),
])
def test_what_cannot_be_honoured_is_refused_by_name(extra, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        _settings(extra)


def test_per_request_lmcache_params():
    from connector.lmcache_settings import request_params

    assert request_params(None) == (None, False, [])
    assert request_params({"lmcache.max_offload_tokens": 300}) == (300, False, [])
    assert request_params({"lmcache.skip_load": True}) == (None, True, [])
    assert request_params({"lmcache.max_offload_tokens": "x"}) == (None, False, ["lmcache.max_offload_tokens"])
    assert request_params({"lmcache.token_drop": 0.5, "other": 1}) == (None, False, ["lmcache.token_drop"])



@pytest.fixture(scope="module")
def lmcache_style_engine(tmp_path_factory, server):
    """The tiny checkpoint behind an LMCache-style kv-transfer config: LMCache's keys and
    values, only the connector's name changed (no module path: the plugin registers it)."""
    from vllm import LLM

    from glm5next_plugin import tiny_checkpoint

    ckpt = tmp_path_factory.mktemp("tiny_lmc")
    tiny_checkpoint.main([str(ckpt), "--seed", "3"])
    llm = LLM(model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
              max_model_len=4096, enforce_eager=True, max_num_batched_tokens=256,
              prefix_cache_retention_interval=256, seed=0,
              kv_transfer_config={
                  "kv_connector": "GlmCacheConnector",  # was "LMCacheMPConnector"
                  "kv_role": "kv_both",
                  "kv_connector_extra_config": {
                      "lmcache.mp.host": "tcp://127.0.0.1",
                      "lmcache.mp.port": server.port,
                      "lmcache.mp.save_decode_cache": False,
                      "lmcache.mp.hash_algorithm": "blake3",
                  },
              })
    yield llm
    del llm


def _run(llm, ids, salt, params=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0


@pytest.mark.engine
def test_an_lmcache_style_config_serves_and_reloads(lmcache_style_engine):
    llm = lmcache_style_engine
    ids = random_prompt(900, seed=11)
    cold, hit = _run(llm, ids, "lmc")
    assert hit == 0
    llm.reset_prefix_cache()
    again, hit = _run(llm, ids, "lmc")
    assert hit == 768 and again == cold  # the strict prefix, from glm-cache-server
    # lmcache.skip_load: computed cold although the server holds it
    llm.reset_prefix_cache()
    assert _run(llm, ids, "lmc", {"lmcache.skip_load": True}) == (cold, 0)
    # lmcache.max_offload_tokens: a new prompt saved only up to 300 tokens (one chunk)
    other = random_prompt(900, seed=12)
    llm.reset_prefix_cache()
    first = _run(llm, other, "lmc", {"lmcache.max_offload_tokens": 300})
    llm.reset_prefix_cache()
    assert _run(llm, other, "lmc") == (first[0], 256)
