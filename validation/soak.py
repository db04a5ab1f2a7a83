"""A soak with faults (issue 46, item 4): steady traffic through two ``vllm serve`` replicas
sharing one glm-cache-server with a Redis L2, while the server, the L2, the link and a
replica fail on a schedule; what was answered, whether any token was wrong, and what the
faults cost.

    .venv/bin/python -m validation.soak [--minutes 10] [--json PATH] [--faults pause,server,l2,link,replica]
        [--clients 3] [--timeout-s 5] [--keep DIR] [--cores 0,1]

**What runs.** The tiny GLM-5.3-Flash (``glm5next_tiny``, float32, its
vision tower, chunk 128 = vLLM's block); ``glm-cache-server --separate-object-groups
--chunk-size 128 --l1-size-gb 1`` with an L2 on a real three-node Redis cluster (``--l2``,
``testing.redis_nodes``); two ``vllm serve`` replicas with ``GlmCacheConnector``
(``kv_both``; ``timeout_s`` ``--timeout-s``, ``retry_after_s`` 5, the connector's default),
each on one core of its own (``VLLM_CPU_OMP_THREADS_BIND`` per replica, ``--cores``: by default the
first two allowed cores, as two engines on one host are run; ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), ``--enable-prompt-tokens-details``. The
replicas reach the server through a loopback TCP proxy in this script (:class:`FaultyLink`),
so the link can fail; its HTTP side (``/metrics``, ``/status``) is read directly.

**The traffic** (closed loop: ``--clients`` clients, each sends its next request when its
last is answered; replicas taken in turn; every request under one ``cache_salt``, so a
prefix computed on one replica is resumable on the other through the server). Drawn with
these weights from a fixed pool of prompts:

* 35% multi-turn chats (``/v1/chat/completions``): ``--conversations`` conversations over a
  document of about 900 tokens, ``--turns`` turns each, sent in order (turn ``t`` carries
  turns ``< t`` and their answers), then again from the first turn;
* 25% repeated documents (``/v1/completions``, token ids): ``--documents`` documents of
  1000-1600 tokens, each with ``--questions`` different 20-60-token questions after it;
* 25% PD pairs: a prompt of 400-1200 token ids prefilled on one replica (``T[:-1]``,
  ``max_tokens`` 1, ``kv_transfer_params {"do_remote_decode": true}``) and decoded on the
  other with the ``kv_transfer_params`` the prefill returned (``glm_handoff``, plus
  ``do_remote_prefill``), vLLM's PD convention as ``validation/pd_proxy.py`` follows it;
  both legs on one replica while the other is down;
* 15% image prompts (chat, one 112x112 PNG early, then ~600 words of text;
  ``--limit-mm-per-prompt {"image":1}``, vLLM's processor cache off).

``--max-tokens`` (12) greedy tokens each (completions with ``ignore_eos``). **Cold runs
first:** before the soak, every prompt of the pool is sent once under a fresh salt of its
own (nothing can be resumed), its greedy tokens and top-2 log-probs kept; a chat's later
turns carry the earlier turns' cold answers, so every prompt of the soak is known in
advance. Each answered request's tokens are compared with its prompt's cold tokens: a
position that differs is a wrong token, unless the cold run's top two log-probs at the
first difference are within ``TIE`` (1e-3) of each other (a near tie: vLLM's CPU kernels
are not batch-invariant, and the soak batches requests the cold runs did not), which is
counted apart.

**The faults**, one after another at evenly spaced times (a fault starts no sooner than the
previous fault's window ended):

* ``pause``: the server SIGSTOPped for 5 s, then SIGCONT;
* ``server``: the server SIGKILLed and started again on the same ports (same flags, its L1
  empty, the L2 kept);
* ``l2``: one Redis node SIGKILLed, 5 s down, started again on its port (empty; the cluster
  waits for it, so every L2 key's slot is unavailable meanwhile);
* ``link``: for ``LINK_FAULT_S`` (30 s; 15 s with ``--minutes`` under 5), and on until it
  has delayed or dropped a segment (at most 4 times as long), the proxy delays
  30% of the segments it reads, by 50-500 ms each (in order: a delayed segment holds back
  the ones behind it), and *drops* 2% of them: dropping closes the connection (both sides,
  the segment read is discarded; never bytes inside a live stream, which ZMTP could not
  resynchronise), so what was in flight on it is lost and ZeroMQ reconnects;
* ``replica``: replica 2 drained (no new requests routed to it, its in-flight ones
  answered, as a load balancer does), SIGKILLed (its process group), started again on the
  same port; traffic goes to replica 1 until it is healthy.

A fault's *window* runs from its start until ``max(10, timeout_s + 2)`` seconds after it
ended (the connector serves cold for ``retry_after_s`` after a failure, and a lookup it gave
up on is counted when its deadline passes); a request belongs to the window it was sent in.

**Counters.** The replicas' ``vllm:glm_cache_lookups_{sent,in_time,late,unanswered}_total``
and ``vllm:glm_cache_lease_releases_failed_total`` and the server's
``glm_cache_late_requests_total{op,outcome}`` are read at each window's start and end (a
replica's just before it is killed, the server's before it is killed: both restart from 0,
so the figures add the incarnations up); absent counters print ``n/a``, and so do a window's
figures when a serving replica's ``/metrics`` could not be read for two minutes (never a
partial sum). *Lost* lookups are
the unanswered ones no fault explains: unanswered outside the ``server``, ``link`` and
``replica`` windows (which kill connections and what is in flight on them; the connector
counts a lookup pending on a connection that drops as unanswered at once). A lookup the
server dropped as past its deadline (``outcome="dropped"``) is answered (``expired``), so
the engine counts it late, not unanswered. vLLM
publishes a connector's counts after an engine step, and the connector counts a lookup it
gave up when its deadline passes, so a window's counts may hold a lookup from just before
it: *lost* is an estimate (with steady traffic the engines step all the time), and each
case is in the replicas' logs (``did not answer 'lookup'``).

Also printed: TTFT (client side; for a PD pair from the prefill leg's send to the decode
leg's first token) p50/p99 and hit tokens (``usage.prompt_tokens_details.cached_tokens``
over prompt tokens; a PD pair's decode leg) in and out of the windows and per fault; the
server's resident memory (``/proc/PID/status`` VmRSS) when it started, when traffic began
and at the end (after a restart, the later process's). ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import random
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testing.l2_fixtures import l2_args
from testing.redis_nodes import RedisNodes
from testing.server_process import ServerProcess, free_port
from testing.stalls import StallWatch
from validation.demo import document
from validation.image_chat import png_data_url
from validation.serving import VllmServer, metric_sum, post_json, scrape_metrics, sse_events

ROOT = Path(__file__).resolve().parents[1]
C = 128
TIE = 1e-3
VOCAB = (16, 512)  # token ids the tiny checkpoint's vocabulary holds
MIX = {"chat": 0.35, "doc": 0.25, "pd": 0.25, "image": 0.15}
FAULTS = ("pause", "server", "l2", "link", "replica")
DESTRUCTIVE = ("server", "link", "replica")  # kill connections and what is in flight on them
PAUSE_S = 5.0
L2_DOWN_S = 5.0
LINK_FAULT_S = 30.0
LINK_DELAY_P, LINK_DELAY_S, LINK_DROP_P = 0.3, (0.05, 0.5), 0.02
CLIENT_JOIN_S = 300.0  # after the traffic, each client's request in flight answered within this, in all
CLIENT_JOIN_MAX_S = 900.0  # ... and within this, however long a CPU of the machine stood still meanwhile
COUNTERS_READ_S = 120.0  # a serving replica's /metrics read again for this long (stalls not counted) ...
COUNTERS_READ_MAX_S = 600.0  # ... and at most this long in all; then the figures are unknown, not partial
REPLICA_COUNTERS = {
    "sent": "vllm:glm_cache_lookups_sent_total",
    "in_time": "vllm:glm_cache_lookups_in_time_total",
    "late": "vllm:glm_cache_lookups_late_total",
    "unanswered": "vllm:glm_cache_lookups_unanswered_total",
    "lease_releases_failed": "vllm:glm_cache_lease_releases_failed_total",
}
SERVER_LATE = "glm_cache_late_requests_total"


# --- the link: a loopback TCP proxy that can delay and drop ---------------------------------


class FaultyLink:
    """A TCP proxy on a free loopback port in front of ``upstream_port``, in a thread of its
    own (asyncio). :meth:`fault` sets, for what it reads from then on, the share of segments
    delayed (by a uniform draw from ``delay_s``) and the share dropped: a dropped segment is
    discarded and its connection closed on both sides."""

    def __init__(self, upstream_port: int, seed: int = 46) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.stats: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._delay_p, self._delay_s, self._drop_p = 0.0, (0.0, 0.0), 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-link", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> FaultyLink:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self._loop).result(10)
        return self

    def fault(self, delay_p: float = 0.0, delay_s: tuple[float, float] = (0.0, 0.0), drop_p: float = 0.0) -> None:
        self._delay_p, self._delay_s, self._drop_p = delay_p, delay_s, drop_p

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            self.stats["upstream_refused"] += 1
            writer.close()
            return
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer)),
                 asyncio.ensure_future(self._pump(up_reader, writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for p in pumps:
            p.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                self.stats["segments"] += 1
                if self._drop_p and self._rng.random() < self._drop_p:
                    self.stats["dropped"] += 1  # the connection closes with it (_handle)
                    return
                if self._delay_p and self._rng.random() < self._delay_p:
                    self.stats["delayed"] += 1
                    await asyncio.sleep(self._rng.uniform(*self._delay_s))
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            return


# --- the pool of prompts and their cold runs -------------------------------------------------


@dataclass
class Prompt:
    """One prompt of the pool: its request body (less sampling) and its cold run."""

    kind: str  # chat, doc, pd, image
    name: str
    body: dict[str, Any]  # messages (chat, image) or prompt token ids (doc, pd)
    cold: list[Any] = field(default_factory=list)  # greedy tokens (ids; chat: token strings)
    margins: list[float] = field(default_factory=list)  # cold top-1 minus top-2 log-prob per token
    cold_text: str = ""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if "messages" in self.body else "/v1/completions"


@dataclass
class Reply:
    tokens: list[Any]
    margins: list[float]
    text: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def send(base_url: str, p: Prompt, salt: str, max_tokens: int, params: dict[str, Any] | None = None,
         timeout_s: float = 900.0) -> Reply:
    """One greedy streamed request of ``p``; the tokens, their top-2 margins, TTFT, usage."""
    body: dict[str, Any] = {**p.body, "model": "model", "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    if "messages" in p.body:
        body.update(logprobs=True, top_logprobs=2)
    else:
        body.update(logprobs=2, return_token_ids=True, ignore_eos=True)
    if params:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(base_url + p.path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    out = Reply([], [], "", 0.0, 0, 0)
    text: list[str] = []
    t0 = time.perf_counter()
    first = None
    for event in sse_events(req, timeout_s):
        for choice in event.get("choices") or []:
            if first is None:
                first = time.perf_counter() - t0
            if "delta" in choice:  # chat: token strings from the log-probs
                text.append(choice["delta"].get("content") or "")
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    out.tokens.append(lp["token"])
                    out.margins.append(_margin([t["logprob"] for t in lp.get("top_logprobs") or []]))
            else:
                text.append(choice.get("text") or "")
                out.tokens.extend(choice.get("token_ids") or [])
                for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                    out.margins.append(_margin(list((top or {}).values())))
        if event.get("usage"):
            out.prompt_tokens = event["usage"]["prompt_tokens"]
            out.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out.text = "".join(text)
    out.ttft_s = first if first is not None else time.perf_counter() - t0
    return out


def _margin(logprobs: list[float]) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def prefill_leg(base_url: str, p: Prompt, salt: str) -> dict[str, Any]:
    """A PD pair's first leg: ``T[:-1]``, one token, ``do_remote_decode``; returns the
    ``kv_transfer_params`` for the decode leg."""
    body = {"model": "model", "prompt": p.body["prompt"][:-1], "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt, "kv_transfer_params": {"do_remote_decode": True}}
    params = dict(post_json(base_url + "/v1/completions", body, timeout_s=900.0).get("kv_transfer_params") or {})
    params.pop("remote_prefill_cached_tokens", None)  # the decode's usage: its own cached tokens
    params.setdefault("do_remote_prefill", True)
    return params


def compare(p: Prompt, got: list[Any]) -> tuple[int, bool]:
    """(wrong tokens, near tie): positions where ``got`` differs from the cold run, and
    whether the first difference is at a near tie of the cold run (then not counted wrong)."""
    n = max(len(got), len(p.cold))
    diff = [i for i in range(n) if i >= len(got) or i >= len(p.cold) or got[i] != p.cold[i]]
    if not diff:
        return 0, False
    i = diff[0]
    if i < len(p.margins) and p.margins[i] < TIE:
        return 0, True
    return len(diff), False


def tokens_of(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def build_pool(args: argparse.Namespace) -> dict[str, list[Prompt]]:
    """The prompts, less the chat turns after the first (they need the cold answers)."""
    rng = random.Random(46)
    pool: dict[str, list[Prompt]] = {k: [] for k in MIX}
    for d in range(args.documents):
        doc = tokens_of(rng.randint(1000, 1600), rng)
        for q in range(args.questions):
            pool["doc"].append(Prompt("doc", f"doc{d}.q{q}", {"prompt": doc + tokens_of(rng.randint(20, 60), rng)}))
    for i in range(args.pd):
        pool["pd"].append(Prompt("pd", f"pd{i}", {"prompt": tokens_of(rng.randint(400, 1200), rng)}))
    words = ["cache", "state", "chunk", "prefix", "token", "image", "layer", "block", "server", "replica",
             "the", "of", "and", "to", "in", "is", "for", "on", "with", "as"]
    for i in range(args.images):
        text = " ".join(rng.choice(words) for _ in range(600)) + "\nDescribe the image."
        pool["image"].append(Prompt("image", f"image{i}", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(4600 + i)}}, {"type": "text", "text": text}]}]}))
    return pool


QUESTIONS = ["What does the report say about the cache?", "Which layer keeps a recurrent state?",
             "How are snapshots kept at the chunk boundary?", "Summarise the third section please.",
             "Which server holds the prefix?", "What happens when a replica restarts?"]


def cold_runs(args: argparse.Namespace, urls: list[str], log: Callable[[str], None]) -> dict[str, list[Prompt]]:
    """Every prompt once under a salt of its own, split over the replicas (two at a time);
    the chats turn by turn, each turn carrying the earlier turns' cold answers."""
    pool = build_pool(args)
    convs: list[list[Prompt]] = [[] for _ in range(args.conversations)]

    def conversation(c: int, url: str) -> None:
        messages = [{"role": "system", "content": "Answer from this document. " + document(90, 460 + c)}]
        for t in range(args.turns):
            messages = messages + [{"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]}]
            p = Prompt("chat", f"chat{c}.t{t}", {"messages": messages})
            cold_one(p, url)
            convs[c].append(p)
            messages = messages + [{"role": "assistant", "content": p.cold_text}]

    def cold_one(p: Prompt, url: str) -> None:
        r = send(url, p, f"cold-{uuid.uuid4().hex}", args.max_tokens)
        p.cold, p.margins, p.cold_text = r.tokens, r.margins, r.text

    jobs: list[Callable[[str], None]] = [lambda url, c=c: conversation(c, url) for c in range(args.conversations)]
    jobs += [lambda url, p=p: cold_one(p, url) for k in ("doc", "pd", "image") for p in pool[k]]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(url: str) -> None:
        while True:
            with lock:
                if not jobs or errors:
                    return
                job = jobs.pop(0)
            try:
                job(url)
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    pool["chat"] = [p for conv in convs for p in conv]
    log(f"cold runs: {sum(len(v) for v in pool.values())} prompts")
    return pool


# --- the stack --------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _poll(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll ``check`` until it returns a truthy value; raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


class Replica:
    """One ``vllm serve`` replica: restartable on its port, its counters added up over its
    incarnations, its requests in flight counted (to drain it)."""

    def __init__(self, name: str, engine: VllmServer, standing_still: Callable[[], list] = list) -> None:
        self.name, self.engine = name, engine
        self.standing_still = standing_still  # the CPUs that stand still now (testing.stalls)
        self.up = True
        self.starting = False  # killed and not serving again yet: this incarnation has counted nothing
        self.in_flight = 0
        self.base: dict[str, float] = {}  # counters of the incarnations before this one
        self.restarts = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.engine.base_url

    def counters(self) -> dict[str, float | None] | None:
        """Accumulated counters (a value None: absent); the base alone while the replica is
        down or starting again. A serving replica whose ``/metrics`` does not answer (its API
        server waits for a CPU that stands still) is read again for ``COUNTERS_READ_S``, not
        counting the time a CPU stands still; None if it never answers: its counts are
        unknown, never taken as 0 (which made a fault window's figures negative)."""
        now: dict[str, float | None] = {k: None for k in REPLICA_COUNTERS}
        start = last = time.monotonic()
        waited = 0.0
        while self.up or self.engine.proc is not None and self.engine.proc.poll() is None:
            try:
                samples = scrape_metrics(self.url)
            except OSError:
                if self.starting:
                    return {k: self.base.get(k) for k in REPLICA_COUNTERS}
                time.sleep(1.0)
                t = time.monotonic()
                if not self.standing_still():
                    waited += min(t - last, 12.0)  # a read times out after 10 s; a longer turn stood still
                last = t
                if waited >= COUNTERS_READ_S or t - start >= COUNTERS_READ_MAX_S:
                    return None
                continue
            now = {k: (metric_sum(samples, n) if any(s[0] == n for s in samples) else None)
                   for k, n in REPLICA_COUNTERS.items()}
            break
        return {k: (None if v is None and k not in self.base else (v or 0.0) + self.base.get(k, 0.0))
                for k, v in now.items()}

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def kill_and_restart(self, log: Callable[[str], None]) -> None:
        """Drain, read the counters, SIGKILL the process group, start again on the port."""
        self.up = False
        _poll(lambda: self.in_flight == 0, 900, f"{self.name} drained")
        last = self.counters()
        if last is None:
            raise RuntimeError(f"{self.name}: /metrics not readable before the kill; its counts would be lost")
        self.base = {k: v for k, v in last.items() if v is not None}
        proc = self.engine.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.starting = True
        log(f"{self.name} killed (SIGKILL, pid {proc.pid}); starting it again on port {self.engine.port}")
        self.engine.launch().wait_ready(progress=False)
        warm_up(self.url)
        self.restarts += 1
        self.starting, self.up = False, True


def warm_up(url: str) -> None:
    """The first step after start-up names the weights (nothing is saved before it)."""
    send(url, Prompt("doc", "warm", {"prompt": tokens_of(C + 9, random.Random(time.time_ns()))}),
         f"warm-{uuid.uuid4().hex}", 2)


class CacheServer:
    """glm-cache-server with its L2; restartable on the same ports; counters added up."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args, self.log_path = args, log_path
        self.proc = ServerProcess(*args, log_path=log_path).start()
        self.base: dict[tuple[str, str], float] = Counter()
        self.restarts = 0
        self.paused = False
        self.first_pid = self.proc.proc.pid if self.proc.proc else 0
        self.rss_start = _rss_mib(self.first_pid)

    @property
    def port(self) -> int:
        return self.proc.port

    def late(self) -> dict[tuple[str, str], float] | None:
        """``glm_cache_late_requests_total`` by (op, outcome), over the incarnations; None
        where the counter is absent (or the server unreadable and nothing counted yet)."""
        if self.paused:
            return None
        try:
            samples = scrape_metrics(self.proc.http_url, timeout_s=5)
        except OSError:
            return None
        rows = [(ls.get("op", ""), ls.get("outcome", ""), v) for n, ls, v in samples if n == SERVER_LATE]
        if not rows and not self.base:
            return None
        out: dict[tuple[str, str], float] = Counter(self.base)
        for op, outcome, v in rows:
            out[(op, outcome)] += v
        return dict(out)

    def kill_and_restart(self) -> None:
        last = self.late()
        if last is not None:
            self.base = Counter(last)
        self.proc.kill()
        self.proc = ServerProcess(*self.args, port=self.proc.port, http_port=self.proc.http_port,
                                  log_path=self.log_path).start()
        self.restarts += 1

    def rss(self) -> float | None:
        return _rss_mib(self.proc.proc.pid) if self.proc.proc else None


# --- the soak ---------------------------------------------------------------------------------


@dataclass
class Record:
    kind: str
    name: str
    replica: str
    sent_s: float  # since the traffic began
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wrong_tokens: int = 0
    near_tie: bool = False
    window: str | None = None


@dataclass
class Window:
    fault: str
    start_s: float
    fault_end_s: float = 0.0
    end_s: float = 0.0
    note: str = ""
    counters_start: dict[str, Any] = field(default_factory=dict)
    counters_end: dict[str, Any] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else None


class Soak:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None] = print) -> None:
        self.args, self.log = args, log
        self.records: list[Record] = []
        self.windows: list[Window] = []
        self._lock = threading.Lock()
        self._turn: Counter[int] = Counter()
        self._in_flight: dict[int, Record] = {}  # each client thread's request under way
        self._rr = 0
        self.t0 = 0.0

    # counters: every replica's (added up) and the server's late requests
    def counters(self) -> dict[str, Any]:
        t = time.monotonic()
        read = [r.counters() for r in self.replicas]
        per = [p for p in read if p is not None]
        total = {k: (None if len(per) < len(read) or all(p[k] is None for p in per)  # a replica unread: unknown
                     else sum(p[k] or 0.0 for p in per)) for k in REPLICA_COUNTERS}
        late = self.server.late()
        if time.monotonic() - t > 5:
            self.log(f"  (reading the counters took {time.monotonic() - t:.0f} s)")
        return {"replicas": total, "server_late": {f"{op}/{outcome}": v for (op, outcome), v in (late or {}).items()}
                if late is not None else None}

    def pick(self, avoid: Replica | None = None) -> Replica:
        while True:
            with self._lock:
                up = [r for r in self.replicas if r.up and r is not avoid] or [r for r in self.replicas if r.up]
                if up:
                    r = up[self._rr % len(up)]
                    self._rr += 1
                    r.enter()
                    return r
            time.sleep(0.05)

    def next_prompt(self, rng: random.Random) -> Prompt:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind == "chat":
            c = rng.randrange(self.args.conversations)
            with self._lock:
                t = self._turn[c] % self.args.turns
                self._turn[c] += 1
            return self.pool["chat"][c * self.args.turns + t]
        return rng.choice(self.pool[kind])

    def one(self, p: Prompt) -> Record:
        rec = Record(p.kind, p.name, "", time.monotonic() - self.t0)
        first = self.pick()
        me = threading.get_ident()
        try:
            rec.replica = first.name
            with self._lock:
                self._in_flight[me] = rec
            if p.kind == "pd":
                t0 = time.perf_counter()
                params = prefill_leg(first.url, p, self.args.salt)
                prefill_s = time.perf_counter() - t0
                first.leave()
                second = self.pick(avoid=first)
                rec.replica += ">" + second.name
                first = second
                reply = send(second.url, p, self.args.salt, self.args.max_tokens, params)
                reply.ttft_s += prefill_s
            else:
                reply = send(first.url, p, self.args.salt, self.args.max_tokens)
            rec.ok = True
            rec.ttft_s, rec.prompt_tokens, rec.cached_tokens = reply.ttft_s, reply.prompt_tokens, reply.cached_tokens
            rec.wrong_tokens, rec.near_tie = compare(p, reply.tokens)
        except (OSError, urllib.error.URLError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            first.leave()
            with self._lock:
                self._in_flight.pop(me, None)
        if rec.wrong_tokens:
            self.log(f"  WRONG: {p.name} on {rec.replica} at {rec.sent_s:.1f} s: {rec.wrong_tokens} tokens differ")
        return rec

    def client(self, seed: int, stop: threading.Event) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            rec = self.one(self.next_prompt(rng))
            with self._lock:
                self.records.append(rec)

    # faults
    def grace_s(self) -> float:
        return max(10.0, self.args.timeout_s + 2.0)

    def run_fault(self, name: str) -> Window:
        w = Window(name, time.monotonic() - self.t0)
        faulthandler.dump_traceback_later(120, exit=False)  # a fault that hangs says where
        w.counters_start = self.counters()
        self.log(f"[{w.start_s:6.1f} s] fault: {name}")
        if name == "pause":
            self.server.paused = True
            self.server.proc.pause()
            time.sleep(PAUSE_S)  # the fault's length, not a wait for anything
            self.server.proc.resume()
            self.server.paused = False
            w.note = f"SIGSTOP {PAUSE_S:.0f} s, SIGCONT"
        elif name == "server":
            pid = self.server.proc.proc.pid if self.server.proc.proc else 0
            self.server.kill_and_restart()
            w.note = f"SIGKILL (pid {pid}), started again on ports {self.server.port}/{self.server.proc.http_port}"
        elif name == "l2":
            self.redis.kill(1)
            time.sleep(L2_DOWN_S)  # the fault's length
            self.redis.restart(1)
            w.note = f"Redis node on port {self.redis.ports[1]} SIGKILLed, {L2_DOWN_S:.0f} s down, started again (empty)"
        elif name == "link":
            length = LINK_FAULT_S if self.args.minutes >= 5 else LINK_FAULT_S / 2
            before = Counter(self.link.stats)
            self.link.fault(LINK_DELAY_P, LINK_DELAY_S, LINK_DROP_P)
            started = time.monotonic()
            time.sleep(length)  # the fault's length, and on until it has hit a segment (a loaded host may
            while time.monotonic() - started < 4 * length:  # pass none for a while), at most 4 times as long
                hit = Counter(self.link.stats)
                hit.subtract(before)
                if hit["delayed"] + hit["dropped"]:
                    break
                time.sleep(0.2)
            self.link.fault()
            length = time.monotonic() - started
            got = Counter(self.link.stats)
            got.subtract(before)
            w.note = (f"{length:.0f} s: {got['segments']} segments, {got['delayed']} delayed "
                      f"{LINK_DELAY_S[0] * 1e3:.0f}-{LINK_DELAY_S[1] * 1e3:.0f} ms, {got['dropped']} dropped "
                      f"(connection closed), {got['connections']} connections opened")
        elif name == "replica":
            victim = self.replicas[1]
            victim.kill_and_restart(self.log)
            w.note = f"{victim.name} drained, SIGKILLed, started again on port {victim.engine.port}"
        else:
            raise ValueError(f"unknown fault {name!r}")
        faulthandler.cancel_dump_traceback_later()
        w.fault_end_s = time.monotonic() - self.t0
        self.log(f"[{w.fault_end_s:6.1f} s] fault over: {w.note}")
        return w

    def run(self) -> dict[str, Any]:
        a = self.args
        from glm5next_tiny import ensure_checkpoint

        self.stall_watch = StallWatch().start()  # the machine's own stalls, reported beside the faults
        ckpt = ensure_checkpoint(Path(a.checkpoint), log=self.log)
        logs = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="glm-soak-"))
        logs.mkdir(parents=True, exist_ok=True)
        self.log(f"logs in {logs}")
        self.redis = RedisNodes(3, cluster=True, maxmemory_mb=256).start()
        self.replicas: list[Replica] = []
        self.link: FaultyLink | None = None
        try:
            self.server = CacheServer(["--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb",
                                       str(a.l1_gb), *l2_args(self.redis.url)], logs / "server.log")
            self.link = FaultyLink(self.server.port).start()
            self.log(f"server {self.server.proc.url} (HTTP {self.server.proc.http_url}), L2 {self.redis.url}, "
                     f"replicas through the link {self.link.url}")
            config = json.dumps({"kv_connector": "GlmCacheConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"server": self.link.url, "timeout_s": a.timeout_s}})
            for i in range(2):
                engine = VllmServer(ckpt, "--enforce-eager", "--max-num-batched-tokens", str(C),
                                    "--prefix-cache-retention-interval", str(C), "--dtype", "float32",
                                    "--max-num-seqs", "4", "--block-size", str(C), "--seed", "0",
                                    "--limit-mm-per-prompt", json.dumps({"image": 1}), "--mm-processor-cache-gb", "0",
                                    kv_transfer_config=config, max_model_len=4096,
                                    env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": a.cores[i]},
                                    log_path=logs / f"replica{i + 1}.log")
                self.replicas.append(Replica(f"replica{i + 1}", engine, self.stall_watch.standing_still))
            t = time.monotonic()
            for r in self.replicas:  # both start-ups overlap
                r.engine.launch()
            for r in self.replicas:
                r.engine.wait_ready(progress=False)
                warm_up(r.url)
            self.log(f"replicas ready after {time.monotonic() - t:.0f} s")
            t = time.monotonic()
            self.pool = cold_runs(a, [r.url for r in self.replicas], self.log)
            self.log(f"cold runs took {time.monotonic() - t:.0f} s")
            return self.traffic()
        finally:
            for r in self.replicas:
                r.engine.stop()
            if self.link is not None:
                self.link.stop()
            if hasattr(self, "server"):
                self.server.proc.stop()
            self.redis.stop()
            self.stall_watch.stop()


    def wait_until(self, at_s: float) -> None:
        """Sleep until ``at_s`` seconds into the traffic (the schedule), noting progress each
        minute; a watchdog dumps every thread's stack to stderr if this thread stalls."""
        while (now := time.monotonic() - self.t0) < at_s:
            faulthandler.dump_traceback_later(60, exit=False)
            time.sleep(min(0.2, at_s - now))
            if now >= self._next_note:
                with self._lock:
                    done = list(self.records)
                self.log(f"[{now:6.1f} s] {len(done)} requests answered or failed, {sum(not r.ok for r in done)} "
                         f"failed, {sum(r.wrong_tokens for r in done)} wrong tokens")
                self._next_note += 60.0
        faulthandler.cancel_dump_traceback_later()

    def faults(self, names: list[str], duration_s: float) -> None:
        """The faults, from this thread (the main one: a child that a fault starts again is
        tied to the thread that starts it, testing.children)."""
        n = len(names)
        for i, name in enumerate(names):
            at = duration_s * (i + 1) / (n + 1)
            if self.windows:
                at = max(at, self.windows[-1].end_s)
            self.wait_until(at)
            w = self.run_fault(name)
            w.end_s = w.fault_end_s + self.grace_s()
            self.windows.append(w)
            self.wait_until(w.end_s)
            w.counters_end = self.counters()

    def traffic(self) -> dict[str, Any]:
        a = self.args
        names = [f for f in a.faults if f]
        duration_s = a.minutes * 60.0
        rss_traffic = self.server.rss()
        counters_start = self.counters()
        stop = threading.Event()
        self.t0 = time.monotonic()
        self._next_note = 60.0
        self.log(f"traffic: {a.clients} clients for {duration_s:.0f} s; faults {', '.join(names) or 'none'}")
        clients = [threading.Thread(target=self.client, args=(1000 + i, stop), daemon=True) for i in range(a.clients)]
        for c in clients:
            c.start()
        try:
            self.faults(names, duration_s)
            self.wait_until(duration_s)
        finally:
            stop.set()
            stuck = self.join_clients(clients)
        if stuck:  # a request that is never answered is the failure to see, not a hung run
            tails = "\n".join(f"--- {r.name} ({r.url}), log tail:\n{r.engine.log_tail(40)}" for r in self.replicas)
            raise RuntimeError(f"{len(stuck)} request(s) unanswered {CLIENT_JOIN_S:.0f} s after the traffic "
                               f"ended: {'; '.join(stuck)}\n{tails}")
        traffic_s = time.monotonic() - self.t0
        counters_end = self.counters()
        return self.report(traffic_s, counters_start, counters_end, rss_traffic)

    def join_clients(self, clients: list[threading.Thread]) -> list[str]:
        """Wait for each client's request in flight, at most ``CLIENT_JOIN_S`` in all, not
        counting time while a CPU of the machine stands still (a thread of a replica running
        or pinned there waits for the host to run it again; testing.stalls), nor a turn of
        this loop that came back late (the whole machine stood still), and never more
        than ``CLIENT_JOIN_MAX_S``; what is still unanswered then (prompt, replica, seconds
        since it was sent), with every thread's stack on stderr."""
        start = last = time.monotonic()
        waited = 0.0
        while any(c.is_alive() for c in clients) and waited < CLIENT_JOIN_S \
                and last - start < CLIENT_JOIN_MAX_S:
            next(c for c in clients if c.is_alive()).join(1.0)
            now = time.monotonic()
            if not self.stall_watch.standing_still():  # and at most 2 s a turn: a longer one stood still here
                waited += min(now - last, 2.0)
            last = now
        if not any(c.is_alive() for c in clients):
            return []
        faulthandler.dump_traceback(all_threads=True)
        now = time.monotonic() - self.t0
        with self._lock:
            return [f"{r.name} on {r.replica} sent {now - r.sent_s:.0f} s ago" for r in self._in_flight.values()]

    # the report
    def report(self, traffic_s: float, c0: dict[str, Any], c1: dict[str, Any], rss_traffic: float | None) -> dict:
        for rec in self.records:
            for w in self.windows:
                if w.start_s <= rec.sent_s < w.end_s:
                    rec.window = w.fault
        recs = self.records
        ok = [r for r in recs if r.ok]

        def stats(rs: list[Record]) -> dict[str, Any]:
            ttft = [r.ttft_s * 1e3 for r in rs if r.ok]
            prompt = sum(r.prompt_tokens for r in rs if r.ok)
            cached = sum(r.cached_tokens for r in rs if r.ok)
            return {"requests": len(rs), "answered": sum(r.ok for r in rs), "ttft_ms_p50": _pct(ttft, 0.5),
                    "ttft_ms_p99": _pct(ttft, 0.99), "cached_tokens": cached, "prompt_tokens": prompt,
                    "hit_share": cached / prompt if prompt else None,
                    "wrong_tokens": sum(r.wrong_tokens for r in rs), "near_ties": sum(r.near_tie for r in rs)}

        def delta(a_: dict[str, Any], b_: dict[str, Any]) -> dict[str, Any]:
            ra, rb = a_.get("replicas") or {}, b_.get("replicas") or {}
            out: dict[str, Any] = {k: (None if ra.get(k) is None or rb.get(k) is None else rb[k] - ra[k])
                                   for k in REPLICA_COUNTERS}
            sa, sb = a_.get("server_late"), b_.get("server_late")
            out["server_late"] = None if sb is None else {k: v - (sa or {}).get(k, 0.0) for k, v in sb.items()}
            return out

        lookups = delta(c0, c1)
        windows = []
        explained: float | None = 0.0
        for w in self.windows:
            d = delta(w.counters_start, w.counters_end)
            if w.fault in DESTRUCTIVE:
                explained = None if explained is None or d["unanswered"] is None else explained + d["unanswered"]
            windows.append({"fault": w.fault, "start_s": w.start_s, "fault_end_s": w.fault_end_s, "end_s": w.end_s,
                            "note": w.note, "lookups": d, **stats([r for r in recs if r.window == w.fault])})
        dropped = None
        if lookups["server_late"] is not None:
            dropped = sum(v for k, v in lookups["server_late"].items() if k.endswith("/dropped") and "lookup" in k)
        lost = None
        if lookups["unanswered"] is not None and explained is not None:  # else unknown: a read failed
            lost = max(0.0, lookups["unanswered"] - explained)
        kinds = {k: stats([r for r in recs if r.kind == k]) for k in MIX}
        result = {
            "command_args": {k: v for k, v in vars(self.args).items()},
            "mix": MIX, "faults": [w.fault for w in self.windows], "traffic_s": traffic_s,
            "pool": {k: len(v) for k, v in self.pool.items()},
            "sent": len(recs), "answered": len(ok), "errors": [asdict(r) for r in recs if not r.ok][:20],
            "compared": len(ok), "wrong_tokens": sum(r.wrong_tokens for r in ok),
            "wrong_requests": [asdict(r) for r in ok if r.wrong_tokens][:20],
            "near_ties": sum(r.near_tie for r in ok),
            "outside": stats([r for r in recs if r.window is None]),
            "inside": stats([r for r in recs if r.window is not None]),
            "all": stats(recs),
            "kinds": kinds, "windows": windows,
            "lookups": {**{k: lookups[k] for k in REPLICA_COUNTERS}, "explained_by_faults": explained,
                        "server_dropped_late": dropped, "lost": lost, "server_late": lookups["server_late"]},
            "server": {"rss_mib_start": self.server.rss_start, "rss_mib_traffic_start": rss_traffic,
                       "rss_mib_end": self.server.rss(), "restarts": self.server.restarts},
            "replica_restarts": {r.name: r.restarts for r in self.replicas},
            "link": dict(self.link.stats) if self.link else {},
            "machine_stalls": [{"cpu": cpu, "at_s": start - (time.time() - (time.monotonic() - self.t0)), "s": length}
                               for cpu, start, length in self.stall_watch.stalls],
        }
        print_report(result)
        return result


def _f(v: Any, fmt: str = "{:.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def print_report(r: dict[str, Any]) -> None:
    print()
    print(f"Soak with faults: {r['traffic_s']:.0f} s of traffic, {r['command_args']['clients']} clients, "
          f"mix {', '.join(f'{k} {v:.0%}' for k, v in r['mix'].items())}; pool {r['pool']}")
    print(f"requests sent {r['sent']}, answered {r['answered']}; outputs compared with cold runs {r['compared']}: "
          f"wrong tokens {r['wrong_tokens']} (near ties apart: {r['near_ties']})")
    print()
    print("| requests sent in | requests | answered | TTFT p50 ms | TTFT p99 ms | hit tokens / prompt tokens "
          "| lookups sent | in time | late | unanswered |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def row(label: str, s: dict[str, Any], lk: dict[str, Any] | None) -> None:
        share = f"{s['cached_tokens']} / {s['prompt_tokens']} ({_f(s['hit_share'], '{:.0%}')})"
        lk = lk or {}
        print(f"| {label} | {s['requests']} | {s['answered']} | {_f(s['ttft_ms_p50'])} | {_f(s['ttft_ms_p99'])} "
              f"| {share} | {_f(lk.get('sent'))} | {_f(lk.get('in_time'))} | {_f(lk.get('late'))} "
              f"| {_f(lk.get('unanswered'))} |")

    row("outside fault windows", r["outside"], None)
    row("inside fault windows", r["inside"], None)
    for w in r["windows"]:
        row(f"{w['fault']} ({w['start_s']:.0f}-{w['end_s']:.0f} s)", w, w["lookups"])
    row("all", r["all"], r["lookups"])
    print()
    print("| kind | requests | answered | TTFT p50 ms | TTFT p99 ms | hit tokens / prompt tokens | wrong tokens |")
    print("|---|---|---|---|---|---|---|")
    for k, s in r["kinds"].items():
        print(f"| {k} | {s['requests']} | {s['answered']} | {_f(s['ttft_ms_p50'])} | {_f(s['ttft_ms_p99'])} "
              f"| {s['cached_tokens']} / {s['prompt_tokens']} | {s['wrong_tokens']} |")
    lk = r["lookups"]
    print()
    print(f"lookups (replicas' counters, added up over restarts): sent {_f(lk['sent'])}, answered in time "
          f"{_f(lk['in_time'])}, late {_f(lk['late'])}, unanswered {_f(lk['unanswered'])} (in server/link/replica "
          f"windows {_f(lk['explained_by_faults'])}; the server dropped {_f(lk['server_dropped_late'])} as late, counted late here), "
          f"lost {_f(lk['lost'])}; lease releases failed {_f(lk['lease_releases_failed'])}")
    print(f"server late requests (glm_cache_late_requests_total, op/outcome): "
          f"{'n/a' if lk['server_late'] is None else lk['server_late']}")
    s = r["server"]
    print(f"server RSS MiB: at start-up {_f(s['rss_mib_start'], '{:.1f}')}, when traffic began "
          f"{_f(s['rss_mib_traffic_start'], '{:.1f}')}, at the end {_f(s['rss_mib_end'], '{:.1f}')} "
          f"(restarts: {s['restarts']})")
    for w in r["windows"]:
        print(f"  {w['fault']}: {w['note']}")
    stalls = r.get("machine_stalls") or []
    print("machine stalls (a CPU stood still; testing/stalls.py): "
          + (", ".join(f"cpu {st.get('cpu')} at {st['at_s']:.0f} s for {st['s']:.1f} s" for st in stalls) or "none"))
    if r["errors"]:
        print("errors:", *(f"  {e['name']} on {e['replica']} at {e['sent_s']:.1f} s: {e['error']}" for e in r["errors"]),
              sep="\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="traffic at least this long (faults may extend it)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order, of {', '.join(FAULTS)}")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="the connector's timeout_s")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--pd", type=int, default=4)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--l1-gb", type=float, default=1.0)
    ap.add_argument("--salt", default="soak")
    ap.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "glm5next-tiny"))
    ap.add_argument("--keep", help="write the processes' logs here (default: a temporary directory)")
    ap.add_argument("--cores", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND of replica 1 and replica 2, comma-separated (default: the first "
                         "two cores this process may run on, one each; the same core twice shares it)")
    args = ap.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}")
    allowed = sorted(os.sched_getaffinity(0))
    args.cores = (args.cores.split(",") if args.cores else [str(c) for c in (allowed * 2)[:2]])
    if len(args.cores) != 2 or not all(c.strip() for c in args.cores):
        ap.error(f"--cores: two values (replica 1, replica 2), got {args.cores!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = Soak(args, log=lambda line: print(line, flush=True)).run()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    r = main()
    raise SystemExit(0 if r["answered"] == r["sent"] and r["wrong_tokens"] == 0 and not r["lookups"]["lost"] else 1)
