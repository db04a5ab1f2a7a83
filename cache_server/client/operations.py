"""Client of glm-cache-server, with timeouts: a dead or absent server raises within the
timeout, never hangs the caller.

On the server's host, payloads move through shared memory (:mod:`cache_server.shm`):
offered at ``hello``, used by ``get`` and ``put`` once the server agrees, frames over the
socket otherwise (another host, no /dev/shm, ``--no-shm``, or ``shm=False`` here).

:class:`CacheClient` is the operations (``hello``, ``lookup``, ``query``, ``put``, ``get``,
``get_in_place``, ...) on a :class:`~cache_server.client.connection.Connection`, which sends
each request within the call's deadline; a get's reply is checked by
:mod:`cache_server.client.verify` before the caller sees it."""

from __future__ import annotations

import array
import hashlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from cache_server import protocol as p
from cache_server.arena import DEFAULT_PIN_S, MAX_UNPIN, pack_pins
from cache_server.client.connection import Connection, Payload
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.client.segments import get_region, write_payloads
from cache_server.client.verify import BY_COPY, IN_ARENA, IN_ARENA_CHECKED, PIN_MARGIN_S, InPlace, arena_checked, arena_spans, verify
from cache_server.shm import ClientSegment, align_up

_U32 = next(t for t in ("I", "L") if array.array(t).itemsize == 4)

logger = logging.getLogger("vllm.glm_cache_client")


def label_salt(salt: str) -> str:
    """A request's cache salt as sent for the lookup counters' label: itself when it is
    short and plain UTF-8, else its SHA-256 in hex (a client's salt never makes the
    lookup itself fail; distinct salts keep distinct labels)."""
    if isinstance(salt, str) and len(salt) <= p.MAX_NAMESPACE_CHARS:
        try:
            salt.encode("utf-8")
            return salt
        except UnicodeEncodeError:
            pass
    return "sha256:" + hashlib.sha256(str(salt).encode("utf-8", "surrogatepass")).hexdigest()


