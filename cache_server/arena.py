"""The server's arena: large objects live in one sealed memfd that same-host engines map
read-only, so a reload is one copy, from the server's memory into the engine's KV pages.

The arena is one memfd (``glmcache-arena-<pid>-<random>``), sized to the L1 capacity plus
one page, mapped read-write by the server, then sealed with ``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``: from then on no process can resize it
(nobody, the server included, can take a SIGBUS from a truncated arena), and no other
process can write into it: ``write()``, a ``MAP_SHARED`` ``PROT_WRITE`` mapping, a hole
punched in it and ``mprotect`` of a read-only mapping to writable all fail (tested,
``tests/server/test_server_arena.py``); only the server's own mapping, made before the seal,
writes. Its first page holds a random 16-byte nonce, which the client checks: a
``/proc/<pid>/fd/<fd>`` in another pid namespace names another process's file.

Objects of at least :data:`MIN_ARENA_BYTES` that a client puts through shared memory are
copied into the arena (:func:`cache_server.shm_payloads.owned_copy`: the one copy a save
makes into the server's memory); smaller ones, objects put as frames, L2 promotions, and
any object the arena has no room for are kept as before and served by copy: the arena is
an optimisation, never a new failure.

A range is free again only once nothing in the server refers to its bytes: each stored
object is a view of a :class:`_Range` that frees the range when the last view of it goes
(the store's entry, a ZMQ frame still being sent, an L2 write queued, a read pin). A
``get`` with ``arena`` answers, for each found arena object, its ``[offset, length]`` in
the arena instead of copying it, and one read pin (:class:`PinTable`) that holds those
views until the client releases it (``unpin``) or its deadline passes: an object evicted
or deleted meanwhile keeps its bytes until then. The client copies within the deadline
(checked on its own clock, with a margin). Each object is verified once: the server hashes
it as it places it (:meth:`Arena.place`) and the get's ``arena_checked`` says which
matched their checksums; the client copies those as they are and verifies the others on
the bytes it copied (:meth:`connector.kv_pages.PagedKVCache.write_verified`).

Memory: a range once written stays resident after its object leaves (the seal that keeps
other processes from writing also keeps the server from punching holes), so the arena's
resident size is its high-water mark, at most the L1 capacity; objects outside the arena
are allocated as before.

Who may read it, stated as it is: the whole arena, every namespace and every
``cache_salt`` in it, is readable by (a) every same-host client the server agreed shared
memory with (it answers the arena's place; with ``--auth-token-file``, token holders only),
and (b) every process that may inspect the server process (the server's user, same pid
namespace), token or not: such a process finds the memfd under ``/proc/<pid>/fd`` by its
name. A salt keeps a tenant from *naming* another's objects in a ``get``, not from reading
them here. So the trust boundary of the arena is the host's user: the server warns at
start-up when other processes run as its user (:func:`same_user_processes`), and
``--no-arena`` keeps none (same-host gets are then copied into each client's own segment,
which only that client and the server map).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import mmap
import os
import secrets
import stat
import threading
import time
from typing import Any

import numpy as np
import xxhash

from cache_server import protocol as p
from cache_server.shm import _MAP_FAILED, TMPFS_MAGIC, SharedMapping, _fs_type, _libc

NAME_PREFIX = "glmcache-arena-"
NONCE_BYTES = 16
HEAD_BYTES = 4096  # the first page holds the nonce; objects start after it
ALIGN = 64
VERIFY_PIECE_BYTES = 512 << 10  # place() copies, then hashes, a piece at a time: within L2
MIN_ARENA_BYTES = 256 << 10  # smaller objects stay outside (a get of them is cheap either way)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Python 3.11's fcntl lacks it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL

# Read pins: bounded per client process (every connection of one engine together) and in
# all; past a bound, objects are served by copy (never refused, never an older pin dropped: a
# client may still be copying under it). A connection's pins go with its last segment.
MAX_PIN_S = 60.0
DEFAULT_PIN_S = 30.0
MAX_PINS_PER_OWNER = 64
MAX_PINNED_BYTES_PER_OWNER = 8 << 30
MAX_PINS = 4096
MAX_UNPIN = 1024  # pin ids one request may release
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: pinned for every context, and a
# mapping the process may only read (CUDA 11.1+)
CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x08


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Range:
    """One allocated range of the arena. Arrays made from it (:meth:`Arena.place`) have it
    as their base, and numpy never collapses a view's base past an object that is not an
    array: every view of the object's bytes keeps this alive, and the range is handed back
    only once the last one is gone."""

    __slots__ = ("__array_interface__", "__weakref__", "_arena", "offset", "nbytes", "_span")

    def __init__(self, arena: Arena, offset: int, nbytes: int, span: int) -> None:
        self._arena, self.offset, self.nbytes, self._span = arena, offset, nbytes, span
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (arena.address + offset, False)}

    def __del__(self) -> None:
        self._arena._released.append((self.offset, self._span))  # taken back at the next allocation


class Arena:
    """The arena memfd, mapped and sealed, and its allocator (first fit over a free list
    sorted by offset, neighbours coalesced). Thread-safe."""

    def __init__(self, capacity: int, min_bytes: int = MIN_ARENA_BYTES) -> None:
        self.min_bytes = min_bytes
        if capacity <= 0:
            raise ValueError("arena capacity must be positive")
        self.size = HEAD_BYTES + _align(capacity)
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            self._mapping = SharedMapping(fd, self.size)  # read-write, before the write seal
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.view = self._mapping.array()
        self.address = self.view.ctypes.data
        self.view[:NONCE_BYTES] = np.frombuffer(self.nonce, dtype=np.uint8)
        self._lock = threading.Lock()
        self._starts = [HEAD_BYTES]  # free ranges, by offset
        self._lens = [self.size - HEAD_BYTES]
        self._released: collections.deque[tuple[int, int]] = collections.deque()  # freed by _Range.__del__
        self._checked: set[int] = set()  # offsets of objects verified when placed (place's expect)
        self.used = 0
        self.placed_total = 0
        self.full_total = 0  # objects that did not fit (kept outside the arena)

    def describe(self) -> dict[str, Any]:
        """What a client needs to map the arena (the ``arena`` map of an agreed ``shm``)."""
        return {"pid": os.getpid(), "fd": self.fd, "size": self.size, "nonce": self.nonce}

    def close(self) -> None:
        """Close the descriptor (clients attached already keep their mappings)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def place(self, src: np.ndarray, expect: tuple[bytes, bytes] | None = None) -> memoryview | None:
        """A copy of ``src`` in the arena, as a view whose last reference frees its range;
        None where no free range fits it.

        With ``expect`` (the object's key prefix and stored checksum,
        :func:`cache_server.protocol.checksum`), the copy is verified as it is made: each
        piece of :data:`VERIFY_PIECE_BYTES` is copied, then hashed from the arena while it
        is in cache (the arena's bytes, which only this process can write: never the
        client's segment, which it could change between a hash and a copy). A range whose
        bytes match is *checked* (:meth:`checked`) until it is freed or written again (the
        fault hook), and readers copy it without hashing it again: the object is verified
        once, at the one copy a save makes into the server's memory."""
        n = src.nbytes
        span = _align(max(n, 1))
        with self._lock:
            self._drain_locked()
            i = next((j for j, length in enumerate(self._lens) if length >= span), None)
            if i is None:
                self.full_total += 1
                return None
            off = self._starts[i]
            if self._lens[i] == span:
                del self._starts[i], self._lens[i]
            else:
                self._starts[i] += span
                self._lens[i] -= span
            self.used += span
            self.placed_total += 1
        arr = np.asarray(_Range(self, off, n, span))
        flat = src.reshape(-1).view(np.uint8)
        if expect is None:
            np.copyto(arr, flat)  # numpy copies without the GIL
            return memoryview(arr)
        h = xxhash.xxh3_128(expect[0])
        for i in range(0, n, VERIFY_PIECE_BYTES):  # copy, then hash the arena's piece (in cache)
            piece = arr[i:i + VERIFY_PIECE_BYTES]
            np.copyto(piece, flat[i:i + VERIFY_PIECE_BYTES])
            h.update(piece)
        if h.digest() == expect[1]:
            with self._lock:
                self._checked.add(off)
        return memoryview(arr)

    def checked(self, payload: Any) -> bool:
        """Whether an arena payload's bytes were verified against its checksum when placed
        and not written since."""
        at = self.offset_of(payload)
        return at is not None and at[0] in self._checked

    def written(self, payload: Any) -> None:
        """The server wrote into an arena payload after placing it (the fault hook): it is
        no longer checked, and readers verify it again."""
        at = self.offset_of(payload)
        if at is not None:
            with self._lock:
                self._checked.discard(at[0])

    def _drain_locked(self) -> None:
        while self._released:
            off, span = self._released.popleft()
            self._free_locked(off, span)

    def _free_locked(self, off: int, span: int) -> None:
        self._checked.discard(off)
        self.used -= span
        i = bisect.bisect_left(self._starts, off)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:  # join the range before
            i -= 1
            self._lens[i] += span
        else:
            self._starts.insert(i, off)
            self._lens.insert(i, span)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:  # and after
            self._lens[i] += self._lens.pop(i + 1)
            del self._starts[i + 1]

    def offset_of(self, payload: Any) -> tuple[int, int] | None:
        """``(offset, length)`` of a stored payload that lives in this arena, else None."""
        if not isinstance(payload, memoryview):
            return None
        base = getattr(payload.obj, "base", None)
        if not isinstance(base, _Range) or base._arena is not self or not payload.nbytes:
            return None
        return np.frombuffer(payload, dtype=np.uint8).ctypes.data - self.address, payload.nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self._drain_locked()
            return {"size": self.size, "used_bytes": self.used, "free_ranges": len(self._starts),
                    "largest_free": max(self._lens, default=0), "placed_total": self.placed_total,
                    "full_total": self.full_total}


