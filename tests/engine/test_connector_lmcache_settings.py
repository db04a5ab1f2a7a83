"""LMCacheMPConnector's settings work with GlmCacheConnector: switching is the connector's
name only. Keys with the same meaning set ours, values that say what this connector does
anyway are accepted, everything else is refused by name at start-up; per request,
``lmcache.max_offload_tokens`` and ``lmcache.skip_load`` are honoured.

The last test starts a real engine with an LMCache-style ``--kv-transfer-config`` (the
keys seed 003's recipe and LMCache's docs use, on this module's real server)."""

from __future__ import annotations

import json
import shlex
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testing.engines import random_prompt, stop_engine
from testing.server_process import ServerProcess


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


def test_the_key_comes_from_lmcaches_variables_unless_auth_token_file_is_set(tmp_path, monkeypatch):
    key, other = "k" * 20, "o" * 20
    (tmp_path / "key").write_text(key + "\n")
    (tmp_path / "other").write_text(other + "\n")
    assert _settings({}).auth_token is None
    monkeypatch.setenv("LMCACHE_HTTP_API_KEY", other)  # LMCache's legacy name, read when the new one is unset
    assert _settings({}).auth_token == other
    monkeypatch.setenv("LMCACHE_API_KEY", key)  # the new name shadows the legacy one
    assert _settings({}).auth_token == key
    monkeypatch.setenv("LMCACHE_API_KEY_FILE", str(tmp_path / "key"))  # the same key twice is one key
    assert _settings({}).auth_token == key
    assert _settings({"auth_token_file": str(tmp_path / "other")}).auth_token == other  # ours wins
    monkeypatch.setenv("LMCACHE_API_KEY_FILE", str(tmp_path / "other"))  # two keys: no cache, never a guess
    s = _settings({})
    assert s.auth_broken and s.auth_token is None
    monkeypatch.setenv("LMCACHE_API_KEY", "short")
    assert _settings({"auth_token_file": str(tmp_path / "key")}).auth_token == key
    assert _settings({}).auth_broken  # a key the server could not hold is refused here too


def test_per_request_lmcache_params():
    from connector.lmcache_settings import request_params

    assert request_params(None) == (None, False, [])
    assert request_params({"lmcache.max_offload_tokens": 300}) == (300, False, [])
    assert request_params({"lmcache.skip_load": True}) == (None, True, [])
    assert request_params({"lmcache.max_offload_tokens": "x"}) == (None, False, ["lmcache.max_offload_tokens"])
    assert request_params({"lmcache.token_drop": 0.5, "other": 1}) == (None, False, ["lmcache.token_drop"])



PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lmcache.md"
TEST_KEY = "walkthrough-test-key-0123456789"


def _walkthrough(name: str) -> tuple[dict[str, str], list[str], dict]:
    """The page's ``walkthrough:<name>`` block: the exported variables, the server's argv and
    the engine's ``--kv-transfer-config``."""
    block = PAGE.read_text().split(f"<!-- walkthrough:{name} -->", 1)[1].split("```bash\n", 1)[1]
    export, server, engine = [line for line in block.split("```", 1)[0].splitlines() if line.strip()]
    env = dict(kv.split("=", 1) for kv in shlex.split(export)[1:])
    engine_argv = shlex.split(engine)
    return env, shlex.split(server), json.loads(engine_argv[engine_argv.index("--kv-transfer-config") + 1])


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--")
            and i + 1 < len(argv) and not argv[i + 1].startswith("--")} | \
        {a: "" for i, a in enumerate(argv) if a.startswith("--") and (i + 1 == len(argv) or argv[i + 1].startswith("--"))}


