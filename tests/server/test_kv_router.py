"""The benchmark router's scoring (validation/kv_router.py), without engines: the choice
rule, the strict-prefix cap, reading a ``/query`` answer, hostile request bodies, and one
proxied request through a real glm-cache-server's ``/query`` to a stand-in engine."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from validation.kv_router import Replica, Router, checked_messages, pick, resumable, score_of


def test_pick_longest_prefix_then_fewest_inflight_then_turn():
    assert pick([0, 256], [5, 0], 0) == 1
    assert pick([512, 256], [5, 0], 1) == 0  # the prefix wins over load
    assert pick([256, 256], [2, 1], 0) == 1  # tie: fewest in flight
    assert pick([256, 256, 0], [1, 1, 0], 1) == 1  # tie on both: the turn's replica
    assert pick([0, 0, 0], [0, 0, 0], 2) == 2  # cold: round robin
    assert pick([0, 0, 0], [0, 0, 1], 2) == 0  # cold, the turn's busy: the next one after it
    with pytest.raises(ValueError):
        pick([], [], 0)
    with pytest.raises(ValueError):
        pick([1, 2], [0], 0)


def test_resumable_is_whole_chunks_before_the_last_prompt_token():
    assert resumable(384, 384, 128) == 256  # a prompt of exactly 3 chunks resumes 2
    assert resumable(384, 385, 128) == 384
    assert resumable(1024, 500, 128) == 384  # never past the prompt
    assert resumable(128, 500, 128) == 128
    assert resumable(0, 0, 128) == resumable(100, 0, 128) == 0


def test_score_of_reads_the_rfc_answer_and_nothing_else():
    ans = {"default": {"m-1": {"longest_matched": 512, "CPU": 384, "STORAGE": 512}, "m-2": {"CPU": 128}}}
    assert score_of(ans) == 384
    assert score_of(ans, "STORAGE") == 512
    for hostile in (None, [], "x", {"default": []}, {"default": {"m": {"CPU": "9"}}}, {"default": {"m": {"CPU": True}}},
                    {"default": {"m": {"CPU": -5}}}, {"default": {"m": None}}):
        assert score_of(hostile) == 0


def test_checked_messages_bounds_the_body():
    ok = {"messages": [{"role": "user", "content": "hi", "name": "x"}]}
    assert checked_messages(ok) == [{"role": "user", "content": "hi"}]
    for bad in (None, [], {}, {"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user"}]},
                {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                {"messages": [{"role": 1, "content": "hi"}]}, {"messages": [{"role": "u", "content": "x"}] * 5000}):
        assert checked_messages(bad) is None


class _Engine(BaseHTTPRequestHandler):
    """A stand-in for vllm serve's streamed chat endpoint (one content chunk, then usage)."""

    hits: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        _Engine.hits.append(self.server.name)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in ({"choices": [{"delta": {"content": "ok"}}]},
                      {"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}}):
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a: object) -> None:
        pass


def test_cache_aware_sends_to_the_server_holding_the_prefix():
    """Real glm-cache-servers: one holds a 2-chunk prefix of the prompt (stored as the
    connector names it under token-chain keys), the other nothing; the router asks both
    and sends the request to the first, and records the stream's usage."""
    from cache_server.chunk_keys import chunk_hashes, parent_of
    from cache_server.client import CacheClient
    from testing.server_process import ServerProcess

    C = 256
    prompt = list(range(1000, 1000 + 3 * C + 5))
    engines = []
    for name in ("e0", "e1"):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
        httpd.name = name  # type: ignore[attr-defined]
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        engines.append(httpd)
    try:
        with ServerProcess("--separate-object-groups", "--chunk-size", str(C)) as s0, \
                ServerProcess("--separate-object-groups", "--chunk-size", str(C)) as s1:
            for srv, store in ((s0, False), (s1, True)):
                with CacheClient(srv.url, timeout_s=10.0, shm=False) as c:
                    ns = "tiny-0123456789abcdef"
                    c.hello(ns, 16, 1, [], attn_groups=[0], state_groups=[1],
                            chunk_keys={"scheme": "lmcache", "lookahead": 0})
                    if store:
                        keys = chunk_hashes(prompt, C)[:2]
                        c.put(ns, [(h, g, 0, b"x" * 64) for h in keys for g in (0, 1)],
                              parent=[parent_of(keys, i) for i in range(2) for _ in (0, 1)])
            replicas = [Replica(f"http://127.0.0.1:{e.server_address[1]}", s.http_url)
                        for e, s in zip(engines, (s0, s1))]
            with Router(replicas, "cache-aware", lambda msgs: prompt, "tiny", C) as router:
                for _ in range(2):
                    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "stream": True}).encode()
                    req = urllib.request.Request(router.url + "/v1/chat/completions", data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=30) as r:
                        assert b"[DONE]" in r.read()
                routes = router.records()
                mean_ms, p99_ms = router.time_scoring(5)  # the last request again: both servers asked
                assert 0 < mean_ms <= p99_ms
            with Router(replicas, "round-robin", lambda msgs: prompt, "tiny", C) as router:
                for _ in range(2):
                    req = urllib.request.Request(router.url + "/v1/chat/completions", data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=30) as r:
                        assert b"[DONE]" in r.read()
                rr = router.records()
            # round robin ignores the servers but records what they held when it chose
            assert [r["replica"] for r in rr] == [0, 1] and [r["held"] for r in rr] == [[0, 2 * C]] * 2
            assert _Engine.hits == ["e1", "e1", "e0", "e1"]  # the turn would have sent the first to e0
            assert [r["held"] for r in routes] == [[0, 2 * C]] * 2
            assert [r["replica"] for r in routes] == [1, 1]
            assert all(r["prompt_tokens"] == 7 and r["cached_tokens"] == 3 and r["ttft_ms"] >= r["forward_ttft_ms"] > 0
                       for r in routes)
            assert all(r["score_ms"] >= r["query_ms"] > 0 for r in routes)
    finally:
        for e in engines:
            e.shutdown()