def make_arena(capacity: int) -> tuple[Arena | None, str | None]:
    """The arena, or None and why not (no memfds here, or the kernel refused the seals)."""
    if not (hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")):
        return None, "no sealed memfds here"
    try:
        return Arena(capacity), None
    except OSError as e:
        return None, f"cannot make the arena: {e.strerror or e}"


def same_user_processes() -> list[str]:
    """``name[pid]`` of the processes of this process's user other than itself, its
    ancestors and its descendants (what could read the arena's memfd through ``/proc``)."""
    me, uid = os.getpid(), os.getuid()
    parent: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) != uid or entry == "2" or int(fields["PPid"]) == 2:
                continue  # another user's, or a kernel thread (kthreadd's)
            parent[int(entry)] = int(fields["PPid"])
            names[int(entry)] = fields["Name"].strip()
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile, or not ours to read
    related = {me}
    pid = me
    while parent.get(pid, 0) > 0 and parent[pid] not in related:  # ancestors
        pid = parent[pid]
        related.add(pid)
    related |= {p for p in parent if _descends(p, me, parent)}
    return [f"{names[p]}[{p}]" for p in sorted(parent) if p not in related]


def _descends(pid: int, ancestor: int, parent: dict[int, int]) -> bool:
    seen = set()
    while pid in parent and pid not in seen:
        seen.add(pid)
        pid = parent[pid]
        if pid == ancestor:
            return True
    return False


