"""A small prefill/decode disaggregation proxy (issue 34) in front of two ``vllm serve``
instances that share one glm-cache-server: a prefill instance (``kv_role``
``kv_producer``) and a decode instance (``kv_consumer``), both with ``GlmCacheConnector``.

vLLM's PD convention (its disaggregation proxy examples and the NIXL connector): the proxy
sends a request to the prefill instance with ``kv_transfer_params {"do_remote_decode":
true}`` and ``max_tokens`` 1, then sends the client's request to the decode instance with
the ``kv_transfer_params`` the prefill response returned, and passes the decode response
(streamed or not) back to the client.

What differs here: vLLM always computes the last prompt token on the decode side, and a
recurrent (KDA) state cannot take a token twice, so the prefill instance is given the
prompt *without its last token*: token ids ``T[:-1]``, ``max_tokens`` 1. The decode instance
gets the whole prompt ``T`` with the client's sampling parameters and the prefill
response's ``kv_transfer_params`` (``{"do_remote_prefill": true}`` when it returned none),
and computes only the last prompt token when the connector finds the hand-off the prefill
stored (``connector/handoff.py``), the part past the chunks' strict prefix otherwise.

Only ``POST /v1/completions`` (``prompt`` as one list of token ids, or one string, which
the prefill instance's ``POST /tokenize`` turns into ids so both instances see the same
ids) and ``GET /health`` (200 when both instances answer theirs). A prompt of one token
has nothing to hand off: it goes to the decode instance alone, without PD parameters.

vLLM's scheduler adds ``remote_prefill_cached_tokens`` (the prefill's own prefix-cache
hits) to the parameters a prefill returns with ``do_remote_prefill``, and the decode
instance then reports *that* as ``usage.prompt_tokens_details.cached_tokens``. With
``decode_usage=True`` (``--decode-usage``) the proxy drops that key, so the decode usage
reports the decode instance's own cached tokens (what it did not compute), which
``validation/bench_pd.py`` measures.

Client input is bounded and checked before anything is sent upstream (body size, JSON,
the prompt's type and length, ``max_tokens``, ``stream``, the salt, model); errors are 400
with a JSON ``error``; a client may not set ``kv_transfer_params`` (the proxy owns them).
An instance that cannot be reached is a 502; an instance's own error response is passed
back as it came.

    python -m validation.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

In process (tests, benchmarks): ``with PdProxy(prefill_url, decode_url) as proxy: proxy.url``.
Each request is recorded (:class:`PdRecord`, :meth:`PdProxy.records`, the last
``MAX_RECORDS``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

MAX_BODY_BYTES = 8 << 20
MAX_PROMPT_TOKENS = 1 << 17
MAX_PROMPT_CHARS = 4 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_SHORT_STR = 256  # model, cache_salt
MAX_RECORDS = 10000
MAX_INFLIGHT = 256
# Fields whose effect the proxy cannot give the prefill instance the same way (it would
# compute other tokens than the decode instance resumes), so a request with them is refused.
REFUSED_FIELDS = ("kv_transfer_params", "prompt_embeds", "truncate_prompt_tokens", "suffix")
# The client's fields the prefill request keeps: the ones that name what is cached.
PREFILL_FIELDS = ("model", "cache_salt")


class BadRequest(ValueError):
    """A client error: answered 400 with this message."""


@dataclass
class PdRecord:
    """One proxied completion request."""

    request_id: str
    prompt_tokens: int  # len(T)
    text_prompt: bool  # the client sent text (tokenized by the prefill instance)
    stream: bool
    cache_salt: str | None = None
    prefill_status: int | None = None  # None: not sent (a one-token prompt, or tokenizing failed)
    prefill_prompt_tokens: int | None = None  # the prefill instance's usage: len(T) - 1
    prefill_sent_params: dict[str, Any] | None = None  # kv_transfer_params sent to the prefill
    prefill_returned_params: dict[str, Any] | None = None  # what its response carried
    decode_sent_params: dict[str, Any] | None = None  # kv_transfer_params sent to the decode
    decode_status: int | None = None
    tokenize_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float | None = None  # receipt to the decode's first chunk carrying choices
    decode_ttft_ms: float | None = None  # the decode request sent to that chunk (the decode side's TTFT)
    total_ms: float = 0.0
    error: str | None = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_body(body: Any, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
               max_prompt_chars: int = MAX_PROMPT_CHARS) -> list[int] | str:
    """The request's prompt (token ids, or the text to tokenize) after the checks the proxy
    makes before it sends anything; raises :class:`BadRequest`. What vLLM itself checks
    (a token id outside the vocabulary, sampling parameters) its own 400 answers."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for name in REFUSED_FIELDS:
        if name in body:
            raise BadRequest(f"'{name}' is not accepted by the PD proxy")
    for name in ("model", "cache_salt"):
        v = body.get(name)
        if v is not None and (not isinstance(v, str) or len(v) > MAX_SHORT_STR):
            raise BadRequest(f"'{name}' must be a string of at most {MAX_SHORT_STR} characters")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    if "max_tokens" in body and body["max_tokens"] is not None and (
            not _is_int(body["max_tokens"]) or body["max_tokens"] < 1):
        raise BadRequest("'max_tokens' must be a positive integer")
    for name in ("n", "best_of"):
        if name in body and body[name] is not None and (not _is_int(body[name]) or not 1 <= body[name] <= 64):
            raise BadRequest(f"'{name}' must be an integer from 1 to 64")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty")
        if len(prompt) > max_prompt_chars:
            raise BadRequest(f"'prompt' is over {max_prompt_chars} characters")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("'prompt' is empty")
        if len(prompt) > max_prompt_tokens:
            raise BadRequest(f"'prompt' is over {max_prompt_tokens} tokens")
        if not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise BadRequest("'prompt' must be one string or one list of token ids (integers >= 0); "
                             "batched prompts are not accepted")
        return list(prompt)
    raise BadRequest("'prompt' must be one string or one list of token ids")


