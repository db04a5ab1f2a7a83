"""The scheduler side's conversation with glm-cache-server: handshake and chunk-size
negotiation, back-off after failures, lookups and probes on a background thread, lease
releases on another. A handshake that succeeds is handed to the scheduler as a
:class:`Session` (namespace, chunk size, grid): the scheduler never writes into the link.

Nothing here makes the scheduler thread wait on the network after start-up: a question
whose answer has not come yet is answered "not yet" (``None``), and the hooks ask again
next step."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

from cache_server.client import CacheClient
from cache_server.client.errors import CLIENT_ERRORS, unauthorized
from connector.config import Settings, logger
from connector.geometry import Geometry, GeometryError


@dataclass(frozen=True)
class Session:
    """A handshake that succeeded: the namespace it was made under, the server's reply,
    and the engine's geometry on the chunk grid the server negotiated. Lookups, loads and
    saves are planned under one session; a new one (after a failure, a restart, a change of
    weights) may come with another chunk size."""

    namespace: str
    geometry: Geometry
    hello: dict[str, Any]

    @property
    def chunk_size(self) -> int:
        return self.geometry.chunk_size


@dataclass
class LookupAnswer:
    """What the lookup thread brings back (``error`` set: the server failed, serve cold)."""

    chunks: int = 0
    lease_id: int | None = None
    held: int | None = None  # attention chunks from 0 on the server; None: not reported
    start_state: bool = False
    error: BaseException | None = None
    # the request's chunk keys, when the lookup thread computed them (after a probe hit)
    hashes: list[bytes] | None = None

    def held_chunks(self, start: int) -> int:
        """Attention chunks from 0 known to be on the server: the reported depth, or, from
        a server that does not report it, the hit itself when it started at chunk 0."""
        if self.held is not None:
            return self.held
        return self.chunks if start == 0 else 0


class ServerLink:
    """The connection state: one client per thread that talks to the server, back-off.

    ``disabled`` (the auth token file was unusable, or the layout is not served) keeps it
    unusable for good: we never talk to the server without the token we were told to use."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        retry_after_s: float,
        auth_token: str | None = None,
        disabled: bool = False,
    ) -> None:
        # One client (socket and lock) per thread, so a slow lookup never holds a lock the
        # scheduler thread or a release waits on: ``client`` for the start-up handshake and
        # clear (scheduler thread), ``lookup_client`` for the lookup thread,
        # ``release_client`` for the releaser. They move no payload (the workers do): no
        # shared-memory segment (``shm=False``), which their hello would offer otherwise.
        self.client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token, shm=False)
        self.lookup_client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token, shm=False)
        self.release_client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token, shm=False)
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.disabled = disabled
        self._down_until = 0.0
        self.refusal_logged = False
        self.session: Session | None = None  # the last handshake's, while the server is not known to have failed

    def usable(self) -> bool:
        return not self.disabled and time.monotonic() >= self._down_until

    def close(self) -> None:
        for c in (self.client, self.lookup_client, self.release_client):
            c.close()

    def failed(self, what: str, err: BaseException) -> None:
        if unauthorized(err):
            # Like a dead server (no hits, no saves), but it will not heal by itself:
            # say so once, loudly; retries keep going in case the server is fixed.
            log = logger.debug if self.refusal_logged else logger.error
            log(
                "glm-cache-server refused our token on %s (%s): serving without the external "
                "cache; auth_token_file must hold the server's --auth-token-file token",
                what, err,
            )
            self.refusal_logged = True
        else:
            logger.warning(
                "glm-cache-server %s failed (%s); serving cold, retrying in %.0fs",
                what, err, self.retry_after_s,
            )
        self._down_until = time.monotonic() + self.retry_after_s
        # A restarted server has forgotten our namespace: handshake again next time.
        self.session = None