class _Pin:
    __slots__ = ("owner", "peer", "deadline", "views", "nbytes")

    def __init__(self, owner: bytes | None, peer: Any, deadline: float, views: list[memoryview], nbytes: int) -> None:
        self.owner, self.peer, self.deadline, self.views, self.nbytes = owner, peer, deadline, views, nbytes


class PinTable:
    """Read pins: each holds views of arena objects (so their ranges are not reused) for
    one client connection until released, past its deadline, or dropped with the connection
    (:meth:`drop_owner`). The per-client bounds count a client *process* (``peer``: every
    connection it opened), so one engine with many connections cannot hold every pin.
    Thread-safe."""

    def __init__(self, max_per_owner: int = MAX_PINS_PER_OWNER,
                 max_bytes_per_owner: int = MAX_PINNED_BYTES_PER_OWNER, max_pins: int = MAX_PINS) -> None:
        self.max_per_owner, self.max_bytes_per_owner, self.max_pins = max_per_owner, max_bytes_per_owner, max_pins
        self._lock = threading.Lock()
        self._pins: dict[int, _Pin] = {}
        self._by_peer: dict[Any, list[int]] = {}  # [pins, bytes] per client process (or connection)
        self.granted_total = 0
        self.released_total = 0
        self.expired_total = 0
        self.refused_total = 0  # gets served by copy: a bound was reached
        self.refused_release_total = 0  # ids unknown or another connection's
        self.dropped_total = 0  # pins of connections that went (their last segment detached or their process exited)

    def grant(self, owner: bytes | None, views: list[memoryview], pin_s: float, peer: Any = None) -> int | None:
        """A pin on ``views`` for connection ``owner`` of process ``peer`` (None: the
        connection counts alone) for ``pin_s`` seconds; None past a bound (the caller serves
        those objects by copy instead)."""
        nbytes = sum(v.nbytes for v in views)
        peer = ("connection", owner) if peer is None else peer
        with self._lock:
            count, held = self._by_peer.get(peer, (0, 0))
            if count >= self.max_per_owner or held + nbytes > self.max_bytes_per_owner \
                    or len(self._pins) >= self.max_pins:
                self.refused_total += 1
                return None
            while True:
                pin_id = secrets.randbits(64)
                if pin_id and pin_id not in self._pins:
                    break
            self._pins[pin_id] = _Pin(owner, peer, time.monotonic() + pin_s, views, nbytes)
            self._by_peer[peer] = [count + 1, held + nbytes]
            self.granted_total += 1
        return pin_id

    def release(self, owner: bytes | None, pin_ids: list[int]) -> int:
        """Release ``owner``'s pins among ``pin_ids`` (others' and unknown ones are left as
        they are); how many were released."""
        dropped = []
        with self._lock:
            for pin_id in pin_ids:
                pin = self._pins.get(pin_id)
                if pin is None or pin.owner != owner:
                    self.refused_release_total += 1
                    continue
                dropped.append(self._drop_locked(pin_id))
            self.released_total += len(dropped)
        return len(dropped)  # the views go here, outside the lock

    def drop_owner(self, owner: bytes | None) -> int:
        """Drop every pin of connection ``owner`` (it went); how many."""
        with self._lock:
            dropped = [self._drop_locked(i) for i in [i for i, pin in self._pins.items() if pin.owner == owner]]
            self.dropped_total += len(dropped)
        return len(dropped)

    def expire(self) -> int:
        """Drop pins past their deadline; how many."""
        now = time.monotonic()
        with self._lock:
            late = [i for i, pin in self._pins.items() if pin.deadline <= now]
            dropped = [self._drop_locked(i) for i in late]
            self.expired_total += len(dropped)
        return len(dropped)

    def _drop_locked(self, pin_id: int) -> _Pin:
        pin = self._pins.pop(pin_id)
        held = self._by_peer[pin.peer]
        held[0] -= 1
        held[1] -= pin.nbytes
        if held[0] <= 0:
            del self._by_peer[pin.peer]
        return pin

    def clear(self) -> None:
        with self._lock:
            self._pins.clear()
            self._by_peer.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"pins": len(self._pins), "pinned_bytes": sum(pin.nbytes for pin in self._pins.values()),
                    "granted_total": self.granted_total, "released_total": self.released_total,
                    "expired_total": self.expired_total, "refused_total": self.refused_total,
                    "refused_release_total": self.refused_release_total, "dropped_total": self.dropped_total,
                    "limits": {"pins_per_client": self.max_per_owner,
                               "pinned_bytes_per_client": self.max_bytes_per_owner, "pins": self.max_pins}}


