"""Two ``vllm serve`` replicas of the tiny GLM-5.3-Flash (float32, chunk 128 = vLLM's block,
its vision tower with one image a prompt and vLLM's processor cache off, so each request's
pixels are its own) share one real glm-cache-server; each publishes KV events with vLLM's
own ZMQ publisher (``--kv-events-config``, its own topic). One pair of engines for two
concerns (a pair's start-up costs about a minute of the suite's engine lane): KV events for
routers, then hostile clients.

**KV events for routers, read by real consumers (issue 33, items 1 and 3).** Two consumers
read the streams:
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

**Hostile API clients** (run after the events' tests, whose streams they would add to): no
request field stops the engine, and no client can plant one image's KV under another image's
name.
- Odd ``kv_transfer_params``, ``cache_salt`` and media uuids (infinities, 10^40, NaN, nested
  objects, wrong types, very long keys and strings) are each sent as a raw JSON body; each
  is answered (200, or vLLM's own 400 for what its API refuses), never a 500, and a plain
  request is answered after each. Before the fix, ``"lmcache.max_offload_tokens": 1e999``
  raised OverflowError inside vLLM's scheduler: a fatal EngineCore error.
- The planting attack: on replica 1 a client sends image A under a uuid equal to vLLM's own
  content hash of image B (anyone holding B can compute it); a later request with B and no
  uuid then resumes from A's rows there (vLLM trusts the uuid: its prefix and encoder caches
  are keyed by it). The connector must not save those rows under the key that names B's
  pixels: replica 2's output for B equals B's cold output, and it resumes only before the
  image.
"""

from __future__ import annotations

import base64
import io
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from connector.events import RECHECK_S
from testing.engines import TIMEOUT_S, random_prompt
from testing.server_process import ServerProcess, free_port
from validation.serving import VllmServer, chat, complete, connector_config, metric_sum, post_json, scrape_metrics

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

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _wait_equal(what: str, get: Callable[[], Any], expected: Any, timeout_s: float = 60.0) -> None:
    """Poll ``get()`` until it equals ``expected``; fails with its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = get()
        if last == expected:
            return
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r}, expected {expected!r})")


def _poll(check: Callable[[], Any], timeout_s: float) -> Any:
    """Poll ``check`` until it returns a truthy value or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    return last


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Poll ``check`` until it returns a truthy value; fails with its last value."""
    last = _poll(check, timeout_s)
    if not last:
        pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
    return last


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(engines, server, event tap, Dynamo's indexer or None where it is not installed,
    checkpoint path); the events' tests skip without the indexer, the hostile ones run."""
    import importlib.util

    from glm5next_tiny import ensure_checkpoint

    tmp = tmp_path_factory.mktemp("kv_events")
    ckpt = tmp / "glm5next-tiny"
    ensure_checkpoint(ckpt)
    ports = [free_port() for _ in TOPICS]
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    tap = EventTap(endpoints)  # subscribed before the publishers bind: nothing is missed
    indexer = Indexer(endpoints, str(tmp / "indexer.log")) if importlib.util.find_spec("dynamo") else None
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        engines = [VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(C),
                              "--prefix-cache-retention-interval", str(C), "--dtype", "float32",
                              "--limit-mm-per-prompt", json.dumps({"image": 1}), "--mm-processor-cache-gb", "0",
                              "--max-num-seqs", "4", "--kv-events-config",
                              json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{port}", "topic": topic}),
                              kv_transfer_config=connector_config(srv.url, timeout_s=TIMEOUT_S), max_model_len=4096,
                              env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
                   for port, topic in zip(ports, TOPICS)]
        try:
            for e in engines:  # both start-ups overlap
                e.launch()
            for e in engines:
                e.wait_ready(progress=False)
            yield engines, srv, tap, indexer, str(ckpt)
        finally:
            for e in engines:
                e.stop()
            if indexer is not None:
                indexer.stop()
            tap.close()


@pytest.fixture(scope="module")
def events(stack):
    """The pair with its consumers, for the events' tests: (engines, server, tap, indexer)."""
    engines, srv, tap, indexer, _ = stack
    if indexer is None:
        pytest.skip("Dynamo's indexer: pip install ai-dynamo-runtime (the test extras)")
    for worker, e in enumerate(engines, 1):
        _subscribed(e, indexer, worker)
    return engines, srv, tap, indexer


def _subscribed(engine: VllmServer, indexer: Indexer, worker: int, tries: int = 8) -> None:
    """Wait until the indexer hears the replica: a fresh one-block prompt until one is scored on
    its GPU tier. Dynamo's SUB socket (the Rust ``zeromq`` crate) joins a publisher about 2 s
    after it binds, and vLLM can bind, become healthy and publish a first request's events
    within that: a PUB drops what it sends before the subscription arrives, and a single
    warm-up prompt's events were lost so, in CI and here."""
    for k in range(tries):
        warm = random_prompt(C + 5, 100 * worker + k)
        complete(engine.base_url, warm, max_tokens=1)
        if _poll(lambda w=warm: indexer.score(w, worker)[0] == C, 5.0):
            return
    pytest.fail(f"replica {worker}'s events never reached Dynamo's indexer ({tries} prompts); "
                f"its log:\n{indexer.log_tail()}")