class CacheClient(Connection):
    """One DEALER connection to a glm-cache-server; thread-safe (requests are serialised).

    After a timeout the socket is closed and reopened, so a late reply can never be taken
    for the answer to a later request, and nothing queued for a dead server piles up.

    ``auth_token`` is the server's shared secret (``--auth-token-file``), presented at
    connection (ZMQ's PLAIN mechanism, which such a server requires) and sent with every
    request (the server checks both). A server that refuses it at connection, or that
    wants a token from a client without one, makes the call raise
    :class:`CacheServerError` ``unauthorized`` at once. A server without a token speaks
    only ZMQ's NULL mechanism: a client with a token then connects without PLAIN (the
    token still travels in each header, which such a server ignores).

    ``shm`` (default on) offers the server shared memory at :meth:`hello` (or at the first
    ``get`` or ``put`` of a client that never says hello): segments of at
    least ``shm_bytes``, together at most ``shm_max_bytes``: sealed memfds, which the
    server maps (no one can shrink them under it). :attr:`transport` says what was agreed
    (``"shm"`` or ``"tcp"``), :attr:`shm_refusal` why not. A payload ``get`` returns from
    shared memory is a view of a segment that no later request writes into while any view
    of that get is alive (the client uses another segment, or frames); checksums are
    verified exactly as over TCP. The segments are :mod:`cache_server.client.segments`'s. A
    client that moves no payload (lookups only) should say ``shm=False``: its hello would
    offer a segment it never uses.
    """

    def hello(self, namespace: str, alignment: int, world_size: int = 1,
              replicated_groups: Sequence[int] = (), attn_groups: Sequence[int] | None = None,
              state_groups: Sequence[int] | None = None,
              group_names: dict[int, str] | None = None,
              chunk_keys: dict[str, Any] | None = None) -> dict[str, Any]:
        """Handshake: returns chunk_size, min_chunk_size, separate_object_groups, max_object_bytes, v.
        With ``attn_groups`` and ``state_groups`` the server tracks which prefixes are
        resumable and evicts objects nothing can resume through first; ``group_names``
        says what each holds (``/status`` and metrics report bytes by name); ``chunk_keys``
        how the engine names chunks ({``scheme``, ``span``, ``lookahead``}), for routers'
        queries (:mod:`cache_server.prefix_query`)."""
        header: dict[str, Any] = {"op": "hello", "v": p.PROTOCOL_VERSION, "ns": namespace, "alignment": alignment,
                                  "world_size": world_size, "replicated_groups": list(replicated_groups)}
        if state_groups is not None:
            header["attn_groups"] = list(attn_groups or ())
            header["state_groups"] = list(state_groups)
            if group_names:
                header["group_names"] = {str(g): n for g, n in group_names.items()}
        if chunk_keys is not None:
            header["chunk_keys"] = dict(chunk_keys)
        with self._lock, self._within(None):
            self._shm.flush(self._send_header_locked, None)
            offer = self._shm.offer_at_hello()
            if offer is not None:
                header["shm"] = self._shm.describe(offer)
            try:
                reply, _ = self._request_locked(header, (), None)
            except CacheServerError:  # answered: nothing was attached
                if offer is not None:
                    offer.close()
                raise
            except BaseException:  # no answer in time: the server may have attached it
                if offer is not None:
                    self._shm.abandon(offer)
                raise
            if offer is not None:
                self._shm.settle(offer, reply.get("shm"))
        return {k: reply[k] for k in ("v", "chunk_size", "min_chunk_size", "separate_object_groups",
                                      "max_object_bytes")}

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
               lease: bool = True, replicated_groups: Sequence[int] = (),
               cache_salt: str | None = None, timeout_s: float | None = None) -> tuple[int, int | None]:
        """Deepest resumable chunk count of the prefix ``hashes`` and the lease on it;
        ``replicated_groups`` need their rank-0 copy only. ``cache_salt`` (the request's,
        already in the hashes) only labels the lookup counters (as a keyed hash)."""
        reply = self._lookup(namespace, hashes, attn_groups, state_groups, world_size, start_chunk,
                             lease, replicated_groups, held=False, cache_salt=cache_salt, timeout_s=timeout_s)
        return reply["chunks"], reply["lease_id"]

    def lookup_held(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                    state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
                    lease: bool = True, replicated_groups: Sequence[int] = (),
                    cache_salt: str | None = None,
                    timeout_s: float | None = None) -> tuple[int, int | None, int | None, bool]:
        """:meth:`lookup`, plus what need not be sent again: how many chunks from chunk 0
        the server holds all attention objects of (every group and rank; None from a
        server that does not report it), and whether it holds every state object at
        chunk ``start_chunk - 1``."""
        reply = self._lookup(namespace, hashes, attn_groups, state_groups, world_size, start_chunk,
                             lease, replicated_groups, held=True, cache_salt=cache_salt, timeout_s=timeout_s)
        held = reply.get("held")
        return (reply["chunks"], reply["lease_id"], held if isinstance(held, int) else None,
                reply.get("start_state") is True)

    def _lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                state_groups: Sequence[int], world_size: int, start_chunk: int, lease: bool,
                replicated_groups: Sequence[int], held: bool, cache_salt: str | None = None,
                timeout_s: float | None = None) -> dict[str, Any]:
        header = {"op": "lookup", "ns": namespace, "hashes": list(hashes), "attn_groups": list(attn_groups),
                  "state_groups": list(state_groups), "world_size": world_size, "start_chunk": start_chunk,
                  "lease": lease, "replicated_groups": list(replicated_groups)}
        if held:
            header["held"] = True
        if cache_salt:
            header["cache_salt"] = label_salt(cache_salt)
        return self.request(header, timeout_s=timeout_s)[0]

    def query(self, model: str, token_ids: Sequence[int] | None = None, *, cache_salt: str | None = None,
              block_hashes: Sequence[bytes] | None = None, instance_id: str | None = None,
              lora_name: str | None = None, tenant_id: str | None = None,
              block_size: int | None = None) -> dict[str, Any]:
        """A router's question (:mod:`cache_server.prefix_query`): the resumable prefix of
        ``token_ids`` (or of vLLM's ``block_hashes``) under ``cache_salt``, in tokens, for
        each namespace of ``model`` on this server: ``{tenant: {namespace:
        {"longest_matched", "CPU", "STORAGE"}}}`` (the Mooncake KV Indexer RFC's answer). Token
        ids travel packed (4 bytes each); nothing is leased."""
        header: dict[str, Any] = {"op": "query", "model": model}
        if token_ids is not None:
            packed = array.array(_U32, token_ids)
            if sys.byteorder == "big":
                packed.byteswap()
            header["token_ids"] = packed.tobytes()
        if block_hashes is not None:
            header["seq_hashes"] = [bytes(h) for h in block_hashes]
        for name, value in (("cache_salt", cache_salt), ("instance_id", instance_id), ("lora_name", lora_name),
                            ("tenant_id", tenant_id), ("block_size", block_size)):
            if value is not None:
                header[name] = value
        return self.request(header)[0]["result"]

    def put(self, namespace: str, items: Sequence[tuple[bytes, int, int, Payload]],
            prev: Sequence[bytes | None] | None = None,
            parent: Sequence[bytes | None] | None = None, *, timeout_s: float | None = None) -> list[str]:
        """Store objects ``(hash, group, rank, payload)``; one :class:`~cache_server.protocol.PutResult`
        value per item. ``prev`` gives, per item, the hash of the previous state stored on the
        same conversation path (state objects only), so the server evicts superseded
        snapshots first. ``parent`` gives, per item, the hash of the chunk before its chunk
        (None: the first chunk; ``b""``: unknown), which places it in the server's chunk
        tree. Payloads must not change until this returns. ``timeout_s`` overrides
        :attr:`timeout_s` for this call."""
        payloads = [_bytes_view(item[3]) for item in items]
        keys = [(h, g, r) for h, g, r, _ in items]
        header: dict[str, Any] = {"op": "put", "ns": namespace, "keys": [list(k) for k in keys],
                                  "sums": [p.checksum(v, namespace, k) for k, v in zip(keys, payloads)]}
        if prev is not None:
            header["prev"] = list(prev)
        if parent is not None:
            header["parent"] = list(parent)
        with self._lock, self._within(timeout_s):
            for _attempt in range(2):
                seg = (self._shm.segment(sum(align_up(v.nbytes) for v in payloads), self._send_header_locked,
                                         timeout_s) if payloads else None)
                if seg is None:
                    reply, _ = self._request_locked(header, payloads, timeout_s)
                    return reply["results"]
                seg.busy = True
                try:
                    reply, _ = self._request_locked({**header, "shm": write_payloads(seg, payloads)}, (), timeout_s)
                    return reply["results"]
                except CacheServerError as e:
                    if not self._shm.retry(e):
                        raise
                finally:
                    seg.busy = False
            reply, _ = self._request_locked(header, payloads, timeout_s)  # a second unknown segment: frames
            return reply["results"]

    def get(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], *,
            timeout_s: float | None = None) -> list[memoryview | None]:
        """Payloads of ``(hash, group, rank)`` keys, None where absent.

        Every payload is checked against the checksum its writer stored with it, which
        covers the key it was stored for (:func:`~cache_server.protocol.checksum`); one that
        does not match (flipped bits, or another key's object) is deleted on the server (``delete`` with reason ``checksum``, counted
        there) and answered as absent, so no corrupt byte ever reaches the caller.
        ``timeout_s`` overrides :attr:`timeout_s` for this call."""
        header = {"op": "get", "ns": namespace, "keys": [list(k) for k in keys]}
        with self._lock, self._within(timeout_s):
            reply, frames, _ = self._get_locked(header, bool(keys), timeout_s)
        return self._verified(namespace, keys, reply, frames, [BY_COPY] * len(frames)).payloads

    def get_in_place(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], *,
                     timeout_s: float | None = None, pin_s: float = DEFAULT_PIN_S) -> InPlace:
        """:meth:`get`, except that objects the server holds in its arena
        (:mod:`cache_server.arena`) come as read-only views of it: those the server verified
        when it placed them are ready to copy; for each other one :attr:`InPlace.unverified`
        gives the key prefix and stored checksum the caller verifies while it copies the bytes, before :attr:`InPlace.deadline` (the
        server may reuse the range after its pin; a copy that ends later must be taken as
        failed), then reports failures with :meth:`delete_corrupt` and hands the pin back
        with :meth:`release_pin`. Without an arena (another host, an old server) this is
        :meth:`get`, every payload verified."""
        header: dict[str, Any] = {"op": "get", "ns": namespace, "keys": [list(k) for k in keys],
                                  "arena": True, "pin_s": pin_s}
        with self._lock, self._within(timeout_s):
            reply, frames, in_arena = self._get_locked(header, bool(keys), timeout_s)
        return self._verified(namespace, keys, reply, frames, in_arena)

    def register_arena_cuda(self) -> str | None:
        """Page-lock the mapped arena for CUDA (:meth:`~cache_server.arena.ClientArena.register_cuda`);
        None when done, else why not (no arena mapped: nothing to do)."""
        arena = self._shm.arena
        return "no arena mapped" if arena is None else arena.register_cuda()

    def _get_locked(self, header: dict[str, Any], any_keys: bool, timeout_s: float | None
                    ) -> tuple[dict[str, Any], list[memoryview], list[int]]:
        """Send a get, through a segment where one is agreed; the reply, the found objects'
        payloads in order, and where each is (:data:`BY_COPY`, :data:`IN_ARENA`,
        :data:`IN_ARENA_CHECKED`)."""
        plain = {k: v for k, v in header.items() if k not in ("arena", "pin_s")}
        for _attempt in range(2):
            seg = self._shm.segment(0, self._send_header_locked, timeout_s) if any_keys else None
            if seg is None:
                break
            arena = self._shm.arena if header.get("arena") else None
            h = {**(header if arena is not None else plain), "shm": get_region(seg)}
            if arena is not None and self._unpins:
                h["unpin"], self._unpins = pack_pins(self._unpins[:MAX_UNPIN]), self._unpins[MAX_UNPIN:]
            seg.busy = True
            try:
                sent = time.monotonic()
                reply, frames = self._request_locked(h, (), timeout_s)
            except CacheServerError as e:
                seg.busy = False
                if not self._shm.retry(e):
                    raise
                continue
            except BaseException:
                seg.busy = False
                raise
            try:
                spans = arena_spans(reply, arena, self._shm.arena_nonce) if arena is not None else None
                if spans is None:
                    placed = self._place_shm_locked(seg, reply, frames)
                    return reply, placed, [BY_COPY] * len(placed)
                copied = self._place_shm_locked(seg, {"shm": reply.get("shm"), "found": [x is None for x in spans]},
                                                frames)
            except BaseException:
                seg.busy = False
                raise
            pin, granted = reply.get("pin"), reply.get("pin_s")
            if isinstance(pin, int) and not isinstance(pin, bool) and pin > 0:
                reply["deadline"] = sent + float(granted) - max(PIN_MARGIN_S, 0.1 * float(granted))
            it = iter(copied)
            checked = arena_checked(reply, spans)
            return reply, [arena.view(*x) if x is not None else next(it) for x in spans], \
                [BY_COPY if x is None else IN_ARENA_CHECKED if c else IN_ARENA for x, c in zip(spans, checked)]
        reply, frames = self._request_locked(plain, (), timeout_s)  # no segment, or a second unknown one
        return reply, frames, [BY_COPY] * len(frames)

    def _place_shm_locked(self, seg: ClientSegment, reply: dict[str, Any],
                          frames: list[memoryview]) -> list[memoryview]:
        """The payloads of a get answered through ``seg`` (:meth:`ClientShm.place`); a method
        of the client so that a test can corrupt the segment between placement and checksum."""
        return self._shm.place(seg, reply, frames)

    def _verified(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], reply: dict[str, Any],
                  frames: list[memoryview], in_arena: list[int]) -> InPlace:
        """The get's payloads, checked (:func:`~cache_server.client.verify.verify`); those
        that failed their checksum are deleted (:meth:`delete_corrupt`)."""
        got, corrupt = verify(namespace, keys, reply, frames, in_arena)
        if corrupt:
            self.delete_corrupt(namespace, corrupt)
        return got

    def delete_corrupt(self, namespace: str, keys: Sequence[tuple[bytes, int, int]]) -> None:
        """Count and delete objects whose bytes failed their checksum (``reason``
        ``checksum``); a failed delete is logged, never raised."""
        self.corrupt_objects += len(keys)
        logger.warning("glm-cache-server at %s: %d object(s) failed their checksum; deleting them",
                       self.url, len(keys))
        try:
            self.delete(namespace, keys, reason="checksum")
        except (CacheServerError, CacheServerUnavailable) as e:
            logger.warning("delete of corrupt objects failed: %s", e)

    def release_pin(self, pin: int | None) -> None:
        """Hand back a read pin of :meth:`get_in_place` (sent with the next such get, or by
        :meth:`unpin`); the server drops it at its deadline anyway."""
        if pin:
            with self._lock:
                self._unpins.append(pin)
                del self._unpins[:-4 * MAX_UNPIN]  # a server gone for long: they expire there

    def unpin(self) -> int:
        """Release the pins handed back now (one ``unpin`` request); how many the server
        released (0 when it could not be asked)."""
        with self._lock, self._within(None):
            ids, self._unpins = self._unpins[:MAX_UNPIN], self._unpins[MAX_UNPIN:]
            if not ids:
                return 0
            try:
                return int(self._request_locked({"op": "unpin", "pins": pack_pins(ids)}, (), None)[0].get("unpinned", 0))
            except (CacheServerError, CacheServerUnavailable):
                return 0

    def delete(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], reason: str = "client") -> int:
        """Remove objects now; ``reason`` ``checksum`` reports them as corrupt."""
        reply, _ = self.request({"op": "delete", "ns": namespace, "keys": [list(k) for k in keys],
                                 "reason": reason})
        return reply["removed"]

    def release(self, lease_id: int, timeout_s: float | None = None) -> bool:
        reply, _ = self.request({"op": "release", "lease_id": lease_id}, timeout_s=timeout_s)
        return reply["released"]

    def clear(self, namespace: str | None = None, tier: str = "all", force: bool = True) -> int:
        """Clear ``namespace`` (None: all), from every tier and leased objects too unless
        told otherwise (the op's own defaults are HTTP's: ``l1``, leased objects kept)."""
        reply, _ = self.request({"op": "clear", "ns": namespace, "tier": tier, "force": force})
        return reply["removed"]

    def stats(self) -> dict[str, Any]:
        reply, _ = self.request({"op": "stats"})
        return reply["stats"]

    def ping(self, timeout_s: float | None = None) -> None:
        self.request({"op": "ping"}, timeout_s=timeout_s)


def _bytes_view(payload: Payload) -> memoryview:
    """``payload`` as a flat byte view (a torch or numpy buffer of any element type)."""
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
