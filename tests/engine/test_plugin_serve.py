"""``vllm serve`` of the generated checkpoint answers OpenAI chat requests on CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import glm5next_tiny

pytestmark = pytest.mark.engine

STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A larger KDA state (8 heads x 64) than the default, so vLLM must grow the unified
    # block beyond the CPU default of 128 to fit one state per attention page.
    ckpt = glm5next_tiny.write_checkpoint(
        tmp_path_factory.mktemp("tiny_serve"), seed=4, linear_num_heads=8, linear_head_dim=64
    )
    port = _free_port()
    vllm_bin = Path(sys.executable).with_name("vllm")
    log = open(ckpt / "serve.log", "w")
    proc = subprocess.Popen(
        [
            str(vllm_bin), "serve", str(ckpt),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--gpu-memory-utilization", "0.15", "--max-model-len", "4096",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--served-model-name", "glm5next-tiny",
            "--limit-mm-per-prompt", '{"image": 2}',
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S  # polled: returns once healthy
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{(ckpt / 'serve.log').read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"vllm serve did not become healthy within {STARTUP_TIMEOUT_S} s:\n"
                        f"{(ckpt / 'serve.log').read_text()[-4000:]}")
        time.sleep(0.5)  # between polls
    yield base, ckpt
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def test_chat_completion_is_answered(server):
    base, ckpt = server
    status, body = _post(
        base + "/v1/chat/completions",
        {
            "model": "glm5next-tiny",
            "messages": [{"role": "user", "content": "hello, how are you today?"}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert body["usage"]["completion_tokens"] == 8
    # the prompt went through the checkpoint's chat template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello, how are you today?"}], add_generation_prompt=True, tokenize=False
    )
    expected = tok(text, add_special_tokens=False)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(expected)


def _png_data_url(seed: int, size: int = 112) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(image_part: dict, max_tokens: int = 4) -> dict:
    return {
        "model": "glm5next-tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, image_part]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_image_input_is_answered(server):
    """A chat request with a 112x112 PNG: the template's one <|image|> becomes the image's
    16 tokens (8x8 patches, 2x2 merge), the answer has tokens, and another image changes the
    answer's log-probs."""
    base, ckpt = server
    status, body = _post(
        base + "/v1/chat/completions",
        {**_image_chat({"type": "image_url", "image_url": {"url": _png_data_url(0)}}), "logprobs": True},
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert isinstance(body["choices"][0]["message"]["content"], str)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    assert "<|begin_of_image|><|image|><|end_of_image|>" in text
    assert body["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"]) - 1 + 16
    status, other = _post(
        base + "/v1/chat/completions",
        {**_image_chat({"type": "image_url", "image_url": {"url": _png_data_url(1)}}), "logprobs": True},
    )
    assert status == 200, other
    first = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    second = [t["logprob"] for t in other["choices"][0]["logprobs"]["content"]]
    assert first != second


def test_video_input_is_refused_clearly(server):
    base, _ = server
    status, body = _post(
        base + "/v1/chat/completions",
        _image_chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t"}}),
    )
    assert status == 400, body
    assert "video inputs are not supported" in body["error"]["message"]


def test_unified_block_size_grows_to_fit_kda_state_and_prefix_cache_resumes(server):
    """Conv (3, 3*8*64) fp32 + recurrent (8, 64, 64) fp32 = 149,504 B per KDA slot; the
    sparse-MLA page per token is the plugin's real row (kv_lora_rank 32 + 2 x index_head_dim
    16 = 64 values, fp32: 256 B, reported through the backend's ``customize_spec``), so the
    block is the smallest multiple of 128 with block * 256 B >= 149,504 B: 640 tokens."""
    base, ckpt = server
    log = (ckpt / "serve.log").read_text()
    m = re.search(r"Setting attention block size to (\d+) tokens", log)
    assert m, "vLLM did not log a unified block size"
    block = int(m.group(1))
    assert block == 640
    ids = [16 + (i * 7) % 490 for i in range(3000)]
    body = {"model": "glm5next-tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, first = _post(base + "/v1/completions", body)
    assert status == 200, first
    status, second = _post(base + "/v1/completions", body)
    assert status == 200, second
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached == block * ((len(ids) - 1) // block) == 2560
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_port_taken_before_vllm_binds_it_is_picked_again(tmp_path):
    """``validation.serving.VllmServer`` picks a free port, which another process can take
    before ``vllm serve`` binds it: it then starts again on a new port (seen with the cache
    server in CI). Shown without an engine: the first start finds its port taken, the
    second gets past binding and stops at the model (a config vLLM does not recognise)."""
    from validation.serving import VllmServer

    (tmp_path / "config.json").write_text("{}")
    v = VllmServer(tmp_path)
    taken = v.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        with pytest.raises(RuntimeError, match="Unrecognized model") as err:
            v.start(timeout_s=120, progress=False)
    assert "Address already in use" not in str(err.value)
    assert v.port != taken and v._relaunches == 1
