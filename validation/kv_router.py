"""A small KV-aware router for benchmarks (issue 33, item 4): an HTTP proxy in front of
several ``vllm serve`` replicas, each with its own glm-cache-server, that picks a replica
per chat request by asking each replica's server how much of the prompt it can resume
(``POST /query``, :mod:`cache_server.prefix_query`), against plain round robin.

Policies:

- ``round-robin``: replica ``turn % n``. The servers are asked too, before the forward,
  only to measure what was reusable at routing time (asked beside the forward, the answer
  on 2 loaded cores came after the engine had saved the request's own prefix: 768 tokens
  "held" by a replica that then found 0); :attr:`Route.forward_ttft_ms` times the request
  from the forward, which is what round robin without the probe would serve.
- ``cache-aware``: tokenize the request's ``messages`` with the checkpoint's chat template
  (as vLLM's OpenAI server renders them: template to text, then token ids without special
  tokens), ask every replica's server ``/query`` for those ids and the request's
  ``cache_salt`` at once, pick the longest resumable prefix (L1, ``CPU``); ties go to the
  fewest requests in flight, then to the round-robin turn (:func:`pick`).

Every chat request is recorded (:class:`Route`): the servers' answers at routing time, the
replica chosen, what scoring cost (tokenize and query, ms), and from the proxied stream the
time to the first content chunk and vLLM's ``usage`` (prompt and cached tokens; the tool
asks ``stream_options.include_usage``). Other paths (``/v1/models``) go to the first replica.

Only for validation: it trusts its replicas, but bounds what clients send (body size, the
shape of ``messages``, the salt) and scores a request it cannot tokenize 0 everywhere
rather than failing it; the engine answers such a request's error itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_BODY_BYTES = 8 << 20
MAX_MESSAGES = 4096
MAX_SALT_CHARS = 256
POLICIES = ("round-robin", "cache-aware")


def pick(scores: Sequence[int], inflight: Sequence[int], turn: int) -> int:
    """The replica to send a request to: the longest resumable prefix, then the fewest
    requests in flight, then the first at or after ``turn`` (mod n) in round-robin order,
    so cold requests spread as round robin would."""
    n = len(scores)
    if n == 0 or len(inflight) != n:
        raise ValueError("one score and one in-flight count per replica")
    return min(range(n), key=lambda i: (-scores[i], inflight[i], (i - turn) % n))


def resumable(held: int, prompt_tokens: int, chunk: int) -> int:
    """What a strict-prefix hit can use of ``held`` tokens for a prompt of
    ``prompt_tokens``: whole chunks, and at least one prompt token left to compute."""
    if prompt_tokens <= 0 or chunk <= 0:
        return 0
    return max(0, min(held, chunk * ((prompt_tokens - 1) // chunk)))


def score_of(answer: Any, medium: str = "CPU") -> int:
    """The largest ``medium`` figure over the namespaces of a ``/query`` answer
    (``{tenant: {namespace: {"longest_matched", "CPU", ...}}}``), 0 for anything else."""
    best = 0
    if isinstance(answer, dict):
        for entries in answer.values():
            if isinstance(entries, dict):
                for entry in entries.values():
                    v = entry.get(medium) if isinstance(entry, dict) else None
                    if isinstance(v, int) and not isinstance(v, bool) and v > best:
                        best = v
    return best


@dataclass
class Replica:
    engine_url: str  # vllm serve, e.g. http://127.0.0.1:8000
    server_url: str  # that replica's glm-cache-server HTTP, e.g. http://127.0.0.1:8080
    inflight: int = 0


@dataclass
class Route:
    """One proxied chat request."""

    policy: str
    replica: int
    tokens: int  # token ids the router computed
    held: list[int]  # per replica: the server's resumable prefix (CPU), tokens; -1 if not answered
    tokenize_ms: float
    query_ms: float
    score_ms: float  # receipt to the choice (tokenize, ask the servers; round robin: the measuring probe)
    status: int = 0
    ttft_ms: float | None = None  # router receipt to the first content chunk
    forward_ttft_ms: float | None = None  # the forward to the engine to the first content chunk
    total_ms: float = 0.0
    prompt_tokens: int | None = None  # vLLM's usage
    cached_tokens: int | None = None
    inflight: list[int] = field(default_factory=list)  # per replica, at routing time


class Tokenizer:
    """The checkpoint's chat template, rendered as vLLM's chat endpoint does."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(checkpoint)

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])


