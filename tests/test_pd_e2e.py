"""Prefill/decode disaggregation through one glm-cache-server (issue 34): roles and the hand-off.

One prefill ``vllm serve`` (``kv_role`` ``kv_producer``) and one decode ``vllm serve``
(``kv_consumer``) of the tiny GLM-5.3-Flash (float32, chunk 128 = vLLM's block) share a real
glm-cache-server. Requests follow vLLM's PD convention as its disaggregation proxy sends
them, with the last prompt token held back from the prefill (``connector.handoff``): the
prefill instance gets ``T[:-1]``, ``max_tokens`` 1 and ``{"do_remote_decode": true}``; the
decode instance gets ``T`` and the ``kv_transfer_params`` the prefill returned.

Shown: the decode instance computes one prompt token (vLLM's
``vllm:prompt_tokens_by_source{source="local_compute"}``) for prompts at and around chunk
boundaries and shorter than a chunk, and its greedy output equals a single instance's cold
run, first-token log-prob to float32 rounding (the cold run computes the tail in one pass,
the decode one token from the hand-off's state: the same math, summed in another order).
The producer never loads, the consumer never saves, each says so at start-up. A hand-off
missing (never prefilled), evicted (the server cleared) or under another salt (another
tenant's key space) gives a cold, correct decode without waiting. With MTP drafts on
(vLLM's defaults) no hand-off is made (the draft row before the last token would name the prefill's own sampled
token): the decode resumes at the strict prefix and its output is still a single instance's.

The decode leg is sent as soon as the prefill answers, as a proxy does: the decode side
waits (at most ``timeout_s``) for the prefill's saves, which travel after its response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from testing.server_process import ServerProcess
from tests.engines import random_prompt
from validation.serving import VllmServer, complete, metric_sum, post_json, scrape_metrics

pytestmark = pytest.mark.engine

C = 128
MAX_TOKENS = 8
# at and around chunk boundaries, and shorter than a chunk (no whole chunk: the hand-off only)
LENGTHS = (37, C + 1, C + 2, 2 * C - 1, 2 * C, 2 * C + 1, 3 * C + 50)
LP_TOL = 1e-4  # float32: the decode sums the tail's KDA recurrence in another order than a cold run


def _config(url: str, role: str) -> str:
    return json.dumps({"kv_connector": "GlmCacheConnector", "kv_role": role,
                       "kv_connector_extra_config": {"server": url}})


def _engines(ckpt, url: str, *extra: str) -> tuple[VllmServer, VllmServer]:
    args = ("--enforce-eager", "--max-num-batched-tokens", str(C), "--prefix-cache-retention-interval", str(C),
            "--dtype", "float32", "--max-num-seqs", "4", "--block-size", str(C), *extra)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    prefill = VllmServer(ckpt, *args, kv_transfer_config=_config(url, "kv_producer"), max_model_len=4096, env=env)
    decode = VllmServer(ckpt, *args, kv_transfer_config=_config(url, "kv_consumer"), max_model_len=4096, env=env)
    for e in (prefill, decode):  # both start-ups overlap
        e.launch()
    for e in (prefill, decode):
        e.wait_ready(progress=False)
        # the first step after start-up names the weights; nothing is saved before (as in serving)
        complete(e.base_url, random_prompt(5, 5), max_tokens=1)
    return prefill, decode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from glm5next_plugin.tiny_checkpoint import ensure_checkpoint

    path = tmp_path_factory.mktemp("pd") / "glm5next-tiny"
    ensure_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def pd(ckpt, server):
    prefill, decode = _engines(ckpt, server.url)
    try:
        yield prefill, decode
    finally:
        for e in (prefill, decode):
            e.stop()


def _objects(server: ServerProcess) -> int:
    with __import__("urllib.request").request.urlopen(server.http_url + "/status", timeout=10) as r:
        return int(json.loads(r.read())["objects"])


def _computed(engine: VllmServer) -> float:
    return metric_sum(scrape_metrics(engine.base_url), "vllm:prompt_tokens_by_source_total", source="local_compute")


def _prefill(engine: VllmServer, prompt: list[int], salt: str | None = None) -> dict:
    """The proxy's first leg: the prompt less its last token, one token, do_remote_decode."""
    body = {"model": "model", "prompt": prompt[:-1], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    if salt:
        body["cache_salt"] = salt
    return post_json(engine.base_url + "/v1/completions", body).get("kv_transfer_params") or {}


def _decode(engine: VllmServer, prompt: list[int], params: dict, salt: str | None = None):
    """The proxy's second leg; returns (result, prompt tokens the decode instance computed)."""
    before = _computed(engine)
    t0 = time.monotonic()
    out = complete(engine.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt=salt, kv_transfer_params=params)
    return out, _computed(engine) - before, time.monotonic() - t0


def _cold(engine: VllmServer, prompt: list[int], tag: str):
    """A single instance's run: a salt nobody saved under (the consumer saves nothing)."""
    return complete(engine.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt=f"cold-{tag}")


def _same(out, cold) -> None:
    assert out.token_ids == cold.token_ids
    assert out.token_logprobs[0] == pytest.approx(cold.token_logprobs[0], abs=LP_TOL)


def test_roles_named_at_start_up(pd):
    prefill, decode = pd
    assert "kv_role kv_producer: saves, never loads" in prefill.log()
    assert "kv_role kv_consumer: loads, never saves" in decode.log()


def test_decode_computes_only_the_last_prompt_token(pd, server):
    """The table of issue 34: decode-side computed prompt tokens per prompt length."""
    prefill, decode = pd
    table = []
    for n in LENGTHS:
        prompt = random_prompt(n, 1000 + n)
        cold = _cold(decode, prompt, str(n))
        params = _prefill(prefill, prompt)
        # a prefill ending on the grid needs no hand-off: the state there is a chunk's
        assert params.get("glm_handoff") is ((n - 1) % C != 0)
        out, computed, _ = _decode(decode, prompt, params)
        table.append((n, computed))
        _same(out, cold)
    print("\ndecode-side computed prompt tokens:", table)
    assert table == [(n, 1) for n in LENGTHS]


def test_consumer_never_saves_producer_never_loads(pd, server):
    prefill, decode = pd
    before = _objects(server)
    _cold(decode, random_prompt(3 * C + 7, 77), "consumer")  # a consumer computes a new prompt
    time.sleep(1.0)
    assert _objects(server) == before
    prompt = random_prompt(2 * C + 9, 78)
    complete(prefill.base_url, prompt, max_tokens=1)  # saved by the producer
    deadline = time.monotonic() + 10
    while _objects(server) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _objects(server) > before
    assert prefill.reset_prefix_cache()
    again = complete(prefill.base_url, prompt, max_tokens=1)
    assert again.cached_tokens == 0  # on the server, and not loaded
    samples = scrape_metrics(prefill.base_url)
    assert metric_sum(samples, "vllm:glm_cache_loaded_objects_total") == 0
    assert metric_sum(samples, "vllm:glm_cache_saved_objects_total") > 0
    assert metric_sum(scrape_metrics(decode.base_url), "vllm:glm_cache_saved_objects_total") == 0


@pytest.mark.parametrize("case", ["missing", "evicted", "other salt"])
def test_no_handoff_is_a_cold_correct_decode(pd, server, case):
    prefill, decode = pd
    n = 2 * C + 40
    prompt = random_prompt(n, {"missing": 1, "evicted": 2, "other salt": 3}[case])
    cold = _cold(decode, prompt, case)
    params = {"do_remote_prefill": True}
    if case != "missing":
        params = _prefill(prefill, prompt, salt="tenant-a" if case == "other salt" else None)
    if case == "evicted":
        post_json(server.http_url + "/cache/clear", {"force": True})
    out, computed, took = _decode(decode, prompt, params, salt="tenant-b" if case == "other salt" else None)
    _same(out, cold)
    assert computed == n  # nothing of it on the server for this namespace: all computed
    assert took < 30  # never a wait for the hand-off


def test_mtp_drafts_outputs_are_a_single_instances(ckpt, server, pd):
    """vLLM's default MTP settings on both instances: no hand-off (the draft layer's row
    before the last token depends on the prefill's own sampled token); the decode resumes at
    the strict prefix, outputs as a single instance's."""
    for e in pd:  # at most two engines at once on two cores
        e.stop()
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    prefill, decode = _engines(ckpt, server.url, "--speculative-config", mtp)
    try:
        for n in (C + 2, 2 * C + 1):
            prompt = random_prompt(n, 2000 + n)
            cold = _cold(decode, prompt, f"mtp-{n}")
            params = _prefill(prefill, prompt)
            assert params.get("glm_handoff") is False
            out, computed, _ = _decode(decode, prompt, params)
            assert out.token_ids == cold.token_ids
            assert out.token_logprobs[0] == pytest.approx(cold.token_logprobs[0], abs=LP_TOL)
            # the prefill's last chunk has a key only if the token after it is in its prompt
            # (the lookahead), which the held-back last token is not when N - 1 is on the grid
            assert computed == n - C * ((n - 2) // C)
    finally:
        for e in (prefill, decode):
            e.stop()
