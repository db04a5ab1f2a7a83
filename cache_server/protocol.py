"""Wire protocol of glm-cache-server, imported by both the server and the client.

Transport: ZMQ, the server binds a ROUTER socket and clients connect DEALER sockets.
A request is one multipart message::

    [header, payload_0, payload_1, ...]

``header`` is a msgpack map; payloads are raw bytes (one per object for ``put``). A reply
has the same shape: a msgpack header, then one raw frame per object for ``get``. Nothing
on the wire is ever pickled.

Every request header carries ``op`` (str) and ``id`` (int, echoed in the reply so a client
can drop a stale reply after a timeout). Every reply header carries ``ok`` (bool) and
``id``; an error reply also carries ``code`` (one of :class:`ErrorCode`) and ``message``.
A server started with ``--auth-token-file`` also wants ``auth`` (str, the shared token) in
every request, ``ping`` and ``hello`` included; without it, or with another token, the
request does nothing and gets ``unauthorized``. A server without a token ignores ``auth``.

Operations and their header fields (``ns`` is the namespace: a fingerprint of the engine
geometry; objects never cross namespaces):

``hello``    ``v`` protocol version, ``ns``, ``alignment`` (tokens the chunk size must be a
             multiple of), optional ``world_size`` and ``replicated_groups`` (the engine's
             layout, for /status), optional ``attn_groups`` and ``state_groups`` (with
             them the server tracks usable prefixes and evicts worthless objects first)
             -> ``v``, ``chunk_size``, ``min_chunk_size``,
             ``separate_object_groups``, ``max_object_bytes``
``lookup``   ``ns``, ``hashes`` (list of 32-byte chunk hashes of a strict prefix),
             ``attn_groups``, ``state_groups`` (lists of group ids), ``world_size``,
             optional ``start_chunk`` (default 0), optional ``replicated_groups`` (groups
             identical on every tensor-parallel rank, stored once under rank 0: only that
             copy is needed), optional ``held`` (bool) -> ``chunks`` (hit depth),
             ``lease_id``, and with ``held`` true also ``held``: the chunks ``[0, held)``
             whose attention objects the server holds for every group and rank, and
             ``start_state``: whether it holds every state object at chunk
             ``start_chunk - 1`` (what a client need not send again)
``get``      ``ns``, ``keys`` (list of [hash, group, rank]) -> ``found`` (list of bool),
             ``sums`` (the stored checksum of each found object, in order), one payload
             frame per found key, in order
``put``      ``ns``, ``keys``, ``sums`` (one :data:`CHECKSUM_BYTES`-byte checksum per key,
             :func:`checksum` of its key and payload), optional ``prev`` (one hash or nil per
             key: the previous state of the same path, for snapshot-aware retention),
             optional ``parent`` (one entry per key: the hash of the chunk before the
             object's chunk, nil for the first chunk, empty bytes for unknown);
             one payload frame per key -> ``results`` (list of :class:`PutResult` values)
``delete``   ``ns``, ``keys``, optional ``reason`` (``checksum``: the loader found the
             bytes do not match their checksum, or they were stored under another key;
             ``size``: an object whose size is not the one its key's group has)
             -> ``removed`` (objects, in L1; a server with an L2 tier deletes the keys there
             too, in the background)
``debug_corrupt``  ``ns``, ``keys`` (one key), optional ``offset``: flips that byte of the
             stored object, keeping its checksum (servers started with
             ``--debug-fault-hooks`` only; tests of the checksum path) -> ``corrupted``
``debug_die_on``  ``on`` (``get``, ``put`` or ``lookup``): the server SIGKILLs itself when
             the next such request arrives (``--debug-fault-hooks`` only) -> ``armed``
``release``  ``lease_id`` -> ``released`` (bool), and when false ``reason``: ``unknown``
             (never granted, expired, released, or dropped by a cap) or ``not_owner``
             (another connection's lease: only the connection that took a lease, its ZMQ
             identity, can release it; it is left as it is). Lease ids are random 64-bit
             numbers.
``clear``    optional ``ns`` -> ``removed`` (objects)
``stats``    -> ``stats`` (map)
``ping``     -> nothing more
``shm_attach``  ``shm`` (a segment offer, see below) -> ``shm`` ({``seg``: id} or
             {``seg``: nil, ``reason``: why not})
``shm_detach``  ``seg`` -> ``detached`` (bool)
``unpin``    ``pins`` (bytes: at most 1024 read-pin ids of this connection's gets, uint64
             little-endian each) -> ``unpinned``
             (how many were released; others' and unknown ids are left as they are)
``query``    a router's question (:mod:`cache_server.prefix_query`, fields as the HTTP
             ``POST /query`` body: ``model``, ``token_ids`` (a list, or bytes of little-endian
             uint32) at most :data:`MAX_QUERY_TOKENS`, or ``seq_hashes`` (32-byte vLLM block
             hashes) at most :data:`MAX_HASHES`, optional ``cache_salt``,
             ``lora_name``, ``tenant_id``, ``instance_id``, ``block_size``) -> ``result``:
             resumable prefix tokens per namespace and tier; leases and touches nothing

``hello`` may also carry ``chunk_keys`` {``scheme``: ``lmcache`` or ``vllm``, ``span``,
``lookahead``}: how the engine names chunks, so that ``query`` can name them too.

Same-host shared memory (:mod:`cache_server.shm`): ``hello`` may carry ``shm``, a map
{``boot``: the client host's boot id, ``pid`` and ``fd``: a sealed ``glmcache-*`` memfd of
the client's (the server opens ``/proc/<pid>/fd/<fd>``), ``size``, ``nonce``: 16 bytes
written at its offset 0; a segment's id is a hash of its nonce}; the reply then carries
``shm`` as ``shm_attach`` answers it. With an agreed segment, ``get`` may carry ``shm``
{``seg``, ``off``, ``len``} (a region of it): the reply's ``shm`` lists, per found object,
[offset, length] of the object copied into that region, or nil for one sent as a frame
(it did not fit); only nil ones have frames. ``put`` may carry ``shm`` {``seg``, ``at``:
one [offset, length] per key} instead of payload frames. A segment the server does not
know (dropped, or the server restarted) gets ``shm_unknown``; the client attaches a new
one. Checksums are unchanged: the loading client verifies every payload, shm or not.

The server's arena (:mod:`cache_server.arena`): an agreed ``shm`` answer also carries
``arena`` {``pid``, ``fd``, ``size``, ``nonce``}: a sealed memfd the client may map
read-only. A ``get`` with ``shm`` may carry ``arena`` (bool), ``pin_s`` (seconds, at most
60; default 30) and ``unpin`` (ids of earlier pins to release, packed as ``unpin``'s
``pins``); its reply then carries
``arena``: per found object [offset, length] in the arena or nil, ``pin`` (the read pin on
those objects, nil if none), ``pin_s`` (granted) and ``arena_nonce``; ``shm`` and the frames
then cover only the found objects not in the arena. The client verifies arena objects'
checksums as it copies them, within the pin's deadline.

Authentication at connection: a server with a token also runs ZMQ's PLAIN mechanism with a
ZAP handler (:mod:`cache_server.auth`): a client connects with ``plain_username``
:data:`~cache_server.auth.PLAIN_USERNAME` and ``plain_password`` the token, and a peer
without it is disconnected in the handshake, before any message of it is read. The
``auth`` field is still checked on every request.

Limits (server flags): a frame over ``--max-message-mb`` makes ZMQ drop the message and
disconnect the peer unanswered (libzmq applies ``MAXMSGSIZE`` to each frame); a request
whose frames add up to more, or whose header is over ``--max-header-kb``, gets a
``too_large`` error before its header is parsed. A ``hello`` or ``put`` that would add a
namespace beyond ``--max-namespaces`` gets ``too_many_namespaces`` when every known one
still holds objects.

Limits (fixed, far above what a deployment sends; checked before anything is built from
what a request claims): ``world_size`` at most :data:`MAX_WORLD_SIZE` and a key's rank below
it; group ids at most :data:`MAX_GROUP_ID`; one chunk's objects (groups x ranks, replicated
groups once) at most :data:`MAX_COPIES`; a lookup's ``hashes`` at most :data:`MAX_HASHES`
and hashes x objects per chunk at most :data:`MAX_LOOKUP_OBJECTS`; ``keys`` of a ``get``,
``put`` or ``delete`` at most :data:`MAX_KEYS`; payload frames at most one per
:data:`KEY_WIRE_BYTES` header bytes (one per key) and :data:`MAX_KEYS`; a namespace at
most :data:`MAX_NAMESPACE_CHARS` characters; ``alignment`` at most :data:`MAX_ALIGNMENT`.
A list over its count or a request over its frames gets ``too_large``, a number or string
out of range ``bad_request``.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
from typing import Any

import msgpack
import xxhash

# v2: every object carries a checksum (put/get ``sums``), ``delete``; v3: XXH3-128 sums;
# v4: the sum covers the object's key too, and a server with a token wants PLAIN at connection
PROTOCOL_VERSION = 4
HASH_BYTES = 32  # blake3 digest size; chunk hashes on the wire are exactly this long
CHECKSUM_BYTES = 16
DELETE_REASONS = ("checksum", "size", "client")

HEADER_BYTES_PER_CONTAINER = 32  # a request header builds at most one array or map per this many bytes
DEFAULT_MAX_HEADER_BYTES = 1 << 20  # --max-header-kb default: a lookup of 30k chunks, a get of 28k keys

# Bounds on every count a request declares, checked before the server builds anything from
# it: a 60-byte lookup claiming 3,000,000 ranks made the server build one (group, rank)
# entry per rank (200 MiB); 10^9 would be 100 GB. Each bound is far above what a real
# deployment sends (docs/operating.md, "Limits"), and what it multiplies is bounded too.
MAX_WORLD_SIZE = 1024  # ranks of one engine (tensor x pipeline parallel): world_size, a key's rank below it
MAX_GROUP_ID = 255  # object group ids 0..255 (a model's cache groups; at most 256 in a list, no repeats)
MAX_COPIES = 4096  # objects of one chunk: groups x ranks (replicated groups once)
MAX_HASHES = 1 << 16  # chunk hashes of one lookup: 16M tokens at chunk 256
MAX_LOOKUP_OBJECTS = 1 << 20  # chunk hashes x copies of one lookup: what its presence tests and an L2 promotion cover
MAX_KEYS = 1 << 16  # object keys of one get, put or delete
MAX_FRAMES = 1 + MAX_KEYS  # frames of one request: the header, and a put's payloads
KEY_WIRE_BYTES = 37  # the fewest header bytes one key takes: [32-byte bin, group, rank]
MAX_NAMESPACE_CHARS = 1024  # engine fingerprints are about 100
MAX_ALIGNMENT = 1 << 20  # tokens a chunk must be a multiple of (a scheduler block)
MAX_NAME_CHARS = 64  # ``op``, ``reason``, ``on``: names from a fixed list
MAX_LEASE_ID = (1 << 64) - 1  # lease ids are random 64-bit numbers (cache_server.leases)
CLEAR_TIERS = ("l1", "l2", "all")  # what ``clear`` (and HTTP's /cache/clear) clears: LMCache's tiers
MAX_QUERY_OBJECTS = 1 << 18  # chunks x objects per chunk of one query, all its namespaces together
MAX_QUERY_TOKENS = 1 << 17  # token ids of one ``query``: 512 KiB as packed uint32, under the 1 MiB header

OPS = ("hello", "lookup", "get", "put", "delete", "debug_corrupt", "debug_die_on", "release", "clear", "stats",
       "ping", "shm_attach", "shm_detach", "query", "unpin")


class ErrorCode(str, enum.Enum):
    """Error codes carried in error replies."""

    BAD_REQUEST = "bad_request"  # malformed frame, wrong type, missing field
    UNKNOWN_OP = "unknown_op"
    VERSION_MISMATCH = "version_mismatch"
    TOO_LARGE = "too_large"  # a payload over the server's maximum object size
    GROUPS_NOT_SEPARATE = "groups_not_separate"  # group id != 0 without --separate-object-groups
    CONFLICT = "conflict"  # a namespace re-negotiated with another alignment
    UNAUTHORIZED = "unauthorized"  # missing or wrong ``auth`` token
    TOO_MANY_NAMESPACES = "too_many_namespaces"  # --max-namespaces reached, none of them empty
    SHM_UNKNOWN = "shm_unknown"  # a shared-memory segment the server does not map (any more)
    UNKNOWN_MODEL = "unknown_model"  # a query naming no namespace this server tracks
    EXPIRED = "expired"  # its client's deadline passed before a worker took it: not done
    BUSY = "busy"  # routers' queries: too many waiting for the query thread, or not answered in time
    INTERNAL = "internal"


class PutResult(str, enum.Enum):
    """Per-object outcome of a ``put``."""

    STORED = "stored"
    EXISTS = "exists"  # already resident: the write is skipped, the object's LRU age refreshed
    NO_SPACE = "no_space"  # the budget is held by leased objects; nothing partial is kept
    TOO_LARGE = "too_large"


class ProtocolError(ValueError):
    """A request that does not follow the protocol; becomes an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