def pin_ids(h: dict[str, Any], name: str) -> list[int]:
    """A request's pin ids to release: at most :data:`MAX_UNPIN`, packed as little-endian
    uint64s in one bin (not an array of integers: the header bound,
    ``protocol.unpack_header``, allows one array element per 32 header bytes)."""
    raw = p.field(h, name, bytes)
    if len(raw) % 8:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"{name} must be pin ids, 8 bytes each (uint64 little-endian)")
    if len(raw) > 8 * MAX_UNPIN:
        raise p.ProtocolError(p.ErrorCode.TOO_LARGE, f"{name} names {len(raw) // 8} pins; the maximum is {MAX_UNPIN}")
    return np.frombuffer(raw, dtype="<u8").tolist()


def pack_pins(ids: list[int]) -> bytes:
    """Pin ids as :func:`pin_ids` reads them."""
    return np.asarray(ids, dtype="<u8").tobytes()


def pin_seconds(h: dict[str, Any]) -> float:
    """A get's ``pin_s``: how long it wants its pin, within (0, :data:`MAX_PIN_S`]."""
    value = p.field(h, "pin_s", (int, float), default=DEFAULT_PIN_S)
    if not value > 0 or value != value or value == float("inf"):
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"pin_s must be a positive number of seconds, got {value}")
    return min(float(value), MAX_PIN_S)


