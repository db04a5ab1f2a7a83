"""Routers' queries: how many tokens of a prompt this server can resume, per tier.

A KV-aware router that asks instead of subscribing (issue 33, item 2) sends a model, a
salt and the prompt's token ids (or vLLM's block hashes) and is told, for each engine
namespace of that model on this server, the resumable prefix in tokens: in L1 (the
server's memory) and with L2 (the shared Redis/Valkey tier) as well. Served over HTTP
(``POST /query``, ``POST /query_by_hash``, with the token of ``--auth-token-file``) and
over the protocol (op ``query``, :meth:`cache_server.client.CacheClient.query`).

**Whose conventions.** The Mooncake KV Indexer API (RFC kvcache-ai/Mooncake#1403, the
Conductor indexer's ``docs/source/design/conductor/indexer-api-design.md``), which
Dynamo's standalone KV indexer says its HTTP API follows: the same paths, the same request
fields (``model``, ``token_ids`` or ``seq_hashes``, ``cache_salt``, ``lora_name``,
``tenant_id``, ``instance_id``, ``block_size``) and the same answer, keyed by tenant, then
instance, each with ``longest_matched`` and one figure per medium, all in **tokens**
(not blocks: Dynamo's own ``/query`` answers block counts per worker and dp rank; the RFC
answers tokens)::

    {"default": {"<namespace>": {"longest_matched": 256, "CPU": 128, "STORAGE": 256}}}

* **Instance = namespace.** The server does not know the router's replicas; it knows the
  engine namespaces (:func:`connector.namespace.engine_fingerprint`, ``<model>-<16 hex>``) whose
  objects it holds. Every replica attached to this server whose engine has that namespace
  can resume what the entry says, so a router scores each of its replicas with the entry
  of its (server, namespace). ``instance_id`` in a query picks one namespace.
* **Model.** ``model`` is the served model name (its last ``/`` part, as the namespace
  starts with it) or a whole namespace. The namespaces the connector registered at
  ``hello`` are listed with their chunk size and key scheme in ``/status``
  (``namespaces.<ns>.chunk_keys``): an operator reads them there.
* **Media**, named with vLLM's KV-event constants (``vllm.distributed.kv_events``):
  ``CPU`` (``MEDIUM_CPU``) is L1, the server's memory; ``STORAGE`` (``MEDIUM_STORAGE``) is
  L2, the Redis/Valkey tier (absent without ``--l2``, and absent when it could not be asked
  in time: unknown, not 0). ``STORAGE`` counts what L1 and L2 hold *together*, which is what
  a lookup by an engine resumes after the server promotes from L2 (L2 is write-through, so
  it holds what L1 does but for dropped writes); ``longest_matched`` is the larger.
* **Resumable**, by the lookup's own rule (:func:`cache_server.layout.resume_depth`): the
  deepest chunk k such that every attention group (MLA latent, indexer) has its objects,
  on every rank, for chunks 0..k-1, and every state group (KDA) at chunk k-1. A partial
  last chunk never counts, and neither does a chunk whose drafter lookahead tokens are not
  in the query. Namespaces without a declared layout (engines that said no state groups
  at hello) are not answered.
* **Keys.** With ``chunk_keys: lmcache`` the server hashes the token ids itself, with the
  functions the connector uses too (:func:`cache_server.chunk_keys.extend_chunk_hashes`, salted by
  ``cache_salt``; :func:`cache_server.chunk_keys.lookahead_keys` for a drafter's lookahead). With
  ``chunk_keys: vllm`` (the default where usable) keys derive from vLLM's block hashes,
  which need vLLM's hash function, its seed and the request's extra keys: the router sends
  those hashes (``seq_hashes``: 32-byte sha256 digests, hex in JSON), the salt already in
  them. A namespace whose engine did not say its scheme at hello (an older connector) is
  taken as the token chain. A LoRA adapter's requests are never cached (0 everywhere).
* **Bounded and cheap.** At most :data:`~cache_server.protocol.MAX_QUERY_TOKENS` tokens or
  :data:`~cache_server.protocol.MAX_HASHES` hashes, chunks x objects per chunk at most
  :data:`~cache_server.protocol.MAX_QUERY_OBJECTS` over every namespace the query walks
  (checked before any key is hashed); L1's depth is found under the store's lock, what L1
  lacks listed outside it and only for L2; the protocol's ``query`` runs on the server's
  query thread, never on a worker that serves engines; nothing is leased, promoted or touched
  (a router's question must not keep objects alive); L2 is asked with pipelined ``EXISTS``
  of at most :data:`MAX_L2_PROBE_KEYS` keys in at most two round trips, each within the
  tier's timeout (:meth:`PrefixQuery._with_l2`). Measured
  by ``validation/bench_lookup.py`` (docs/benchmarks.md, "Router lookup").
"""