PROMPTS = {n: random_prompt(n, n) for n in (383, 385, 941)}
CAPPED_PROMPT = random_prompt(941, 4)


def _cpu_blocks(tap) -> set[tuple[int, ...]]:
    """The token blocks replica 1 announced on the CPU tier."""
    return {tuple(e.token_ids[i * C:(i + 1) * C])
            for e in tap.of(TOPICS[0], "BlockStored", "CPU") for i in range(len(e.block_hashes))}


def test_resumable_prefix_scored_at_cpu_after_reset(events):
    """Replica 1 computes the prompts; after its prefix cache is reset (no request since),
    the index scores each 0 on the GPU tier and its resumable prefix at the CPU tier."""
    engines, _, tap, indexer = events
    r1 = engines[0]
    for p in PROMPTS.values():
        complete(r1.base_url, p, max_tokens=1)
    complete(r1.base_url, CAPPED_PROMPT, max_tokens=1, kv_transfer_params={"lmcache.max_offload_tokens": CAPPED})
    # before the reset: vLLM's own blocks on the GPU tier (whole blocks of the prompt)
    for n, p in PROMPTS.items():
        _wait_for(f"{n}-token prompt on the GPU tier", lambda p=p, n=n: indexer.score(p, 1)[0] == C * (n // C))
        _wait_for(f"{n}-token prompt announced on the CPU tier",
                  lambda p=p: any(e.token_ids[:C] == p[:C] for e in tap.of(TOPICS[0], "BlockStored", "CPU")))
    # every chain's verification has ended: each announced on the CPU tier as deep as it was
    # saved (a verification that finds its depth ends; VERIFY_DELAYS_S space the tries)
    saved = {**{n: (p, _resumable(n)) for n, p in PROMPTS.items()}, "capped": (CAPPED_PROMPT, CAPPED)}
    for name, (p, depth) in saved.items():
        _wait_for(f"{name} prompt announced {depth} tokens deep on the CPU tier",
                  lambda p=p, depth=depth: all(tuple(p[k:k + C]) in _cpu_blocks(tap) for k in range(0, depth, C)))
    # the engine is idle from here on (no confirmation pending either): vLLM steps only if
    # the connector makes it after the reset (before the fix nobody did, and the clear waited)
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


def test_second_replica_scored_the_same(events):
    """Replica 2 finds the prompts on the server at lookup and announces them: after its own
    reset it is scored as replica 1 is."""
    engines, _, tap, indexer = events
    r2 = engines[1]
    for p in PROMPTS.values():
        assert complete(r2.base_url, p, max_tokens=1).cached_tokens >= C
    assert r2.reset_prefix_cache()
    expected = {n: (0, _resumable(n)) for n in PROMPTS}
    _wait_equal("replica 2 scored the server's chunks at the CPU tier",
                lambda: {n: indexer.score(p, 2) for n, p in PROMPTS.items()}, expected)
    assert {n: indexer.score(p, 1) for n, p in PROMPTS.items()} == expected
    assert tap.undecodable == []


def test_server_clear_drops_scores(events):
    """After the server is cleared, the replicas' rechecks find the chains gone and publish
    BlockRemoved(medium CPU): the index scores 0 everywhere."""
    engines, srv, tap, indexer = events
    post_json(srv.http_url + "/cache/clear", {"force": True})
    # a minimum time, not a guess: every announced chain's recheck is due RECHECK_S after its
    # last, which the engines (idle since) made before the clear
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


# -- hostile clients ----------------------------------------------------------------------------------

TOKENS = 8


@pytest.fixture(scope="module")
def replicas(stack):
    """The pair as the hostile clients' tests see it: (engines, server, checkpoint path)."""
    engines, srv, _, _, ckpt = stack
    return engines, srv, ckpt


def _raw_post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _completion(prompt: list[int], extra: str = "") -> bytes:
    """A completion request's JSON text with ``extra`` spliced in verbatim (so it can carry
    what Python's json would not write: 1e999, big integer literals, NaN)."""
    base = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    return (base[:-1] + (", " + extra if extra else "") + "}").encode()


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


PROMPT = [random.Random(5).randrange(16, 512) for _ in range(300)]

HOSTILE_FIELDS = [
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 1e999}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": -1e999}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": NaN}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 1e40}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 10000000000000000000000000000000000000000}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": -5}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": 12.5}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": "1e999"}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": true}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": [1, 2]}',
    '"kv_transfer_params": {"lmcache.max_offload_tokens": ' + _nested(60) + "}",
    '"kv_transfer_params": {"lmcache.skip_load": ' + _nested(60) + "}",
    '"kv_transfer_params": {"lmcache.skip_load": "' + "t" * 100_000 + '"}',
    '"kv_transfer_params": {"lmcache.' + "k" * 100_000 + '": 1}',
    '"kv_transfer_params": {' + ", ".join(f'"lmcache.x{i}": {i}' for i in range(2000)) + "}",
    '"kv_transfer_params": {"glm_strict_prefix": false, "lmcache.skip_load": 1e999}',
    '"kv_transfer_params": [1, 2, 3]',
    '"kv_transfer_params": "lmcache.skip_load"',
    '"kv_transfer_params": 1e999',
    '"cache_salt": "' + "s" * 200_000 + '"',
    '"cache_salt": 1e40',
    '"cache_salt": {"a": [1, 2]}',
    '"cache_salt": ""',
]


