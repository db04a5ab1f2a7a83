"""KV events for routers, read by real consumers (issue 33, items 1 and 3).

Two ``vllm serve`` replicas of the tiny GLM-5.3-Flash (float32, chunk 128 = vLLM's block)
share one real glm-cache-server; each publishes with vLLM's own ZMQ publisher
(``--kv-events-config``, its own topic). Two consumers read the streams:

* vLLM's own decoder (``msgspec`` with ``vllm.distributed.kv_events.KVEventBatch``) on a
  SUB socket: every message decodes, and the connector's ``BlockStored(medium="CPU")``
  events carry the hashes, tokens, parent, group and spec kind of vLLM's own GPU events
  for the same tokens and salt;
* Dynamo's standalone KV indexer (``python -m dynamo.indexer``, the ``ai-dynamo-runtime``
  wheel), both replicas registered as workers 1 and 2, asked ``/query`` per prompt.

What is shown: after vLLM's prefix cache is reset (and no request after it), the index
scores each prompt 0 on the GPU tier and its resumable prefix (``C * floor((N-1)/C)``
tokens, a state at its end on the server) at the CPU tier, on the replica that computed it
and on the other one, which found it at lookup; a request that saved only its first 256
tokens (``lmcache.max_offload_tokens``) is scored 256, not its 896 GPU blocks; after the
server is cleared, both replicas' scores drop to 0.

Before the fix, measured with these prompts: the indexer kept ``"gpu":256/384/896``
after the reset (vLLM queues its ``AllBlocksCleared`` and publishes it only from the next
step, which an idle engine never takes) and had no CPU blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from connector.events import RECHECK_S, VERIFY_DELAYS_S
from testing.server_process import ServerProcess, free_port
from tests.engines import random_prompt
from validation.serving import VllmServer, complete, connector_config, post_json

pytestmark = pytest.mark.engine

C = 128
CAPPED = 256  # lmcache.max_offload_tokens of the capped request
TOPICS = ("kv@replica-1", "kv@replica-2")


def _resumable(n: int) -> int:
    return C * ((n - 1) // C)


class EventTap:
    """A SUB socket on every replica's publisher, decoding with vLLM's own KVEventBatch."""

    def __init__(self, endpoints: list[str]) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        for ep in endpoints:
            self._sock.connect(ep)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[tuple[str, int, Any]] = []  # (topic, seq, event)
        self.messages = 0
        self.undecodable: list[str] = []
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                self.messages += 1
                if len(frames) != 3:
                    self.undecodable.append(f"{len(frames)} frames")
                    continue
                try:
                    batch = self._decoder.decode(frames[2])
                except Exception as e:  # noqa: BLE001 - recorded, asserted empty
                    self.undecodable.append(repr(e))
                    continue
                for ev in batch.events:
                    self.events.append((frames[0].decode(), int.from_bytes(frames[1], "big"), ev))

    def of(self, topic: str, kind: str, medium: str | None = None) -> list[Any]:
        with self._lock:
            return [e for t, _, e in self.events if t == topic and type(e).__name__ == kind
                    and (medium is None or getattr(e, "medium", None) == medium)]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._sock.close(0)


class Indexer:
    """Dynamo's standalone KV indexer, the replicas registered as workers 1, 2, ..."""

    def __init__(self, endpoints: list[str], log_path: str) -> None:
        self.port = free_port()
        workers = ",".join(f"{i + 1}={ep}" for i, ep in enumerate(endpoints))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1",
             "--block-size", str(C), "--model-name", "model", "--workers", workers],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def scores(self, tokens: list[int]) -> dict[int, tuple[int, int]]:
        """Per worker: (tokens matched on the GPU tier, tokens matched on GPU or CPU)."""
        instances = self._call("/query", {"token_ids": tokens, "model_name": "model"})["instances"]
        return {int(w): (v["gpu"], v["cpu"]) for w, v in instances.items()}

    def score(self, tokens: list[int], worker: int) -> tuple[int, int]:
        return self.scores(tokens).get(worker, (0, 0))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _wait_equal(what: str, get: Callable[[], Any], expected: Any, timeout_s: float = 30.0) -> None:
    """Poll ``get()`` until it equals ``expected``; fails with its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = get()
        if last == expected:
            return
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r}, expected {expected!r})")


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns a truthy value; fails with its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pytest.importorskip("dynamo.llm", reason="Dynamo's indexer: pip install ai-dynamo-runtime (the test extras)")
    from glm5next_plugin.tiny_checkpoint import ensure_checkpoint

    tmp = tmp_path_factory.mktemp("kv_events")
    ckpt = tmp / "glm5next-tiny"
    ensure_checkpoint(ckpt)
    ports = [free_port() for _ in TOPICS]
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    tap = EventTap(endpoints)  # subscribed before the publishers bind: nothing is missed
    indexer = Indexer(endpoints, str(tmp / "indexer.log"))
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        engines = [VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(C),
                              "--prefix-cache-retention-interval", str(C), "--dtype", "float32",
                              "--max-num-seqs", "4", "--kv-events-config",
                              json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{port}", "topic": topic}),
                              kv_transfer_config=connector_config(srv.url), max_model_len=4096,
                              env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
                   for port, topic in zip(ports, TOPICS)]
        try:
            for e in engines:  # both start-ups overlap
                e.launch()
            for e in engines:
                e.wait_ready(progress=False)
            # the subscriptions work: a short warm-up prompt shows up on each replica's GPU tier
            warm = random_prompt(C + 5, 7)
            for i, e in enumerate(engines):
                complete(e.base_url, warm, max_tokens=1)
                _wait_for(f"replica {i + 1}'s GPU events indexed", lambda i=i: indexer.score(warm, i + 1)[0] == C)
            yield engines, srv, tap, indexer
        finally:
            for e in engines:
                e.stop()
            indexer.stop()
            tap.close()


PROMPTS = {n: random_prompt(n, n) for n in (383, 385, 941)}
CAPPED_PROMPT = random_prompt(941, 4)


def test_resumable_prefix_scored_at_cpu_after_reset(stack):
    """Replica 1 computes the prompts; after its prefix cache is reset (no request since),
    the index scores each 0 on the GPU tier and its resumable prefix at the CPU tier."""
    engines, _, tap, indexer = stack
    r1 = engines[0]
    for p in PROMPTS.values():
        complete(r1.base_url, p, max_tokens=1)
    complete(r1.base_url, CAPPED_PROMPT, max_tokens=1, kv_transfer_params={"lmcache.max_offload_tokens": CAPPED})
    # before the reset: vLLM's own blocks on the GPU tier (whole blocks of the prompt)
    for n, p in PROMPTS.items():
        _wait_for(f"{n}-token prompt on the GPU tier", lambda p=p, n=n: indexer.score(p, 1)[0] == C * (n // C))
        _wait_for(f"{n}-token prompt announced on the CPU tier",
                  lambda p=p: any(e.token_ids[:C] == p[:C] for e in tap.of(TOPICS[0], "BlockStored", "CPU")))
    # the engine is idle from here on (no confirmation pending either): vLLM steps only if
    # the connector makes it after the reset (before the fix nobody did, and the clear waited)
    time.sleep(sum(VERIFY_DELAYS_S) + 1.0)
    assert r1.reset_prefix_cache()
    expected = {n: (0, _resumable(n)) for n in PROMPTS}
    _wait_equal("GPU tier cleared and the server's chunks scored at the CPU tier",
                lambda: {n: indexer.score(p, 1) for n, p in PROMPTS.items()}, expected)
    # the capped request saved 2 chunks: never announced deeper, though vLLM held 7 blocks
    assert indexer.score(CAPPED_PROMPT, 1) == (0, CAPPED)

    # vLLM's own decoder read every message; the connector's events are vLLM's own shapes
    assert tap.messages > 0 and tap.undecodable == []
    gpu = tap.of(TOPICS[0], "BlockStored", "GPU")
    attn = [e for e in gpu if e.kv_cache_spec_kind not in (None, "mamba")]
    assert attn, "vLLM published no attention-group events"
    vllm_hash = {}  # (tokens so far) -> vLLM's hash of that block, from its GPU events
    for e in attn:
        for i, h in enumerate(e.block_hashes):
            vllm_hash[h] = (e.group_idx, e.kv_cache_spec_kind, tuple(e.token_ids[i * C:(i + 1) * C]))
    cpu = tap.of(TOPICS[0], "BlockStored", "CPU")
    assert cpu
    for e in cpu:
        assert e.block_size == C and e.lora_id is None and e.lora_name is None
        assert len(e.token_ids) == C * len(e.block_hashes)
        for i, h in enumerate(e.block_hashes):
            group, kind, tokens = vllm_hash[h]  # a hash vLLM itself gave these tokens
            assert (e.group_idx, e.kv_cache_spec_kind, tuple(e.token_ids[i * C:(i + 1) * C])) == (group, kind, tokens)
    first = [e for e in cpu if e.token_ids[:C] == PROMPTS[941][:C]][0]
    assert first.parent_block_hash is None and len(first.block_hashes) == _resumable(941) // C
    # vLLM published AllBlocksCleared after the reset, then the server's chunks again
    with tap._lock:
        kinds = [(type(e).__name__, getattr(e, "medium", None)) for t, _, e in tap.events if t == TOPICS[0]]
    cleared = kinds.index(("AllBlocksCleared", None))
    assert ("BlockStored", "CPU") in kinds[cleared:]


def test_second_replica_scored_the_same(stack):
    """Replica 2 finds the prompts on the server at lookup and announces them: after its own
    reset it is scored as replica 1 is."""
    engines, _, tap, indexer = stack
    r2 = engines[1]
    for p in PROMPTS.values():
        assert complete(r2.base_url, p, max_tokens=1).cached_tokens >= C
    assert r2.reset_prefix_cache()
    expected = {n: (0, _resumable(n)) for n in PROMPTS}
    _wait_equal("replica 2 scored the server's chunks at the CPU tier",
                lambda: {n: indexer.score(p, 2) for n, p in PROMPTS.items()}, expected)
    assert {n: indexer.score(p, 1) for n, p in PROMPTS.items()} == expected
    assert tap.undecodable == []


def test_server_clear_drops_scores(stack):
    """After the server is cleared, the replicas' rechecks find the chains gone and publish
    BlockRemoved(medium CPU): the index scores 0 everywhere."""
    engines, srv, tap, indexer = stack
    post_json(srv.http_url + "/cache/clear", {"force": True})
    time.sleep(RECHECK_S)
    for e in engines:  # rechecks run while an engine steps
        complete(e.base_url, random_prompt(20, 11), max_tokens=1)
    _wait_equal("scores dropped on both replicas",
                lambda: {(n, w): indexer.score(p, w) for n, p in PROMPTS.items() for w in (1, 2)},
                {(n, w): (0, 0) for n in PROMPTS for w in (1, 2)})
    for topic in TOPICS:
        removed = tap.of(topic, "BlockRemoved", "CPU")
        assert removed and all(e.group_idx is not None for e in removed)
    assert tap.undecodable == []