def checked_messages(body: Any) -> list[dict[str, str]] | None:
    """``messages`` if they are a bounded list of ``{role, content}`` with string content
    (all the tool sends), else None (scored 0, forwarded as is)."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list) or not 0 < len(msgs) <= MAX_MESSAGES:
        return None
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


class Router:
    """The proxy, on its own event loop thread: :meth:`start` returns its URL."""

    def __init__(self, replicas: Sequence[Replica], policy: str, tokenize: Callable[[list[dict[str, str]]], list[int]],
                 query_model: str, chunk: int, host: str = "127.0.0.1", query_timeout_s: float = 5.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.replicas = list(replicas)
        self.policy = policy
        self.tokenize = tokenize
        self.query_model = query_model
        self.chunk = chunk
        self.host = host
        self.query_timeout_s = query_timeout_s
        self.routes: list[Route] = []
        self.last_body: Any = None
        self._turn = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> Router:
        self._thread = threading.Thread(target=self._run, name="kv-router", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or not self.port:
            raise RuntimeError("router did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    # -- scoring ----------------------------------------------------------------------
    async def _ask(self, replica: Replica, ids: list[int], salt: str | None) -> int:
        import aiohttp

        body: dict[str, Any] = {"model": self.query_model, "token_ids": ids}
        if salt:
            body["cache_salt"] = salt
        try:
            async with self._session.post(replica.server_url + "/query", json=body,
                                          timeout=aiohttp.ClientTimeout(total=self.query_timeout_s)) as r:
                if r.status != 200:  # 404: no namespace of that model (the served name) on this server
                    return -1
                return score_of(await r.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return -1

    async def _score(self, body: Any) -> tuple[list[int], int, float, float]:
        """Per replica the server's resumable prefix (capped to what the prompt can
        resume), the prompt's token count, and the ms spent tokenizing and querying."""
        t0 = time.perf_counter()
        msgs = checked_messages(body)
        ids: list[int] = []
        if msgs is not None:
            try:
                ids = self.tokenize(msgs)
            except Exception:  # noqa: BLE001 - a template the request breaks: scored 0
                ids = []
        t1 = time.perf_counter()
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        salt = salt if isinstance(salt, str) and len(salt) <= MAX_SALT_CHARS else None
        if ids:
            answers = await asyncio.gather(*(self._ask(r, ids, salt) for r in self.replicas))
            held = [a if a < 0 else resumable(a, len(ids), self.chunk) for a in answers]
        else:
            held = [0] * len(self.replicas)
        t2 = time.perf_counter()
        return held, len(ids), (t1 - t0) * 1e3, (t2 - t1) * 1e3

    # -- handlers ---------------------------------------------------------------------
    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        t0 = time.perf_counter()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        self.last_body = body
        turn = self._turn
        self._turn += 1
        held, n, tok_ms, q_ms = await self._score(body)
        inflight = [r.inflight for r in self.replicas]
        if self.policy == "cache-aware":
            choice = pick([max(h, 0) for h in held], inflight, turn)
        else:
            choice = turn % len(self.replicas)
        route = Route(self.policy, choice, n, held, tok_ms, q_ms, (time.perf_counter() - t0) * 1e3,
                      inflight=inflight)
        self.routes.append(route)
        replica = self.replicas[choice]
        replica.inflight += 1
        try:
            return await self._forward(request, replica, raw, route, t0)
        finally:
            replica.inflight -= 1
            route.total_ms = (time.perf_counter() - t0) * 1e3

    async def _forward(self, request: Any, replica: Replica, raw: bytes, route: Route, t0: float) -> Any:
        from aiohttp import web

        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        t_fwd = time.perf_counter()
        async with self._session.post(replica.engine_url + "/v1/chat/completions", data=raw, headers=headers) as up:
            route.status = up.status
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/json")})
            await resp.prepare(request)
            async for line in up.content:
                self._observe(line, route, t0, t_fwd)
                await resp.write(line)
            await resp.write_eof()
            return resp

    @staticmethod
    def _observe(line: bytes, route: Route, t0: float, t_fwd: float) -> None:
        """TTFT and usage from one SSE line of vLLM's stream."""
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            return
        try:
            event = json.loads(line[5:])
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if route.ttft_ms is None:
            for choice in event.get("choices") or []:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and delta.get("content"):
                    now = time.perf_counter()
                    route.ttft_ms, route.forward_ttft_ms = (now - t0) * 1e3, (now - t_fwd) * 1e3
                    break
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                route.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            route.cached_tokens = cached if isinstance(cached, int) else 0

    async def _passthrough(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        url = self.replicas[0].engine_url + request.rel_url.path_qs
        async with self._session.request(request.method, url, data=raw or None,
                                         headers={"Content-Type": request.headers.get("Content-Type",
                                                                                      "application/json")}) as up:
            return web.Response(status=up.status, body=await up.read(),
                                content_type=(up.content_type or "application/json"))

    def time_scoring(self, repeat: int = 20) -> tuple[float, float]:
        """Score the last chat request again ``repeat`` times on the router's loop, one at
        a time (tokenize, ask every server): the router's cost with nothing else in flight.
        Returns the mean and p99 ms."""
        if self.last_body is None or self._loop is None:
            return 0.0, 0.0
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(self._score(self.last_body), self._loop).result(30)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return sum(times) / len(times), times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]

    def records(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.routes]