ObjectKey = tuple[bytes, int, int]  # (chunk hash, group id, rank)


def negotiate_chunk_size(min_chunk_size: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is at least ``min_chunk_size``."""
    if min_chunk_size <= 0 or alignment <= 0:
        raise ValueError(f"chunk size and alignment must be positive, got {min_chunk_size}, {alignment}")
    return -(-min_chunk_size // alignment) * alignment


def checksum(payload: bytes | memoryview, namespace: str, key: ObjectKey) -> bytes:
    """The object checksum (:data:`CHECKSUM_BYTES` bytes): XXH3-128 over :func:`key_prefix`
    of the object's key, then its payload.

    Written by the client that stores an object and checked by the client that loads it,
    so a flipped bit anywhere between (network, server memory, a second tier) is caught
    before any byte reaches the engine's cache, and so is an object under a key it was not
    stored for (another namespace, chunk, group or rank: a save under another chunk grid's
    keys, a value copied under another key): its bytes may be intact and the right size,
    but they are not this key's. It is integrity, not authentication: whoever may write
    may also compute it (authentication is the server's token), so a fast
    non-cryptographic hash serves: about 30 GB/s on one core here, against about 14 GB/s
    for blake3 on two, which would be most of a same-host 40 MB get
    (``validation/bench_server.py``). The key costs one extra block."""
    h = xxhash.xxh3_128(key_prefix(namespace, key))
    h.update(payload)
    return h.digest()


def key_prefix(namespace: str, key: ObjectKey) -> bytes:
    """What :func:`checksum` hashes before the payload: a tag, then the namespace, the chunk
    hash (each length-prefixed), the group and the rank (little-endian u64), so no two
    keys encode alike."""
    digest, group, rank = key
    return b"".join((_namespace_prefix(namespace), _U32.pack(len(digest)), bytes(digest), _U64_PAIR.pack(group, rank)))


_U32, _U64_PAIR = struct.Struct("<I"), struct.Struct("<QQ")


@functools.lru_cache(maxsize=64)  # a load checks hundreds of keys of one namespace
def _namespace_prefix(namespace: str) -> bytes:
    ns = namespace.encode("utf-8", "surrogatepass")
    return b"glmsum4\0" + _U32.pack(len(ns)) + ns


def pack_header(header: dict[str, Any]) -> bytes:
    """Serialise a header map."""
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: bytes | memoryview, max_bytes: int | None = None) -> dict[str, Any]:
    """Parse a header frame; anything but a msgpack map raises.

    With ``max_bytes`` (the server, parsing requests) a longer frame is refused before any
    parsing, and the parse is bounded by the frame's own length: no string or map may
    declare more than the frame could hold, and no array more than one element, nor the
    whole header more than one array or map, per :data:`HEADER_BYTES_PER_CONTAINER`
    bytes. Before anything is built, a skipping pass (which allocates nothing) checks the
    frame is one complete msgpack value: msgpack pre-sizes an array by its declared length,
    so a truncated chain of nested arrays would otherwise allocate far more than it sends.
    Unbounded, an 8 MiB header of nested containers was measured to expand to 516 MiB of
    Python objects; real headers spend at least a 32-byte hash per array element (hash lists) or
    per array (keys), so they never come near these bounds.
    """
    kwargs: dict[str, Any] = {"max_bin_len": 1 << 20, "max_str_len": 1 << 20, "max_array_len": 1 << 20,
                              "max_map_len": 64}
    if max_bytes is not None:
        size = memoryview(frame).nbytes
        if size > max_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"header is {size} bytes; the maximum is {max_bytes} "
                                                     "(--max-header-kb)")
        most = size // HEADER_BYTES_PER_CONTAINER + 16
        budget = [most]

        def count(container: Any) -> Any:
            budget[0] -= 1
            if budget[0] < 0:
                raise ValueError(f"more than one array or map per {HEADER_BYTES_PER_CONTAINER} header bytes")
            return container

        kwargs.update(max_bin_len=size, max_str_len=size, max_array_len=most, max_map_len=min(64, size),
                      max_ext_len=0)
        try:
            scan = msgpack.Unpacker(max_buffer_size=max(size, 1), **kwargs)
            scan.feed(frame)
            scan.skip()
            if scan.tell() != size:
                raise ValueError(f"{size - scan.tell()} bytes after the header map")
        except Exception as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"header is not valid msgpack: {str(e) or type(e).__name__}"
                                ) from None
        kwargs.update(list_hook=count, object_hook=count)
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, **kwargs)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header is not valid msgpack: {str(e) or type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header must be a map, got {type(header).__name__}")
    return header


def max_payload_frames(header_bytes: int) -> int:
    """The most payload frames a request with a header of ``header_bytes`` can carry: one
    per key (a put), each key taking at least :data:`KEY_WIRE_BYTES` of the header, and at
    most :data:`MAX_KEYS`. More is refused before a Python object is made for any of them."""
    return min(MAX_KEYS, header_bytes // KEY_WIRE_BYTES)


def peek_request_id(frame: bytes | memoryview) -> int | None:
    """The ``id`` of a header refused unparsed (too large), read without building any other
    value, so the refusal still reaches its client: a client drops replies whose ``id`` is
    not its request's. None where there is none or it cannot be read."""
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=max(memoryview(frame).nbytes, 1), raw=False, max_str_len=64,
                                    max_bin_len=0, max_array_len=0, max_map_len=0, max_ext_len=0)
        unpacker.feed(frame)
        for _ in range(min(unpacker.read_map_header(), 64)):
            if unpacker.unpack() == "id":
                value = unpacker.unpack()
                return value if isinstance(value, int) and not isinstance(value, bool) else None
            unpacker.skip()
    except Exception:  # any malformation: no id to echo
        pass
    return None


def error_reply(request_id: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    """Header of an error reply."""
    return {"ok": False, "id": request_id if isinstance(request_id, int) else None,
            "code": code.value, "message": message}


# --- field validation, shared by the server (requests) and tests -------------------------


def field(header: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Return ``header[name]`` checked against ``kind``; a missing or mistyped field raises."""
    if name not in header:
        if default is ...:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"missing field {name!r}")
        return default
    value = header[name]
    # bool is an int subclass: never accept True where a count is expected.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {_kind_name(kind)}, got bool")
    if not isinstance(value, kind):
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"field {name!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


MAX_BUDGET_S = 3600.0  # the most a request's ``budget`` may say its client waits
# Ops a server skips once their client has given up (their effect is only their answer, or
# the client takes an unanswered one as failed); releases, deletes and clears are done anyway.
SKIPPED_WHEN_EXPIRED = frozenset({"hello", "lookup", "get", "put", "query", "stats", "ping", "shm_attach"})


def deadline_fields(header: dict[str, Any]) -> tuple[float, float] | None:
    """A request's ``sent`` (its client's wall clock at sending, seconds since the epoch)
    and ``budget`` (seconds its client waits for the answer), or None when it says neither
    (an older client). One without the other, or either not a finite positive number,
    is a bad request."""
    if "sent" not in header and "budget" not in header:
        return None
    sent, budget = header.get("sent"), header.get("budget")
    for name, value in (("sent", sent), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a positive finite number")
    if budget > MAX_BUDGET_S:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field 'budget' must be <= {MAX_BUDGET_S:.0f}, got {budget}")
    return float(sent), float(budget)


def int_field(header: dict[str, Any], name: str, minimum: int = 0, default: Any = ...,
              maximum: int | None = None) -> int:
    """An integer field no smaller than ``minimum`` (and no larger than ``maximum``, if given)."""
    value = field(header, name, int, default)
    if value < minimum:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be <= {maximum}, got {value}")
    return value


def str_field(header: dict[str, Any], name: str, max_chars: int, default: Any = ...) -> str:
    """A string field of at most ``max_chars`` characters."""
    value = field(header, name, str, default)
    if isinstance(value, str) and len(value) > max_chars:
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"field {name!r} is {len(value)} characters; the maximum is {max_chars}")
    return value


def namespace_field(header: dict[str, Any], name: str = "ns", default: Any = ...) -> str:
    """A namespace: a string of at most :data:`MAX_NAMESPACE_CHARS` characters."""
    return str_field(header, name, MAX_NAMESPACE_CHARS, default)


def list_field(header: dict[str, Any], name: str, max_items: int) -> list[Any]:
    """A list of at most ``max_items`` elements (too many: ``too_large``)."""
    value = field(header, name, list)
    if len(value) > max_items:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{name} has {len(value)} elements; the maximum is {max_items}")
    return value


def hash_list(header: dict[str, Any], name: str, max_items: int = MAX_HASHES) -> list[bytes]:
    """A list of at most ``max_items`` chunk hashes, each exactly :data:`HASH_BYTES` bytes."""
    hashes = list_field(header, name, max_items)
    for i, h in enumerate(hashes):
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name}[{i}] must be {HASH_BYTES} bytes")
    return hashes


def _is_group(g: Any) -> bool:
    return isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= MAX_GROUP_ID


def _is_rank(r: Any) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_WORLD_SIZE


def group_list(header: dict[str, Any], name: str) -> list[int]:
    """A list of group ids (0 to :data:`MAX_GROUP_ID`) without repeats."""
    groups = list_field(header, name, MAX_GROUP_ID + 1)
    if not all(_is_group(g) for g in groups):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a list of group ids from 0 to {MAX_GROUP_ID}")
    if len(set(groups)) != len(groups):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} has repeated group ids")
    return groups


GROUP_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
GROUP_ID_TEXT = re.compile(r"[0-9]{1,3}")


def group_names(header: dict[str, Any], name: str = "group_names") -> dict[int, str]:
    """Object group names by group id: ``{"<id>": "<name>"}``, ids written in ASCII digits
    (0 to :data:`MAX_GROUP_ID`), names in ``[a-z0-9_]`` (they become metric label values),
    at most 32 characters."""
    raw = field(header, name, dict)
    out: dict[int, str] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and GROUP_ID_TEXT.fullmatch(k) and int(k) <= MAX_GROUP_ID
                and isinstance(v, str) and GROUP_NAME.fullmatch(v)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must map group ids (0 to {MAX_GROUP_ID}) to names "
                                                       "of [a-z0-9_] (at most 32 characters)")
        out[int(k)] = v
    return out


def key_list(header: dict[str, Any], name: str = "keys", max_items: int = MAX_KEYS) -> list[ObjectKey]:
    """A list of at most ``max_items`` object keys ``[hash, group, rank]`` (group at most
    :data:`MAX_GROUP_ID`, rank below :data:`MAX_WORLD_SIZE`)."""
    raw = list_field(header, name, max_items)
    keys: list[ObjectKey] = []
    for i, k in enumerate(raw):
        if (not isinstance(k, list) or len(k) != 3 or not isinstance(k[0], bytes)
                or len(k[0]) != HASH_BYTES or not _is_group(k[1]) or not _is_rank(k[2])):
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"{name}[{i}] must be [{HASH_BYTES}-byte hash, group 0 to {MAX_GROUP_ID}, "
                                f"rank 0 to {MAX_WORLD_SIZE - 1}]")
        keys.append((k[0], k[1], k[2]))
    return keys


def checksum_list(header: dict[str, Any], count: int, name: str = "sums") -> list[bytes]:
    """``count`` checksums, each exactly :data:`CHECKSUM_BYTES` bytes."""
    sums = field(header, name, list)
    if len(sums) != count or not all(isinstance(s, bytes) and len(s) == CHECKSUM_BYTES for s in sums):
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"{name} must list one {CHECKSUM_BYTES}-byte checksum per key ({count})")
    return sums


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
