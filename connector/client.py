"""Client of glm-cache-server, with timeouts: a dead or absent server raises within the
timeout, never hangs the caller."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from cache_server import protocol as p
from cache_server.auth import AUTH_FIELD

Payload = bytes | bytearray | memoryview

logger = logging.getLogger("vllm.glm_cache_client")


class CacheServerError(RuntimeError):
    """The server answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"glm-cache-server error [{code}]: {message}")
        self.code = code
        self.message = message


class CacheServerUnavailable(ConnectionError):
    """No reply within the timeout: the server is absent, dead or overloaded."""


class CacheClient:
    """One DEALER connection to a glm-cache-server; thread-safe (requests are serialised).

    After a timeout the socket is closed and reopened, so a late reply can never be taken
    for the answer to a later request, and nothing queued for a dead server piles up.

    ``auth_token`` is the server's shared secret (``--auth-token-file``), sent with every
    request: the server checks each request, not the connection.
    """

    def __init__(self, url: str = "tcp://127.0.0.1:5555", timeout_s: float = 5.0,
                 context: zmq.Context | None = None, auth_token: str | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self._auth_token = auth_token
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self.corrupt_objects = 0  # payloads that failed their checksum (deleted on the server)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # don't queue for a peer that is not connected
            sock.connect(self.url)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, header: dict[str, Any], payloads: Sequence[Payload] = ()) -> tuple[dict[str, Any], list[memoryview]]:
        """Send one request and wait for its reply; raises on error replies and timeouts."""
        with self._lock:
            request_id = next(self._ids)
            header = {**header, "id": request_id}
            if self._auth_token is not None:
                header[AUTH_FIELD] = self._auth_token
            sock = self._socket()
            deadline_ms = int(self.timeout_s * 1000)
            try:
                # With IMMEDIATE set, a send finds no peer while the server is down: poll for
                # writability so that case also ends at the timeout.
                if not sock.poll(deadline_ms, zmq.POLLOUT):
                    raise CacheServerUnavailable(f"glm-cache-server at {self.url} is not reachable "
                                                 f"(no connection within {self.timeout_s:.1f}s)")
                sock.send_multipart([p.pack_header(header), *payloads], copy=False, flags=zmq.NOBLOCK)
                while True:
                    if not sock.poll(deadline_ms, zmq.POLLIN):
                        raise CacheServerUnavailable(f"glm-cache-server at {self.url} did not answer "
                                                     f"{header['op']!r} within {self.timeout_s:.1f}s")
                    frames = sock.recv_multipart(copy=False)
                    reply = p.unpack_header(frames[0].buffer)
                    if reply.get("id") == request_id:
                        break  # replies to earlier, timed-out requests are dropped
            except CacheServerUnavailable:
                self._reset()
                raise
            except zmq.ZMQError as e:
                self._reset()
                raise CacheServerUnavailable(f"glm-cache-server at {self.url}: {e}") from e
        if not reply.get("ok"):
            raise CacheServerError(str(reply.get("code")), str(reply.get("message")))
        return reply, [f.buffer for f in frames[1:]]

    # --- operations ----------------------------------------------------------------------

    def hello(self, namespace: str, alignment: int, world_size: int = 1,
              replicated_groups: Sequence[int] = (), attn_groups: Sequence[int] | None = None,
              state_groups: Sequence[int] | None = None) -> dict[str, Any]:
        """Handshake: returns chunk_size, min_chunk_size, separate_object_groups, max_object_bytes, v.
        With ``attn_groups`` and ``state_groups`` the server tracks which prefixes are
        resumable and evicts objects nothing can resume through first."""
        header: dict[str, Any] = {"op": "hello", "v": p.PROTOCOL_VERSION, "ns": namespace, "alignment": alignment,
                                  "world_size": world_size, "replicated_groups": list(replicated_groups)}
        if state_groups is not None:
            header["attn_groups"] = list(attn_groups or ())
            header["state_groups"] = list(state_groups)
        reply, _ = self.request(header)
        return {k: reply[k] for k in ("v", "chunk_size", "min_chunk_size", "separate_object_groups",
                                      "max_object_bytes")}

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
               lease: bool = True, replicated_groups: Sequence[int] = ()) -> tuple[int, int | None]:
        """Deepest resumable chunk count of the prefix ``hashes`` and the lease on it;
        ``replicated_groups`` need their rank-0 copy only."""
        reply, _ = self.request({"op": "lookup", "ns": namespace, "hashes": list(hashes),
                                 "attn_groups": list(attn_groups), "state_groups": list(state_groups),
                                 "world_size": world_size, "start_chunk": start_chunk, "lease": lease,
                                 "replicated_groups": list(replicated_groups)})
        return reply["chunks"], reply["lease_id"]

    def lookup_held(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                    state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
                    lease: bool = True, replicated_groups: Sequence[int] = ()
                    ) -> tuple[int, int | None, int | None, bool]:
        """:meth:`lookup`, plus what need not be sent again: how many chunks from chunk 0
        the server holds all attention objects of (every group and rank; None from a
        server that does not report it), and whether it holds every state object at
        chunk ``start_chunk - 1``."""
        reply, _ = self.request({"op": "lookup", "ns": namespace, "hashes": list(hashes),
                                 "attn_groups": list(attn_groups), "state_groups": list(state_groups),
                                 "world_size": world_size, "start_chunk": start_chunk, "lease": lease,
                                 "replicated_groups": list(replicated_groups), "held": True})
        held = reply.get("held")
        return (reply["chunks"], reply["lease_id"], held if isinstance(held, int) else None,
                reply.get("start_state") is True)

    def put(self, namespace: str, items: Sequence[tuple[bytes, int, int, Payload]],
            prev: Sequence[bytes | None] | None = None,
            parent: Sequence[bytes | None] | None = None) -> list[str]:
        """Store objects ``(hash, group, rank, payload)``; one :class:`~cache_server.protocol.PutResult`
        value per item. ``prev`` gives, per item, the hash of the previous state stored on the
        same conversation path (state objects only), so the server evicts superseded
        snapshots first. ``parent`` gives, per item, the hash of the chunk before its chunk
        (None: the first chunk; ``b""``: unknown), which places it in the server's chunk
        tree. Payloads must not change until this returns."""
        header: dict[str, Any] = {"op": "put", "ns": namespace, "keys": [[h, g, r] for h, g, r, _ in items],
                                  "sums": [p.checksum(item[3]) for item in items]}
        if prev is not None:
            header["prev"] = list(prev)
        if parent is not None:
            header["parent"] = list(parent)
        reply, _ = self.request(header, [item[3] for item in items])
        return reply["results"]

    def get(self, namespace: str, keys: Sequence[tuple[bytes, int, int]]) -> list[memoryview | None]:
        """Payloads of ``(hash, group, rank)`` keys, None where absent.

        Every payload is checked against the checksum its writer stored with it; one that
        does not match is deleted on the server (``delete`` with reason ``checksum``, counted
        there) and answered as absent, so no corrupt byte ever reaches the caller."""
        reply, frames = self.request({"op": "get", "ns": namespace, "keys": [list(k) for k in keys]})
        found, sums = reply["found"], reply.get("sums")
        if len(found) != len(keys) or sum(found) != len(frames) or not isinstance(sums, list) \
                or len(sums) != len(frames):
            raise CacheServerError("bad_reply", f"get answered {len(frames)} payloads for {found}")
        it = iter(zip(frames, sums))
        out: list[memoryview | None] = []
        corrupt: list[tuple[bytes, int, int]] = []
        for key, f in zip(keys, found):
            if not f:
                out.append(None)
                continue
            frame, stored = next(it)
            if stored != p.checksum(frame):
                corrupt.append(tuple(key))
                out.append(None)
            else:
                out.append(frame)
        if corrupt:
            self.corrupt_objects += len(corrupt)
            logger.warning("glm-cache-server at %s: %d object(s) failed their checksum; deleting them",
                           self.url, len(corrupt))
            try:
                self.delete(namespace, corrupt, reason="checksum")
            except (CacheServerError, CacheServerUnavailable) as e:
                logger.warning("delete of corrupt objects failed: %s", e)
        return out

    def delete(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], reason: str = "client") -> int:
        """Remove objects now; ``reason`` ``checksum`` reports them as corrupt."""
        reply, _ = self.request({"op": "delete", "ns": namespace, "keys": [list(k) for k in keys],
                                 "reason": reason})
        return reply["removed"]

    def release(self, lease_id: int) -> bool:
        reply, _ = self.request({"op": "release", "lease_id": lease_id})
        return reply["released"]

    def clear(self, namespace: str | None = None) -> int:
        reply, _ = self.request({"op": "clear", "ns": namespace})
        return reply["removed"]

    def stats(self) -> dict[str, Any]:
        reply, _ = self.request({"op": "stats"})
        return reply["stats"]

    def ping(self) -> None:
        self.request({"op": "ping"})