def test_no_request_field_stops_the_engine(replicas):
    (engine, _), _srv, _ = replicas
    url = engine.base_url + "/v1/completions"
    plain = _completion(PROMPT[:40])
    assert _raw_post(url, plain)[0] == 200
    before = metric_sum(scrape_metrics(engine.base_url), "vllm:glm_cache_params_ignored_total")
    statuses = []
    for extra in HOSTILE_FIELDS:
        status, body = _raw_post(url, _completion(PROMPT, extra))
        statuses.append(status)
        assert status in (200, 400), f"{extra[:80]}: {status} {body[:300]!r}"
        status, body = _raw_post(url, plain)
        assert status == 200, f"after {extra[:80]}: the engine no longer answers: {status} {body[:300]!r}"
        assert json.loads(body)["choices"][0]["text"] is not None
    # the infinities, NaN and 1e40 reached the connector (vLLM's API refuses a few of the others itself)
    assert statuses[:4] == [200] * 4 and statuses.count(200) >= 12, statuses
    # the malformed caps and unknown keys reached the connector and were counted, not honoured
    after = metric_sum(scrape_metrics(engine.base_url), "vllm:glm_cache_params_ignored_total")
    assert after - before >= 10
    assert engine.proc.poll() is None


def _png(seed: int, size: int = 112) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _vllm_image_id(png: bytes, model_id: str) -> str:
    """vLLM's own identifier for this image when no uuid is given (what its prefix and
    encoder caches key the image by), computed as vLLM's renderer does for a data URL:
    anyone who holds the image can compute it."""
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    return MultiModalHasher.hash_kwargs("blake3", model_id=model_id, image=ImageMediaIO().load_bytes(png))


def _message(png: bytes, uuid: str | None = None) -> list[dict]:
    rng = random.Random(11)
    words = ["cache", "state", "chunk", "prefix", "token", "layer", "block", "server", "the", "of", "and", "to"]
    before = " ".join(rng.choice(words) for _ in range(300))
    after = " ".join(rng.choice(words) for _ in range(200)) + "\nDescribe the image."
    part: dict = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    if uuid is not None:
        part["uuid"] = uuid
    return [{"role": "user", "content": [{"type": "text", "text": before}, part, {"type": "text", "text": after}]}]


def test_a_client_uuid_cannot_plant_one_images_kv_under_anothers_pixels(replicas):
    (one, two), _srv, model_id = replicas
    a, b = _png(1), _png(2)
    forged = _vllm_image_id(b, model_id)
    salt = "tenant-shared"

    # replica 1: A under B's identifier, then B itself (no uuid)
    planted = chat(one.base_url, _message(a, uuid=forged), TOKENS, cache_salt=salt)
    victim = chat(one.base_url, _message(b), TOKENS, cache_salt=salt)
    strict = C * ((victim.prompt_tokens - 1) // C)
    # vLLM's own caches took A's rows for B on replica 1 (the forged id matched): the attack is real
    assert victim.cached_tokens == strict, (victim.cached_tokens, strict)
    assert planted.prompt_tokens == victim.prompt_tokens

    # replica 2: B cold (a salt of its own), then B under the shared salt from the server
    cold_b = chat(two.base_url, _message(b), TOKENS, cache_salt="b-cold")
    assert cold_b.cached_tokens == 0
    assert victim.text != cold_b.text or victim.top_logprobs[0] != cold_b.top_logprobs[0]
    reloaded_b = chat(two.base_url, _message(b), TOKENS, cache_salt=salt)
    assert reloaded_b.text == cold_b.text
    assert reloaded_b.top_logprobs[0] == cold_b.top_logprobs[0]
    # only the text chunks before the image came from the server (they hold text rows only)
    assert C <= reloaded_b.cached_tokens < strict, reloaded_b.cached_tokens

    # replica 1 said so in its counters
    assert metric_sum(scrape_metrics(one.base_url), "vllm:glm_cache_media_withheld_total") >= 1
