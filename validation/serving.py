"""Run `vllm serve` as a child process and talk to it: the harness of the demo and notebooks.

Measurements go through the OpenAI-compatible HTTP API, as an operator would see them:
time to first token from a streamed chat completion, cached prompt tokens from the usage
report, log-probs of the generated tokens.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testing.children import popen_tied
from testing.server_process import free_port

# What vLLM's CPU platform writes into the environment of a process that builds an engine
# config (vllm/platforms/cpu.py, check_and_update_config): after an in-process engine (a
# test's vllm.LLM) they would reach every later `vllm serve` child and pick for it what its
# own config would not. VLLM_SSM_CONV_STATE_LAYOUT in particular: "SD" there, where an
# engine with NixlConnector needs (and picks itself) "DS". A child gets the user's value only.
_WRITTEN_BY_VLLM = ("VLLM_SSM_CONV_STATE_LAYOUT", "TORCHINDUCTOR_COMPILE_THREADS",
                    "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS")
_USER_ENV = {k: os.environ[k] for k in _WRITTEN_BY_VLLM if k in os.environ}


def user_environment() -> dict[str, str]:
    """This process's environment without what an in-process vLLM engine wrote into it."""
    env = {k: v for k, v in os.environ.items() if k not in _WRITTEN_BY_VLLM}
    env.update(_USER_ENV)
    return env


def connector_config(server_url: str, module_path: bool = False, **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON that wires vLLM to a glm-cache-server. The plugin
    registers the connector's name, so ``kv_connector_module_path`` is optional."""
    config: dict[str, Any] = {"kv_connector": "GlmCacheConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"server": server_url, **extra}}
    if module_path:
        config["kv_connector_module_path"] = "connector"
    return json.dumps(config)


class VllmServer:
    """``vllm serve MODEL`` on a free loopback port, CPU settings by default."""

    def __init__(self, model: str | Path, *extra_args: str, kv_transfer_config: str | None = None,
                 max_model_len: int = 8192, gpu_memory_utilization: float = 0.15,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None) -> None:
        self.port = free_port()
        self.model = str(model)
        self.args = ["--port", str(self.port), "--host", "127.0.0.1", "--enable-prefix-caching",
                     "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(gpu_memory_utilization),
                     "--enable-prompt-tokens-details", "--served-model-name", "model", *extra_args]
        if kv_transfer_config:
            self.args += ["--kv-transfer-config", kv_transfer_config]
        # Dev mode exposes POST /reset_prefix_cache, which validation needs.
        self.env = {**user_environment(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "vllm.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._relaunches = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0, progress: bool = True) -> VllmServer:
        return self.launch().wait_ready(timeout_s, progress)

    def launch(self) -> VllmServer:
        """Start the process and return at once (start several, then :meth:`wait_ready` for
        each, so their start-ups overlap). Call from the thread that will stop it: the child
        is tied to the thread that launched it (testing.children)."""
        cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", self.model, *self.args]
        self._log = open(self.log_path, "ab")
        self.proc = popen_tied(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                               start_new_session=True)
        atexit.register(self.stop)  # its own session: nothing else would stop it if we die early
        return self

    def wait_ready(self, timeout_s: float = 600.0, progress: bool = True) -> VllmServer:
        """Wait until /health answers; raises with the log's tail if it exits or times out."""
        assert self.proc is not None, "launch() first"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                if self._relaunches < 2 and "Address already in use" in self.log_tail(10):
                    # the port free_port() picked was taken before vLLM bound it (another
                    # process's outgoing connection): pick another and start again
                    self._relaunches += 1
                    self._log.close()
                    self.port = free_port()
                    self.args[self.args.index("--port") + 1] = str(self.port)
                    self.launch()
                    continue
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        if progress:
                            print(f"\r  vllm serve ready after {time.monotonic() - t0:.0f}s" + " " * 20, flush=True)
                        return self
            except OSError:
                pass
            elapsed = time.monotonic() - t0
            if progress and sys.stdout.isatty():
                print(f"\r  starting vllm serve ... {elapsed:.0f}s", end="", flush=True)
            elif progress and int(elapsed) % 15 == 0:
                print(f"  starting vllm serve ... {elapsed:.0f}s", flush=True)
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy after {timeout_s}s; log tail:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT the process group (vLLM shuts its engine core down), then SIGKILL if needed."""
        if self.proc is None:
            return
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # what outlived the API server in its group (an engine core, a worker): nothing may stay
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's local prefix cache, so the next hit can only come from outside."""
        return post_json(self.base_url + "/reset_prefix_cache", {}).get("success", False)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ChatResult:
    """One streamed chat completion, measured from the client."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int] = field(default_factory=list)  # completions only
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read() or b"{}")


def chat(base_url: str, messages: list[dict[str, str]], max_tokens: int = 32, cache_salt: str | None = None,
         top_logprobs: int = 5, timeout_s: float = 600.0) -> ChatResult:
    """Greedy streamed chat completion; TTFT is the time to the first generated token."""
    body: dict[str, Any] = {"messages": messages, "logprobs": True, "top_logprobs": top_logprobs}
    return _stream(base_url + "/v1/chat/completions", body, max_tokens, cache_salt, timeout_s)


def complete(base_url: str, prompt_token_ids: list[int], max_tokens: int = 32, cache_salt: str | None = None,
             kv_transfer_params: dict[str, Any] | None = None, top_logprobs: int = 5,
             timeout_s: float = 600.0) -> ChatResult:
    """Greedy streamed completion of a token-id prompt, returning the generated token ids."""
    body: dict[str, Any] = {"prompt": prompt_token_ids, "logprobs": top_logprobs, "return_token_ids": True,
                            "ignore_eos": True}
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return _stream(base_url + "/v1/completions", body, max_tokens, cache_salt, timeout_s)


def sse_events(req: urllib.request.Request, timeout_s: float) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI-compatible response (its ``data:`` lines), as
    they arrive."""
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


def _stream(url: str, body: dict[str, Any], max_tokens: int, cache_salt: str | None, timeout_s: float) -> ChatResult:
    body = {**body, "model": "model", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if cache_salt:
        body["cache_salt"] = cache_salt
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    result = ChatResult("", 0.0, 0.0, 0, 0)
    for event in sse_events(req, timeout_s):
        for choice in event.get("choices", []):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if "delta" in choice:  # chat
                text.append(choice["delta"].get("content") or "")
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    result.token_logprobs.append(lp["logprob"])
                    result.top_logprobs.append({t["token"]: t["logprob"] for t in lp.get("top_logprobs", [])})
            else:  # completions
                text.append(choice.get("text") or "")
                result.token_ids.extend(choice.get("token_ids") or [])
                lps = choice.get("logprobs") or {}
                result.token_logprobs.extend(lps.get("token_logprobs") or [])
                result.top_logprobs.extend(lps.get("top_logprobs") or [])
        if event.get("usage"):
            usage = event["usage"]
            result.prompt_tokens = usage["prompt_tokens"]
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    result.text = "".join(text)
    result.total_s = time.perf_counter() - t0
    result.ttft_s = ttft if ttft is not None else result.total_s
    return result


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on a Prometheus ``/metrics`` page (``vllm serve``'s or the server's), as
    ``(name, labels, value)``."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    samples = []
    for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", text, re.M):
        labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of one metric's samples from :func:`scrape_metrics` whose labels include ``labels``
    (0 if absent): a counter summed over engines."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))
