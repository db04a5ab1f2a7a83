"""LMCache 0.5.7's API-key flags, variables and headers, ``--http-host``, ``--prometheus-port``,
its /, /version, /lmc_version, /commit_id routes and the /status read of ``lmcache bench
engine --lmcache-url``, against a real glm-cache-server process (no engine).

LMCache's rules, read from its source (lmcache/security/api_key.py, security/http.py,
v1/multiprocess/http_auth.py): keys come from each ``--api-key-file``/``--http-api-key-file``,
then ``LMCACHE_API_KEY_FILE`` (else the legacy ``LMCACHE_HTTP_API_KEY_FILE``), then
``LMCACHE_API_KEY`` (else ``LMCACHE_HTTP_API_KEY``); a request bears one as ``Authorization:
Bearer`` or ``X-LMCache-API-Key``; every route but ``/`` and ``/healthcheck`` needs it,
``/metrics`` included. ``--prometheus-port`` is its separate ``prometheus_client`` port, which
has no key.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cache_server.client import CacheClient
from testing.server_process import ServerProcess, free_port

KEY = "lmcache-api-key-0123456789abcdef"
OTHER = "another-key-0123456789abcdef-xyz"
CLI_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1"}
KEY_VARS = ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY", "LMCACHE_HTTP_API_KEY_FILE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No LMCACHE_* variable of the caller's reaches the servers started here
    (ServerProcess passes os.environ on)."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def key_file(key: str = KEY) -> str:
    fd, path = tempfile.mkstemp(prefix="lmc-key-")
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """glm-cache-server's command line, expected to exit (a refusal)."""
    return subprocess.run([sys.executable, "-m", "cache_server.cli", "--port", str(free_port()),
                           "--http-port", str(free_port()), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


BEARER = {"Authorization": f"Bearer {KEY}"}
LMC_HEADER = {"X-LMCache-API-Key": KEY}


def assert_lmcache_rule(s: ServerProcess) -> None:
    """Open: / and /healthcheck; every other route, /metrics included, needs the key, in
    either of LMCache's headers; a wrong key is refused."""
    assert get(s.http_url + "/")[0] == 200
    assert json.loads(get(s.http_url + "/")[1]) == {"status": "ok", "service": "glm-cache-server"}
    assert get(s.http_url + "/healthcheck")[0] == 200
    for path in ("/metrics", "/status", "/version", "/lmc_version", "/commit_id", "/conf"):
        assert get(s.http_url + path)[0] == 401, path
        assert get(s.http_url + path, {"Authorization": f"Bearer {OTHER}"})[0] == 401, path
        assert get(s.http_url + path, {"X-LMCache-API-Key": OTHER})[0] == 401, path
        assert get(s.http_url + path, BEARER)[0] == 200, path
        assert get(s.http_url + path, LMC_HEADER)[0] == 200, path
    code, body = get(s.http_url + "/metrics", LMC_HEADER)
    assert b"glm_cache_used_bytes" in body
    # the same key is the ZMQ token
    with CacheClient(s.url, auth_token=KEY) as c:
        c.ping()


def test_api_key_file_and_its_alias_give_lmcaches_rule():
    for flag in ("--api-key-file", "--http-api-key-file"):
        with ServerProcess(flag, key_file()) as s:
            assert_lmcache_rule(s)
            assert "need the token" in s.log() and "but / and /healthcheck need" in s.log()


@pytest.mark.parametrize("new", [True, False], ids=["LMCACHE_API_KEY", "LMCACHE_HTTP_API_KEY"])
def test_key_variables(monkeypatch, new):
    monkeypatch.setenv("LMCACHE_API_KEY" if new else "LMCACHE_HTTP_API_KEY", KEY)
    with ServerProcess() as s:
        assert_lmcache_rule(s)


@pytest.mark.parametrize("new", [True, False], ids=["LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY_FILE"])
def test_key_file_variables(monkeypatch, new):
    monkeypatch.setenv("LMCACHE_API_KEY_FILE" if new else "LMCACHE_HTTP_API_KEY_FILE", key_file())
    with ServerProcess() as s:
        assert_lmcache_rule(s)


def test_the_new_variable_shadows_the_legacy_one_and_says_so(monkeypatch):
    """As in LMCache: LMCACHE_API_KEY set, LMCACHE_HTTP_API_KEY is not read; one start-up
    line names it (never its value)."""
    monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    monkeypatch.setenv("LMCACHE_HTTP_API_KEY", OTHER)
    with ServerProcess() as s:
        assert get(s.http_url + "/status", BEARER)[0] == 200
        assert get(s.http_url + "/status", {"Authorization": f"Bearer {OTHER}"})[0] == 401
        log = s.log()
    assert log.count("LMCACHE_HTTP_API_KEY is set and ignored: LMCACHE_API_KEY takes precedence") == 1
    assert OTHER not in log and KEY not in log


def test_our_flag_keeps_metrics_open_and_takes_lmcaches_header():
    with ServerProcess(auth_token=KEY) as s:
        assert get(s.http_url + "/metrics")[0] == 200
        assert get(s.http_url + "/status")[0] == 401
        assert get(s.http_url + "/status", LMC_HEADER)[0] == 200
        assert get(s.http_url + "/status", BEARER)[0] == 200


def test_our_flag_and_lmcaches_with_the_same_key_follow_lmcaches_rule():
    with ServerProcess("--api-key-file", key_file(), auth_token=KEY) as s:
        assert_lmcache_rule(s)


def test_different_keys_are_refused_naming_their_sources(monkeypatch):
    path = key_file(OTHER)
    out = run_cli("--api-key-file", key_file(), "--api-key-file", path)
    assert out.returncode == 2 and "hold different keys" in out.stderr and path in out.stderr
    out = run_cli("--api-key-file", key_file(), env={"LMCACHE_API_KEY": OTHER})
    assert out.returncode == 2 and "LMCACHE_API_KEY" in out.stderr and OTHER not in out.stderr


def test_a_short_or_spaced_key_is_refused_without_showing_it():
    out = run_cli(env={"LMCACHE_API_KEY": "short-key"})
    assert out.returncode == 2 and "LMCACHE_API_KEY has 9 characters" in out.stderr and "short-key" not in out.stderr
    out = run_cli(env={"LMCACHE_API_KEY_FILE": "/nonexistent/key"})
    assert out.returncode == 2 and "cannot read API key file '/nonexistent/key'" in out.stderr
    out = run_cli("--api-key-file", key_file(), "--insecure-no-auth")
    assert out.returncode == 2 and "--insecure-no-auth contradicts" in out.stderr


def test_unhonoured_lmcache_variables_get_one_line_each(monkeypatch):
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "shm")
    monkeypatch.setenv("LMCACHE_RESP_PASSWORD", "secret-password-value")
    with ServerProcess() as s:
        log = s.log()
    for name in ("LMCACHE_MP_TRANSFER_MODE", "LMCACHE_RESP_PASSWORD"):
        assert log.count(f"{name} is set and not honoured") == 1
    assert "secret-password-value" not in log
    assert "LMCACHE_API_KEY" not in log  # honoured variables (unset here) are not named


class OnHttpHost(ServerProcess):
    """A server whose HTTP is on another loopback address than its ZMQ socket."""

    http_host = "127.0.0.2"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"


def test_http_host_binds_http_apart_from_zmq():
    with OnHttpHost("--host", "127.0.0.1", "--http-host", OnHttpHost.http_host) as s:
        assert get(s.http_url + "/healthcheck")[0] == 200
        with pytest.raises(OSError):  # not on --host
            socket.create_connection(("127.0.0.1", s.http_port), timeout=2).close()
        with CacheClient(s.url) as c:  # ZMQ on --host
            c.ping()
        assert f"(HTTP http://{OnHttpHost.http_host}:{s.http_port})" in s.log()


def test_http_host_beyond_loopback_needs_a_token():
    out = run_cli("--http-host", "0.0.0.0")
    assert out.returncode == 2 and "--http-host 0.0.0.0 is reachable beyond this machine" in out.stderr


def test_prometheus_port_serves_metrics_alone_without_a_key(monkeypatch):
    monkeypatch.setenv("LMCACHE_API_KEY", KEY)
    port = free_port()
    with ServerProcess("--prometheus-port", str(port)) as s:
        code, body = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and b"glm_cache_used_bytes" in body and b"lmcache_mp_l1_memory_usage_bytes" in body
        assert get(f"http://127.0.0.1:{port}/status")[0] == 404  # nothing else there
        assert get(f"http://127.0.0.1:{port}/status", BEARER)[0] == 404
        assert get(s.http_url + "/metrics")[0] == 401  # the HTTP port keeps LMCache's rule
        assert f"Prometheus metrics (--prometheus-port, no token) on http://127.0.0.1:{port}/metrics" in s.log()
    port = free_port()
    out = run_cli("--prometheus-port", str(port), "--http-port", str(port))
    assert out.returncode == 2 and "is --http-port too" in out.stderr


def test_version_routes_and_status_fields():
    from importlib.metadata import version

    ours = version("glm5next-cache")
    with ServerProcess() as s:
        assert json.loads(get(s.http_url + "/lmc_version")[1]) == ours
        assert json.loads(get(s.http_url + "/commit_id")[1]) == ""
        assert json.loads(get(s.http_url + "/version")[1]) == f"{ours}-NA"
        status = json.loads(get(s.http_url + "/status")[1])
        assert status["cache_context_meta"] == {}
        assert status["storage_manager"]["l1_manager"]["memory_total_bytes"] == 1 << 30


def lmcache_bin() -> str:
    here = Path(sys.executable).with_name("lmcache")
    found = str(here) if here.exists() else shutil.which("lmcache")
    assert found, "lmcache-cli is not installed: run scripts/setup.sh (it is in glm5next-cache[test])"
    return found


def test_lmcache_bench_engine_reads_our_status():
    """``lmcache bench engine --lmcache-url`` against our server, no engine: with
    ``--tokens-per-gb-kvcache`` absent it reads /status (200) and stops at LMCache's own
    "No model info" (our engines' hello names no model); the kv-tier-pressure workload reads
    the L1 capacity and the blend check from /status (both 200) and stops for want of a
    tokenizer, before any request to the engine."""
    with ServerProcess("--log-level", "DEBUG") as s:
        base = [lmcache_bin(), "bench", "engine", "--engine-url", f"http://127.0.0.1:{free_port()}",
                "--lmcache-url", s.http_url, "--model", "no-such-model", "--no-interactive"]
        env = {**os.environ, **CLI_ENV}
        out = subprocess.run([*base, "--workload", "random-prefill"], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode != 0
        assert "No model info returned by LMCache server" in out.stdout + out.stderr
        assert "Cannot connect to LMCache server" not in out.stdout + out.stderr
        assert s.log().count('"GET /status HTTP/1.1" 200') == 1
        out = subprocess.run([*base, "--workload", "kv-tier-pressure", "--tokens-per-gb-kvcache", "1000",
                              "--ktp-docs-per-request", "1"], capture_output=True, text=True, timeout=120, env=env)
        text = out.stdout + out.stderr
        assert out.returncode != 0 and "kv-tier-pressure needs a tokenizer" in text
        assert "Could not read L1 capacity" not in text
        assert s.log().count('"GET /status HTTP/1.1" 200') == 2