def check_mapped(fd: int, spec: dict[str, Any]) -> str | None:
    """Why the descriptor a client opened is not the arena ``spec`` announced (None: it is):
    a ``glmcache-arena-*`` memfd on shared memory, with every seal, of the announced size."""
    link = os.readlink(f"/proc/self/fd/{fd}")
    if not (link.startswith(f"/memfd:{NAME_PREFIX}") and link.endswith(" (deleted)")):
        return "the descriptor is not a glmcache arena memfd"
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        return "the arena is not sealed against resizing and writing"
    if _fs_type(fd) != TMPFS_MAGIC:
        return "the arena is not plain shared memory"
    if os.fstat(fd).st_size != spec["size"]:
        return "the arena is not the size announced"
    return None


# --- the client's side ----------------------------------------------------------------------

class ClientArena:
    """A client's read-only mapping of a server's arena (``PROT_READ``, ``MAP_SHARED``),
    mapped once and kept: :meth:`view` answers the bytes of one ``[offset, length]``.

    Its page tables fill on first touch (the first reload through a new mapping pays
    that). Faulting an object's range in one ``madvise(MADV_POPULATE_READ)`` before
    copying it was measured slower here (3.8-4.6 GB/s for a first reload against 4.6-5.2
    with plain faults, which map 16 pages each); ``MAP_POPULATE`` would fault in the whole
    arena, allocating pages the server never wrote."""

    def __init__(self, spec: dict[str, Any], fd: int) -> None:
        self.size = spec["size"]
        addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._addr = addr
        self.__array_interface__ = {"shape": (self.size,), "typestr": "|u1", "data": (addr, True), "version": 3}
        self.array = np.asarray(self)  # views keep the mapping alive
        self.cuda_registered = False

    def nonce(self) -> bytes:
        return self.array[:NONCE_BYTES].tobytes()

    def register_cuda(self) -> str | None:
        """Page-lock the mapping for CUDA (``cudaHostRegister``, read-only and portable), so
        that a host-to-device copy out of the arena is a DMA from these very pages, without
        the driver's staging copy through a pinned bounce buffer; None when done (or done
        already), else why not. Locking faults in every page of the arena: its resident
        size becomes the whole L1 capacity at once (the server's pages, shared, not a
        second copy)."""
        if self.cuda_registered:
            return None
        try:
            import torch

            if not torch.cuda.is_available():
                return "no CUDA device"
            err = torch.cuda.cudart().cudaHostRegister(self._addr, self.size, CUDA_HOST_REGISTER_FLAGS)
        except Exception as e:  # noqa: BLE001 - a torch without CUDA, a driver that refuses
            return f"{type(e).__name__}: {e}"
        if int(getattr(err, "value", err)) != 0:
            return f"cudaHostRegister failed ({err})"
        self.cuda_registered = True
        return None

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.array[offset:offset + length])

    def __del__(self) -> None:
        try:
            if self.cuda_registered:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._addr)
            _libc.munmap(ctypes.c_void_p(self._addr), ctypes.c_size_t(self.size))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def map_arena(spec: Any) -> tuple[ClientArena | None, str | None]:
    """Map the arena a server announced (the ``arena`` map of its ``shm`` answer): its
    descriptor opened read-only through ``/proc/<pid>/fd/<fd>``, checked
    (:func:`check_mapped`, then the nonce); ``(None, why)`` where any of it fails (another
    container or user, an old server, a server without an arena). The path is trusted for
    nothing: it is opened ``O_PATH`` and must be a regular file before it is opened to read
    (non-blocking), so a FIFO or a device a hostile server names cannot hold the caller."""
    if not isinstance(spec, dict):
        return None, "the server offers no arena"
    pid, fd, size, nonce = (spec.get(k) for k in ("pid", "fd", "size", "nonce"))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (pid, fd, size)) or pid < 1 or fd < 0 \
            or size <= HEAD_BYTES or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        return None, "a malformed arena announcement"
    try:  # a path first (O_PATH opens nothing: a FIFO or a device there cannot block us or wake)
        where = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(where).st_mode):
                return None, "the server named something other than a file as its arena"
            ours = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        finally:
            os.close(where)
    except OSError as e:
        return None, f"cannot open the server's arena here ({e.strerror})"
    try:
        why = check_mapped(ours, spec)
        if why is not None:
            return None, why
        arena = ClientArena(spec, ours)
    except OSError as e:
        return None, f"cannot map the arena: {e.strerror or e}"
    finally:
        os.close(ours)
    if arena.nonce() != nonce:
        return None, "the arena here holds another nonce (another pid namespace)"
    return arena, None