def test_the_walkthrough_translates_as_the_server_says():
    """The page's translation is the one glm-cache-server itself asks for: each LMCache flag it
    takes is kept with its value, each it refuses is replaced by the flag its refusal names
    (same value), nothing else changes; the connector config differs only in its name."""
    import subprocess
    import sys

    from cache_server.lmcache_surface import ACCEPTED, REFUSED, SERVER_FLAGS

    lmc_env, lmc, lmc_cfg = _walkthrough("lmcache")
    glm_env, glm, glm_cfg = _walkthrough("glm")
    assert lmc[:2] == ["lmcache", "server"] and glm[0] == "glm-cache-server" and lmc_env == glm_env
    assert lmc_cfg["kv_connector"] == "LMCacheMPConnector"
    assert glm_cfg == {**lmc_cfg, "kv_connector": "GlmCacheConnector"}
    expected = {}
    for flag, value in _flags(lmc[2:]).items():
        status, here = SERVER_FLAGS[flag]
        if status == ACCEPTED:
            expected[flag] = value
            continue
        assert status == REFUSED, flag
        ours = here.split()[0]
        expected[ours] = value
        run = subprocess.run([sys.executable, "-m", "cache_server.cli", flag, value], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and flag in run.stderr and ours in run.stderr, run.stderr
    assert _flags(glm[1:]) == expected


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """The page's glm-cache-server line and engine config, on free loopback ports, a 1 GB
    budget and a test key in the file LMCACHE_API_KEY_FILE names (exported for the server
    and the engine, as the page does), with the tiny checkpoint."""
    from vllm import LLM

    import glm5next_tiny
    from testing.server_process import free_port

    env, argv, config = _walkthrough("glm")
    tmp = tmp_path_factory.mktemp("walkthrough")
    key_file = tmp / "api-key"
    key_file.write_text(TEST_KEY + "\n")
    key_file.chmod(0o600)
    ports = {"--port": free_port(), "--http-port": free_port(), "--prometheus-port": free_port()}
    values = {**ports, "--host": "127.0.0.1", "--http-host": "127.0.0.1", "--l1-size-gb": "1"}
    args = [str(values.get(argv[i - 1], a)) for i, a in enumerate(argv)][1:]
    port_args = [a for i, a in enumerate(args) if a not in ("--port", "--http-port")
                 and args[i - 1] not in ("--port", "--http-port")]
    mp = pytest.MonkeyPatch()
    for name in env:  # the page exports the key file's path; ours is the test's
        mp.setenv(name, str(key_file))
    server = ServerProcess(*port_args, port=ports["--port"], http_port=ports["--http-port"],
                           log_path=tmp / "server.log")
    server.start()
    extra = dict(config["kv_connector_extra_config"], **{"lmcache.mp.host": "tcp://127.0.0.1",
                                                        "lmcache.mp.port": server.port})
    ckpt = tmp / "tiny"
    glm5next_tiny.main([str(ckpt), "--seed", "3"])
    llm = LLM(model=str(ckpt), dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.15,
              max_model_len=4096, enforce_eager=True, max_num_batched_tokens=256,
              prefix_cache_retention_interval=256, seed=0,
              kv_transfer_config={**config, "kv_connector_extra_config": extra})
    try:
        yield llm, server, ports["--prometheus-port"]
    finally:
        stop_engine(llm)
        del llm
        server.stop()
        mp.undo()


def _run(llm, ids, salt, params=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.num_cached_tokens or 0


@pytest.mark.engine
def test_an_lmcache_style_config_serves_and_reloads(walkthrough):
    """The walk-through's engine (LMCache's keys, the connector's name changed, the key from
    LMCACHE_API_KEY_FILE) against the walk-through's server."""
    llm, server, prometheus_port = walkthrough
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
    # the walk-through's scrape: /metrics on the Prometheus port without a key, as LMCache's
    # 9090; on the HTTP port the key is needed (LMCache's rule once a key is set)
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    lookups = [line for line in text.splitlines() if line.startswith("lmcache_mp_lookups_requests_total{")]
    assert lookups and sum(float(line.rsplit(" ", 1)[1]) for line in lookups) >= 4
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.http_url + "/metrics", timeout=5)
    assert refused.value.code == 401
    keyed = urllib.request.Request(server.http_url + "/metrics", headers={"X-LMCache-API-Key": TEST_KEY})
    with urllib.request.urlopen(keyed, timeout=5) as r:
        assert r.status == 200
    log = server.log()
    assert "auth on (LMCACHE_API_KEY_FILE=" in log and "not honoured" not in log  # the key, from the variable
    assert "lease TTL 120 s" in log and "eviction LRU" in log  # --lease-ttl-s and the policy, as translated


def test_vllms_lmcache_shortcut_overrides_the_connector():
    """What the page says of ``--kv-offloading-backend lmcache``: with a size, vLLM names
    LMCacheMPConnector and kv_both over a given --kv-transfer-config (so the shortcut cannot
    select ours); without a size it does nothing."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    def resolved(size):
        # vLLM's own resolution step, alone: a whole VllmConfig naming LMCacheMPConnector
        # goes on to import LMCache's engine side, which lmcache-cli does not ship
        cfg = VllmConfig(cache_config=CacheConfig(kv_offloading_backend="lmcache"),
                         kv_transfer_config=KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_producer",
                                                            kv_connector_module_path="connector"))
        cfg.cache_config.kv_offloading_size = size
        cfg._post_init_kv_transfer_config()
        return cfg.kv_transfer_config.kv_connector, cfg.kv_transfer_config.kv_role

    assert resolved(8) == ("LMCacheMPConnector", "kv_both")
    assert resolved(None) == ("GlmCacheConnector", "kv_producer")