class RemoteCache:
    """The server, as the scheduler hooks ask it, for the engine of ``geometry`` (its chunk
    size is the server's to choose) under ``namespace`` (None: the engine cannot be named,
    and nothing is asked). ``chunk_keys`` says how the engine names chunks, told at hello
    so the server can name chunks for routers' queries (cache_server.prefix_query)."""

    def __init__(self, settings: Settings, disabled: bool, world_size: int,
                 geometry: Geometry, namespace: str | None, chunk_keys: dict[str, Any] | None = None) -> None:
        self.link = ServerLink(settings.url, settings.timeout_s, settings.retry_after_s,
                               settings.auth_token, disabled)
        self._world_size = world_size
        self._geometry = geometry
        self._namespace = namespace
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-release")
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-lookup")
        self._handshake: tuple[Future[dict[str, Any]], float] | None = None  # (future, deadline)
        self._releases_failed = 0  # lease releases not made (the releaser thread alone counts)
        self.chunk_keys = chunk_keys

    @property
    def session(self) -> Session | None:
        """The current session (None: no handshake succeeded since the last failure)."""
        return self.link.session

    def connect(self) -> Session | None:
        """The start-up handshake, synchronous and bounded by the client timeout: a dead
        server costs start-up ``timeout_s`` once, then the back-off applies."""
        if self.link.usable():
            try:
                return self._open(self._hello_io(self.link.client))
            except (*CLIENT_ERRORS, GeometryError, KeyError) as e:
                self.link.failed("handshake", e)
        return None

    def _open(self, hello: dict[str, Any]) -> Session:
        """The session of a handshake's reply; GeometryError or KeyError refuse it (a
        chunk size that is not an integer, that the engine's blocks do not divide, or none).
        The reply is a peer's: ``int()`` of it could raise anything (``inf``, a string)."""
        assert self._namespace is not None
        chunk = hello["chunk_size"]
        if type(chunk) is not int:
            raise GeometryError(f"the server's chunk size {chunk!r:.40} is not an integer")
        session = Session(self._namespace, self._geometry.with_chunk_size(chunk), hello)
        self.link.session = session
        self.link.refusal_logged = False  # accepted: a later refusal is news again
        return session

    def rename(self, namespace: str | None) -> None:
        """The engine's namespace changed (its weights did): the session and a handshake
        under way name the old one; the next handshake is under ``namespace`` (None: the
        weights cannot be named, and the server is not asked again)."""
        self._namespace = namespace
        self.link.session = None
        self._handshake = None
        if namespace is None:
            self.link.disabled = True

    def usable(self) -> bool:
        return self.link.usable()

    def replicated_groups(self) -> list[int]:
        """Groups stored once for the whole TP group (``CacheGroup.replicated_across_tp``)."""
        return [g.group_id for g in self._geometry.groups if g.replicated_across_tp]

    def _hello_io(self, client: CacheClient) -> dict[str, Any]:
        """The handshake's network part (no state changes: safe on the lookup thread)."""
        geo = self._geometry
        return client.hello(self._namespace, geo.scheduler_block_size, self._world_size,
                            self.replicated_groups(),
                            attn_groups=[g.group_id for g in geo.attn_groups],
                            state_groups=[g.group_id for g in geo.state_groups],
                            group_names={g.group_id: g.name for g in geo.groups if g.name},
                            chunk_keys=self.chunk_keys)

    def ready(self) -> Session | Literal[False] | None:
        """The session when negotiated; None while a background handshake is under way;
        False while the server is away (serve cold). Starts a handshake when one is needed."""
        if self._handshake is not None:
            future, deadline = self._handshake
            if future.done():
                self._handshake = None
                try:
                    return self._open(future.result())
                except (*CLIENT_ERRORS, GeometryError, KeyError) as e:
                    self.link.failed("handshake", e)
                    return False
            elif time.monotonic() < deadline:
                return None
            else:
                return False  # its own timeout will end it; requests go on cold meanwhile
        session = self.link.session
        if session is not None:
            return session
        if not self.link.usable():
            return False
        self._handshake = (self._lookup_pool.submit(self._hello_io, self.link.lookup_client),
                           time.monotonic() + self.answer_wait_s())
        return None

    def answer_wait_s(self) -> float:
        """How long a request may wait for the lookup thread: the lookup's own deadline
        (``timeout_s`` from when it was asked, queueing on the thread included; then it
        gives up and the back-off starts) plus a little scheduling slack."""
        return self.link.timeout_s * 1.25 + 0.05

    def _deadline(self) -> float:
        return time.monotonic() + self.link.timeout_s

    def lookup(self, namespace: str, hashes: list[bytes], start: int, lease: bool,
               cache_salt: str | None = None) -> Future[LookupAnswer]:
        """Look ``hashes`` up from chunk ``start`` on the lookup thread (``cache_salt``, already
        in the hashes, labels the server's lookup counters), within ``timeout_s`` from now."""
        return self._lookup_pool.submit(self._lookup_io, namespace, hashes, start, lease, cache_salt,
                                        self._deadline())

    def probe(self, namespace: str, first: list[bytes], rest: Callable[[list[bytes]], list[bytes]],
              cache_salt: str | None) -> Future[LookupAnswer]:
        """Probe a prefix nobody here has hashed yet by its first chunk, on the lookup
        thread (see :meth:`_probe_io`), within ``timeout_s`` from now."""
        return self._lookup_pool.submit(self._probe_io, namespace, first, rest, cache_salt, self._deadline())

    def _lookup_io(self, namespace: str, hashes: list[bytes], start: int, lease: bool,
                   cache_salt: str | None = None, deadline: float | None = None) -> LookupAnswer:
        """One lookup RPC, done by ``deadline`` (monotonic; None: ``timeout_s`` from now).
        Skipped while the link backs off, and when the deadline passed while it waited for
        the thread (behind a lookup the server did not answer: that one put the link in
        back-off). Leases that came late, in replies to lookups that had given up, are
        released."""
        if not self.link.usable():
            return LookupAnswer(error=ConnectionError("server in back-off"))
        left = (deadline - time.monotonic()) if deadline is not None else self.link.timeout_s
        if left <= 0:
            return LookupAnswer(error=TimeoutError("the lookup's deadline passed before it was sent"))
        geo = self._geometry
        client = self.link.lookup_client
        try:
            n, lease_id, held, start_state = client.lookup_held(
                namespace, hashes,
                [g.group_id for g in geo.attn_groups],
                [g.group_id for g in geo.state_groups],
                self._world_size, start, lease=lease,
                replicated_groups=self.replicated_groups(), cache_salt=cache_salt, timeout_s=left,
            )
        except CLIENT_ERRORS as e:
            self.link.failed("lookup", e)
            return LookupAnswer(error=e)
        finally:
            for late in client.take_late_leases():
                self.release(late)
        return LookupAnswer(n, lease_id, held, start_state)

    def counters(self) -> dict[str, int]:
        """The lookups' outcomes on this engine's lookup connection (``lookups_sent``,
        ``lookups_in_time``, ``lookups_late``, ``lookups_unanswered``: see
        :data:`cache_server.client.OUTCOMES`) and ``lease_releases_failed``, as running totals."""
        counts = self.link.lookup_client.counts("lookup")
        out = {f"lookups_{k}": v for k, v in counts.items()}
        out["lease_releases_failed"] = self._releases_failed
        return out

    def _probe_io(self, namespace: str, first: list[bytes], rest: Callable[[list[bytes]], list[bytes]],
                  cache_salt: str | None, deadline: float | None = None) -> LookupAnswer:
        """Is the first chunk's attention on the server (no lease)? No: nothing deeper can
        resume either, and the other chunks are never hashed for it (a cold request hashes
        its chunks as they are saved). Yes, or a server that does not say: hash the prefix
        here (``rest`` extends the chain from ``first``: :meth:`connector.keys.ChunkKeys.chain`)
        and look it up as usual; the keys travel back with the answer."""
        probe = self._lookup_io(namespace, first, 0, False, cache_salt, deadline)
        if probe.error is not None:
            return probe
        if probe.held == 0:
            return LookupAnswer(0, None, 0, False)
        hashes = rest(list(first))
        return replace(self._lookup_io(namespace, hashes, 0, True, cache_salt, deadline), hashes=hashes)

    def release_when_answered(self, future: Future[LookupAnswer]) -> None:
        """A lookup no longer wanted: release the lease it got (or will get)."""
        future.add_done_callback(self._release_unused)

    def _release_unused(self, future: Future[LookupAnswer]) -> None:
        if future.cancelled():
            return
        lease_id = future.result().lease_id
        if lease_id is not None:
            self.release(lease_id)

    def release(self, lease_id: int) -> None:
        """Release a lease from the releaser thread (the scheduler thread never waits for it),
        through the lookup thread's client: the server lets only the connection that took a
        lease release it. Safe from any thread."""

        def release() -> None:
            if not self.link.usable():
                self._releases_failed += 1  # it expires at the server's lease TTL; don't queue
                return  # timeouts behind a dead server
            try:
                self.link.lookup_client.release(lease_id)  # the connection the lease is of
            except CLIENT_ERRORS as e:
                self._releases_failed += 1
                logger.warning("GlmCacheConnector: release of lease %s failed (%s); it stays held on the server "
                               "until its TTL", lease_id, e)

        try:
            self._releaser.submit(release)
        except RuntimeError:  # shut down
            pass

    def clear(self, namespace: str) -> bool:
        if self.link.session is None:
            return False
        try:
            self.link.client.clear(namespace)
            return True
        except CLIENT_ERRORS as e:
            self.link.failed("clear", e)
            return False

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._releaser.shutdown(wait=False)
        self.link.close()