from __future__ import annotations

import array
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_server import protocol as p
from cache_server.chunk_keys import block_hash_keys, extend_chunk_hashes, lookahead_keys
from cache_server.layout import Layout, StoreKey, resume_depth

if TYPE_CHECKING:
    from cache_server.l2 import L2Tier
    from cache_server.namespaces import NamespaceTable
    from cache_server.store import ObjectStore

L1_MEDIUM = "CPU"  # vLLM's MEDIUM_CPU: the server's memory
L2_MEDIUM = "STORAGE"  # vLLM's MEDIUM_STORAGE: the shared Redis/Valkey tier (--l2)
KEY_SCHEMES = ("lmcache", "vllm")
MAX_SPAN = 1 << 20  # tokens per vLLM block hash
MAX_LOOKAHEAD = 64  # tokens a drafter's rows look ahead (MTP: 1)
MAX_L2_PROBE_KEYS = 1 << 14  # keys one query asks L2 about (the first chunks' first)
MAX_TEXT_CHARS = 256  # model, tenant_id, instance_id, lora_name, cache_salt
HASH_FIELDS = ("seq_hashes", "block_hashes", "block_hash")  # the RFC's name, Dynamo's, the RFC's older one
_U32 = next(t for t in ("I", "L") if array.array(t).itemsize == 4)


@dataclass(frozen=True)
class ChunkKeyScheme:
    """How an engine names its chunks (``hello``'s ``chunk_keys``): vLLM's block hashes
    every ``span`` tokens, or the token chain (``span`` None); ``lookahead`` tokens after
    each chunk join its key (a drafter)."""

    scheme: str = "lmcache"
    span: int | None = None
    lookahead: int = 0

    def describe(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "span": self.span, "lookahead": self.lookahead}


TOKEN_CHAIN = ChunkKeyScheme()


def chunk_key_scheme(value: Any) -> ChunkKeyScheme:
    """``hello``'s ``chunk_keys`` map, checked."""
    if not isinstance(value, dict):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "chunk_keys must be a map")
    scheme = p.str_field(value, "scheme", p.MAX_NAME_CHARS)
    if scheme not in KEY_SCHEMES:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"chunk_keys.scheme must be one of {', '.join(KEY_SCHEMES)}")
    lookahead = p.int_field(value, "lookahead", minimum=0, default=0, maximum=MAX_LOOKAHEAD)
    if scheme == "lmcache":
        return ChunkKeyScheme("lmcache", None, lookahead)
    return ChunkKeyScheme("vllm", p.int_field(value, "span", minimum=1, maximum=MAX_SPAN), lookahead)


class KeySchemes:
    """The key scheme each namespace's engine declared at hello; bounded (least recently
    declared forgotten first), thread-safe (workers write, the HTTP thread reads)."""

    def __init__(self, max_entries: int) -> None:
        self._max = max(1, max_entries)
        self._schemes: OrderedDict[str, ChunkKeyScheme] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, ns: str, scheme: ChunkKeyScheme) -> None:
        with self._lock:
            self._schemes[ns] = scheme
            self._schemes.move_to_end(ns)
            while len(self._schemes) > self._max:
                self._schemes.popitem(last=False)

    def get(self, ns: str) -> ChunkKeyScheme | None:
        with self._lock:
            return self._schemes.get(ns)


@dataclass
class Query:
    """One router question, checked (:func:`parse_query`)."""

    model: str
    tokens: list[int] | None
    hashes: list[bytes] | None
    salt: str | None = None
    lora: str | None = None
    tenant: str = "default"
    instance: str | None = None
    block_size: int | None = None


def _text(doc: dict[str, Any], name: str, default: Any = None) -> Any:
    value = doc.get(name, default)
    if value is None or (value == "" and name != "model"):
        return default
    if not isinstance(value, str):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"{name} must be a string")
    if len(value) > MAX_TEXT_CHARS:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"{name} is {len(value)} characters; the maximum is "
                                                       f"{MAX_TEXT_CHARS}")
    return value