def prefill_body(body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The request the prefill instance gets: ``T[:-1]``, one token, not streamed, and
    ``do_remote_decode``; of the client's fields only those naming what is cached."""
    out = {k: body[k] for k in PREFILL_FIELDS if body.get(k) is not None}
    out.update(prompt=ids[:-1], max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def decode_params(returned: Any, decode_usage: bool = False) -> dict[str, Any]:
    """The ``kv_transfer_params`` for the decode instance: what the prefill returned (a
    JSON object), else ``{"do_remote_prefill": true}``. ``decode_usage`` drops vLLM's
    ``remote_prefill_cached_tokens`` (see the module's docstring)."""
    params = dict(returned) if isinstance(returned, dict) and returned else {"do_remote_prefill": True}
    if decode_usage:
        params.pop("remote_prefill_cached_tokens", None)
    return params


class PdProxy:
    """The proxy on its own event-loop thread: :meth:`start` returns once it listens."""

    def __init__(self, prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 0, *,
                 decode_usage: bool = False, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
                 max_body_bytes: int = MAX_BODY_BYTES, max_inflight: int = MAX_INFLIGHT,
                 prefill_timeout_s: float = 600.0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.host = host
        self.port = port
        self.decode_usage = decode_usage
        self.max_prompt_tokens = max_prompt_tokens
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.prefill_timeout_s = prefill_timeout_s
        self._records: collections.deque[PdRecord] = collections.deque(maxlen=MAX_RECORDS)
        self._inflight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> PdProxy:
        self._thread = threading.Thread(target=self._run, name="pd-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None or not self.port:
            raise RuntimeError(f"pd proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            try:
                self._loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:  # the loop has already ended
                pass
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> PdProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def records(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in list(self._records)]

    def serve_forever(self) -> None:
        """Run in the calling thread until SIGINT/SIGTERM (the command line)."""
        self.start()
        print(f"pd proxy on {self.url}: prefill {self.prefill_url}, decode {self.decode_url}", flush=True)
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(1.0):
            if self._thread is None or not self._thread.is_alive():
                break
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()
            await self._stopped.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    # -- handlers -----------------------------------------------------------------------
    @staticmethod
    def _error_response(status: int, message: str) -> Any:
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": "BadRequestError" if status == 400
                                            else "ProxyError", "code": status}}, status=status)

    async def _health(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        async def ok(url: str) -> bool:
            try:
                async with self._session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        prefill, decode = await asyncio.gather(ok(self.prefill_url), ok(self.decode_url))
        return web.json_response({"prefill": prefill, "decode": decode}, status=200 if prefill and decode else 503)

    def _headers(self, request: Any, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        t0 = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error_response(400, f"the body is over {self.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the parser's depth
            return self._error_response(400, "the body is not JSON")
        try:
            prompt = check_body(body, self.max_prompt_tokens)
        except BadRequest as e:
            return self._error_response(400, str(e))
        if self._inflight >= self.max_inflight:
            return self._error_response(503, f"over {self.max_inflight} requests in flight")
        self._inflight += 1
        request_id = f"pd-{uuid.uuid4().hex}"
        record = PdRecord(request_id, 0, isinstance(prompt, str), bool(body.get("stream")), body.get("cache_salt"))
        self._records.append(record)
        try:
            return await self._pd(request, body, prompt, record, t0)
        finally:
            self._inflight -= 1
            record.total_ms = (time.perf_counter() - t0) * 1e3

    async def _pd(self, request: Any, body: dict[str, Any], prompt: list[int] | str, record: PdRecord,
                  t0: float) -> Any:
        import aiohttp
        from aiohttp import web

        headers = self._headers(request, record.request_id)
        if isinstance(prompt, str):
            t = time.perf_counter()
            ids, failure = await self._tokenize(body, prompt, headers)
            record.tokenize_ms = (time.perf_counter() - t) * 1e3
            if failure is not None:
                record.error = "tokenize"
                return failure
            if len(ids) > self.max_prompt_tokens:
                return self._error_response(400, f"'prompt' is over {self.max_prompt_tokens} tokens")
        else:
            ids = prompt
        record.prompt_tokens = len(ids)
        decode = {**body, "prompt": ids}
        if len(ids) > 1:
            pbody = prefill_body(body, ids)
            record.prefill_sent_params = pbody["kv_transfer_params"]
            t = time.perf_counter()
            try:
                async with self._session.post(self.prefill_url + "/v1/completions", json=pbody, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=self.prefill_timeout_s)) as r:
                    record.prefill_status = r.status
                    payload = await r.read()
                    if r.status != 200:  # the prefill's own error (e.g. a token id outside the vocabulary)
                        record.error = "prefill"
                        return web.Response(status=r.status, body=payload,
                                            content_type=r.content_type or "application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                record.error = f"prefill: {e!r}"
                return self._error_response(502, f"the prefill instance did not answer: {e!r}")
            finally:
                record.prefill_ms = (time.perf_counter() - t) * 1e3
            try:
                answer = json.loads(payload)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                record.error = "prefill answer"
                return self._error_response(502, "the prefill instance's answer is not a JSON object")
            usage = answer.get("usage")
            if isinstance(usage, dict) and _is_int(usage.get("prompt_tokens")):
                record.prefill_prompt_tokens = usage["prompt_tokens"]
            returned = answer.get("kv_transfer_params")
            record.prefill_returned_params = returned if isinstance(returned, dict) else None
            decode["kv_transfer_params"] = record.decode_sent_params = decode_params(returned, self.decode_usage)
        return await self._forward_decode(request, decode, headers, record, t0)

    async def _tokenize(self, body: dict[str, Any], text: str, headers: dict[str, str]) -> tuple[list[int], Any]:
        """Token ids of ``text`` from the prefill instance (as its /v1/completions would
        tokenize it: special tokens added unless the request says otherwise)."""
        import aiohttp
        from aiohttp import web

        req: dict[str, Any] = {"prompt": text, "add_special_tokens": body.get("add_special_tokens", True) is not False}
        if body.get("model") is not None:
            req["model"] = body["model"]
        try:
            async with self._session.post(self.prefill_url + "/tokenize", json=req, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=60)) as r:
                payload = await r.read()
                if r.status != 200:
                    return [], web.Response(status=r.status, body=payload,
                                            content_type=r.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return [], self._error_response(502, f"the prefill instance did not tokenize: {e!r}")
        try:
            tokens = json.loads(payload).get("tokens")
        except (ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list) or not tokens or not all(_is_int(t) and t >= 0 for t in tokens):
            return [], self._error_response(502, "the prefill instance's /tokenize answer has no token ids")
        return tokens, None

    async def _forward_decode(self, request: Any, decode: dict[str, Any], headers: dict[str, str],
                              record: PdRecord, t0: float) -> Any:
        import aiohttp
        from aiohttp import web

        resp: web.StreamResponse | None = None
        t_dec = time.perf_counter()

        def first_chunk() -> None:
            now = time.perf_counter()
            record.ttft_ms, record.decode_ttft_ms = (now - t0) * 1e3, (now - t_dec) * 1e3

        try:
            async with self._session.post(self.decode_url + "/v1/completions", json=decode, headers=headers) as up:
                record.decode_status = up.status
                if not record.stream or up.status != 200:
                    payload = await up.read()
                    first_chunk()
                    return web.Response(status=up.status, body=payload,
                                        content_type=up.content_type or "application/json")
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
                await resp.prepare(request)
                async for line in up.content:
                    if record.ttft_ms is None and line.startswith(b"data:") and b'"choices":[{' in line.replace(b" ", b""):
                        first_chunk()
                    await resp.write(line)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            record.error = f"decode: {e!r}"
            if resp is None:
                return self._error_response(502, f"the decode instance did not answer: {e!r}")
            return resp  # the stream had begun: it ends where the decode instance's did
        except ConnectionResetError:  # the client went away; leaving the block aborts the decode request
            record.error = "client disconnected"
            return resp if resp is not None else web.Response(status=499)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True, help="the prefill vllm serve (kv_producer), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="the decode vllm serve (kv_consumer), e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS)
    p.add_argument("--decode-usage", action="store_true",
                   help="drop vLLM's remote_prefill_cached_tokens, so the decode usage reports its own cached tokens")
    a = p.parse_args(argv)
    PdProxy(a.prefill, a.decode, a.host, a.port, decode_usage=a.decode_usage,
            max_prompt_tokens=a.max_prompt_tokens).serve_forever()


if __name__ == "__main__":
    main()