def _tokens(value: Any) -> list[int]:
    """Token ids: a list of ints in uint32, or (over the protocol) bytes of little-endian
    uint32; one C pass each way for 100k ids."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) % 4:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "token_ids as bytes must be 4 bytes per id")
        if len(raw) // 4 > p.MAX_QUERY_TOKENS:
            raise p.ProtocolError(p.ErrorCode.TOO_LARGE, f"token_ids has {len(raw) // 4} ids; the maximum is "
                                                         f"{p.MAX_QUERY_TOKENS}")
        packed = array.array(_U32)
        packed.frombytes(raw)
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tolist()
    if not isinstance(value, list):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "token_ids must be a list of token ids")
    if len(value) > p.MAX_QUERY_TOKENS:
        raise p.ProtocolError(p.ErrorCode.TOO_LARGE, f"token_ids has {len(value)} ids; the maximum is "
                                                     f"{p.MAX_QUERY_TOKENS}")
    if not all(type(t) is int for t in value):  # bool, float, str, null: not a token id
        i = next(i for i, t in enumerate(value) if type(t) is not int)
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"token_ids[{i}] must be an integer token id, got "
                                                       f"{type(value[i]).__name__}")
    try:
        array.array(_U32, value)  # range check in C: negative ids and ids past uint32 raise
    except OverflowError:
        i = next(i for i, t in enumerate(value) if not 0 <= t < 1 << 32)
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                              f"token_ids[{i}] must be from 0 to {(1 << 32) - 1}, got {value[i]}") from None
    return value


def _hashes(value: Any, name: str) -> list[bytes]:
    """vLLM block hashes: 32-byte strings (msgpack) or 64 hex digits (JSON)."""
    if not isinstance(value, list):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"{name} must be a list of block hashes")
    if len(value) > p.MAX_HASHES:
        raise p.ProtocolError(p.ErrorCode.TOO_LARGE, f"{name} has {len(value)} hashes; the maximum is {p.MAX_HASHES}")
    out = []
    for i, h in enumerate(value):
        if isinstance(h, str) and len(h) == 2 * p.HASH_BYTES:
            try:
                h = bytes.fromhex(h)
            except ValueError:
                pass
        if not isinstance(h, bytes) or len(h) != p.HASH_BYTES:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"{name}[{i}] must be a vLLM block hash of {p.HASH_BYTES} bytes "
                                  f"({2 * p.HASH_BYTES} hex digits); 64-bit event hashes name no chunk here")
        out.append(h)
    return out


def parse_query(doc: Any, by_hash: bool | None = None) -> Query:
    """A query from an HTTP body or a protocol header. ``by_hash``: True for
    ``/query_by_hash`` (hashes required), False for ``/query`` (token ids required), None
    (the protocol op): either, hashes first."""
    if not isinstance(doc, dict):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a query must be a JSON object")
    model = _text(doc, "model")
    if not model:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a query needs model (a served model name or a namespace)")
    hash_name = next((n for n in HASH_FIELDS if n in doc), None)
    hashes = tokens = None
    if by_hash is not False and hash_name is not None:
        hashes = _hashes(doc[hash_name], hash_name)
    if "token_ids" in doc:  # with hashes too: a drafter's lookahead needs the tokens
        tokens = _tokens(doc["token_ids"])
    if by_hash and hashes is None:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "query_by_hash needs seq_hashes (vLLM's block hashes)")
    if tokens is None and hashes is None:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a query needs token_ids (or seq_hashes: /query_by_hash)")
    block_size = doc.get("block_size")
    if block_size is not None and (type(block_size) is not int or not 0 < block_size <= MAX_SPAN):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"block_size must be an integer from 1 to {MAX_SPAN}")
    return Query(model, tokens, hashes, _text(doc, "cache_salt"), _text(doc, "lora_name"),
                 _text(doc, "tenant_id", "default"), _text(doc, "instance_id"), block_size)


def model_of(namespace: str) -> str:
    """The served model name a namespace starts with (``<model>-<digest>``)."""
    return namespace.rsplit("-", 1)[0]


class PrefixQuery:
    """Answers :class:`Query` s from one server's store, namespace table and L2 tier (None:
    no L2); the key schemes of at most twice ``max_namespaces`` namespaces are remembered."""

    def __init__(self, store: ObjectStore, namespaces: NamespaceTable, l2: L2Tier | None,
                 max_namespaces: int) -> None:
        self.store, self.namespaces, self.l2 = store, namespaces, l2
        self.schemes = KeySchemes(2 * max_namespaces)

    def record_hello(self, ns: str, scheme: ChunkKeyScheme | None) -> None:
        """Remember the key scheme a ``hello`` declared (parsed with :func:`chunk_key_scheme`
        before the namespace was admitted: a refused hello changes nothing)."""
        if scheme is not None:
            self.schemes.record(ns, scheme)

    def namespaces_of(self, q: Query) -> list[str]:
        """The namespaces a query names, tracked ones only (a declared layout and chunk size)."""
        wanted = q.model.rstrip("/").split("/")[-1]
        out = []
        for ns in self.store.tracked_namespaces():
            if q.instance is not None and ns != q.instance:
                continue
            if (ns == q.model or model_of(ns) == wanted) and self.namespaces.chunk_size(ns) \
                    and self.store.declared_layout(ns) is not None:
                out.append(ns)
        if not out:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_MODEL,
                                  f"no namespace of model {q.model[:64]!r}"
                                  + (f" named {q.instance[:64]!r}" if q.instance else "")
                                  + " has registered with this server (its engines say hello with their layout; "
                                    "/status lists namespaces)")
        return out

    def answer(self, q: Query) -> dict[str, Any]:
        """``{tenant: {namespace: {"longest_matched", "CPU"[, "STORAGE"]}}}``, tokens. A
        namespace the query cannot name chunks for (token ids for one keyed by vLLM's block
        hashes, or the other way round) is left out; when that is every namespace, the
        first one's reason is the error."""
        entries = {}
        memo: dict[tuple[Any, ...], list[bytes]] = {}
        refusal: p.ProtocolError | None = None
        namespaces = self.namespaces_of(q)
        self._check_size(q, namespaces)
        for ns in namespaces:
            try:
                entries[ns] = self._entry(ns, q, memo)
            except p.ProtocolError as e:
                if e.code != p.ErrorCode.BAD_REQUEST:
                    raise
                refusal = refusal or e
        if not entries and refusal is not None:
            raise refusal
        return {q.tenant: entries}

    def _check_size(self, q: Query, namespaces: list[str]) -> None:
        """One bound for the whole query, before any key is hashed: its chunks times objects
        per chunk, summed over every namespace it walks, at most
        :data:`~cache_server.protocol.MAX_QUERY_OBJECTS`."""
        total = 0
        for ns in namespaces:
            C, layout = self.namespaces.chunk_size(ns), self.store.declared_layout(ns)
            if not C or layout is None:
                continue
            scheme = self.schemes.get(ns) or TOKEN_CHAIN
            if scheme.scheme == "vllm" and q.hashes is not None and scheme.span and C % scheme.span == 0:
                chunks = len(q.hashes) // (C // scheme.span)
            else:
                chunks = len(q.tokens or ()) // C
            total += chunks * layout.copies([*layout.attn_groups, *layout.state_groups])
        if total > p.MAX_QUERY_OBJECTS:
            raise p.ProtocolError(p.ErrorCode.TOO_LARGE,
                                  f"this query asks about {total} objects over {len(namespaces)} namespace(s) "
                                  f"(chunks x objects per chunk); the maximum is {p.MAX_QUERY_OBJECTS}: ask with "
                                  "instance_id for one namespace, or about a shorter prompt")

    def _keys(self, ns: str, q: Query, C: int, memo: dict[tuple[Any, ...], list[bytes]]) -> list[bytes]:
        """The chunk keys of the query's whole chunks under ``ns``'s scheme (shared by
        namespaces of one scheme and chunk size)."""
        scheme = self.schemes.get(ns) or TOKEN_CHAIN
        if scheme.scheme == "vllm":
            if q.hashes is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                      f"namespace {ns[:64]!r} names chunks by vLLM's block hashes (chunk_keys vllm, "
                                      f"every {scheme.span} tokens): send seq_hashes (POST /query_by_hash)")
            if q.block_size is not None and q.block_size != scheme.span:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                      f"block_size {q.block_size} is not the span of namespace {ns[:64]!r}'s block "
                                      f"hashes ({scheme.span} tokens)")
            if C % scheme.span:
                return []
            memo_key: tuple[Any, ...] = ("vllm", C, scheme.span)
            if memo_key not in memo:
                per_chunk = C // scheme.span
                memo[memo_key] = block_hash_keys(q.hashes, C, scheme.span, 0, len(q.hashes) // per_chunk)
        else:
            if q.tokens is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                      f"namespace {ns[:64]!r} names chunks by their token ids (chunk_keys lmcache): "
                                      "send token_ids (POST /query)")
            memo_key = ("lmcache", C, q.salt)
            if memo_key not in memo:
                memo[memo_key] = extend_chunk_hashes([], q.tokens, C, q.salt)
        plain = memo[memo_key]
        L = scheme.lookahead
        if not L:
            return plain
        if q.tokens is None:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"namespace {ns[:64]!r}'s keys cover a drafter's {L} token(s) after each chunk: "
                                  "send token_ids with the hashes")
        end = min(len(plain), max(0, (len(q.tokens) - L) // C))
        return lookahead_keys(plain, q.tokens, C, L, 0, end)

    def _entry(self, ns: str, q: Query, memo: dict[tuple[Any, ...], list[bytes]]) -> dict[str, int]:
        C = self.namespaces.chunk_size(ns)
        layout = self.store.declared_layout(ns)
        if not C or layout is None:  # forgotten since namespaces_of
            return {"longest_matched": 0, L1_MEDIUM: 0}
        if q.lora:  # the connector caches no LoRA request (connector.admission.uncacheable_reason)
            out = {"longest_matched": 0, L1_MEDIUM: 0}
            if self.l2 is not None:
                out[L2_MEDIUM] = 0
            return out
        keys = self._keys(ns, q, C, memo)
        l1, missing_attn, missing_state, horizon = self.store.presence(
            ns, keys, layout, MAX_L2_PROBE_KEYS if self.l2 is not None else 0)
        out = {"longest_matched": l1 * C, L1_MEDIUM: l1 * C}
        if self.l2 is None:
            return out
        if horizon == len(keys) and not missing_attn and not missing_state:
            out[L2_MEDIUM] = l1 * C  # L1 holds every object of the prompt's chunks
            return out
        both = self._with_l2(ns, keys[:horizon], layout, missing_attn, missing_state)
        if both is not None:
            out[L2_MEDIUM] = max(both, l1) * C
            out["longest_matched"] = out[L2_MEDIUM]
        return out

    def _with_l2(self, ns: str, keys: Sequence[bytes], layout: Layout, missing_attn: list[StoreKey],
                 missing_state: list[StoreKey]) -> int | None:
        """The resume depth L1 and L2 hold together over ``keys`` (the chunks the store
        listed what L1 lacks of: None when L2 was not asked in time). Only the keys L1 lacks
        are asked about, at most :data:`MAX_L2_PROBE_KEYS` in all (past that, the chunks
        after the last one asked count as absent: a lower bound), in at most two
        round trips: first the attention objects of the first chunk L1 lacks any of, with
        the state objects L1 lacks before it; only if L2 holds that chunk's attention, the
        rest. A prompt no tier holds (most replicas, for most requests) costs the first
        trip only: attention must be there for every chunk, so the first gap ends it."""
        l2 = self.l2
        index = {h: i for i, h in enumerate(keys)}
        first: list[StoreKey] = []
        if missing_attn:
            gap = index[missing_attn[0].chunk]
            first = [k for k in missing_attn if index[k.chunk] == gap]
            first += [k for k in missing_state if index[k.chunk] < gap]
        first = first[:MAX_L2_PROBE_KEYS]
        found = l2.probe(first) if first else set()
        if found is None:
            return None
        if not missing_attn or all(k in found for k in first if index[k.chunk] == gap):
            asked = set(first)
            rest = [k for k in (*missing_attn, *missing_state) if k not in asked][:MAX_L2_PROBE_KEYS - len(first)]
            more = l2.probe(rest)
            if more is None:
                return None
            found |= more
        absent = (set(missing_attn) | set(missing_state)) - found  # keys not asked about count as absent
        attn = layout.ranks(sorted(layout.attn_groups))
        state = layout.ranks(sorted(layout.state_groups))

        def holds(i: int, ranked: list[tuple[int, int]]) -> bool:
            return not any((ns, keys[i], g, r) in absent for g, r in ranked)

        return resume_depth(0, len(keys), lambda i: holds(i, attn), (lambda i: holds(i, state)) if state else None)
