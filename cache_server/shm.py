"""Same-host fast path of glm-cache-server: payload bytes through shared memory.

The server maps memory a client created, so nothing the client does to that memory may
reach the server as a fault: a file the client could truncate would make the server's
next copy into or out of it die of SIGBUS, taking every engine's objects with it. So a
segment is a *sealed memfd*: anonymous shared memory whose size the kernel itself keeps
fixed once sealed.

How a client and the server agree (``hello``, or ``shm_attach`` for another segment):

1. The client creates a memfd ``glmcache-<pid>-<random>`` (``memfd_create`` with
   ``MFD_ALLOW_SEALING``), sizes it and reserves its pages (``posix_fallocate``: the
   client's memory, charged to the client), seals it against shrinking and growing and
   seals the seals (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: no process can change
   its size from then on, not even the client), maps it, and writes a random 16-byte nonce
   at offset 0. It sends its pid, the descriptor's number, the size, the nonce and this
   host's boot id.
2. The server checks the offer before it maps anything: the boot id is its own, the sizes
   are within its bounds (per client connection and in total), then it opens
   ``/proc/<pid>/fd/<fd>`` (``O_PATH`` first, then its own descriptor of that very file:
   no window in which the client can swap it) and agrees only if that is a memfd named
   ``glmcache-*`` on tmpfs (not hugetlbfs, where a page missing at fault time is a SIGBUS
   too), carries all three seals, has exactly the offered size (read after the seals, so
   it can no longer change), and holds the client's nonce (two containers on one host
   share a boot id but not their pid numbers: the nonce tells them apart). It answers the
   segment's id, :func:`segment_id` of the nonce, which the client knows without the
   answer: a client whose offer timed out can still detach it.
3. Whatever the answer, the client closes its descriptor once the reply is in: the memory
   lives exactly as long as the two mappings, and nothing is ever left in /dev/shm.

An unsealed, wrongly sealed or wrongly sized descriptor is refused with its reason, and
the client moves payloads as frames. Opening another process's descriptor needs the
rights to inspect it (same user, a dumpable process, the same pid namespace): a client in
another container, or of another user, falls back to frames as well.

Payloads live at or after :data:`DATA_OFFSET` (the first page holds the nonce). A ``get``
names a region of a segment; the server copies found objects into it and answers their
offsets (an object that does not fit comes as a frame, as over TCP). A ``put`` names
where each payload lies; the server copies them out into its store. One client sends one
request at a time (its lock), and a client abandons its segments after a timeout (the
server may still be writing into them), so a region is never written by two requests.
An abandoned segment is detached by the client as soon as the server answers again.

The server's side of a request's payloads (a get's region, a put's spans, the store's own
copy of a put payload) is :mod:`cache_server.shm_payloads`.

The server drops a mapping on ``shm_detach`` (a client closing, or detaching what it
abandoned), or after :data:`IDLE_DROP_S` without use (a client that died). It maps at most
:data:`MAX_SEGMENTS_PER_CLIENT` segments and :data:`MAX_BYTES_PER_CLIENT` bytes for one
client connection, and :data:`MAX_SEGMENTS` and :data:`MAX_MAPPED_BYTES` in all; an offer
past a bound is refused before anything is opened (the segments it has are kept). A
request naming a dropped segment gets ``shm_unknown``; the client then attaches a new one
and repeats the request.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_server import protocol as p

NAME_PREFIX = "glmcache-"
NONCE_BYTES = 16
DATA_OFFSET = 4096  # payloads start on the second page; the first holds the nonce
ALIGN = 64  # objects in a get region start on cache-line boundaries
IDLE_DROP_S = 300.0
# Bounds on what the server maps, checked before it opens an offer. A client's default
# segments (64 MiB, growing to what a get needed, at most 1 GiB together) fit well within
# the per-client ones, and the client keeps to them by itself (cache_server.client.segments).
MAX_SEGMENTS_PER_CLIENT = 32
MAX_BYTES_PER_CLIENT = 2 << 30
MAX_SEGMENTS = 1024
MAX_MAPPED_BYTES = 128 << 30  # what a dead client's mapped pages can hold until IDLE_DROP_S
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TMPFS_MAGIC = 0x01021994  # statfs f_type of shmem, where memfds live (hugetlbfs has its own)
# A server's arena (cache_server.arena, glmcache-arena-*) is never a client's segment.
_MEMFD_LINK_RE = re.compile(r"^/memfd:glmcache-(?!arena-)[A-Za-z0-9_-]{1,80} \(deleted\)$")


Peer = tuple[int, int]  # a client process: its pid and its start time (clock ticks after boot; pids are reused)


def process_identity(pid: int) -> Peer | None:
    """``(pid, start time)`` of a live process, None if there is none of that pid here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    fields = stat_line[stat_line.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    try:
        return pid, int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This host's boot id (one per kernel boot, shared by every container on the host), or
    None where it cannot be read (then no shared memory is offered or accepted)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def memfd_supported() -> bool:
    """Whether this Python and kernel can make sealed memfds (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(os, "O_PATH")


def segment_id(nonce: bytes) -> int:
    """The id the server answers for the segment holding ``nonce``, in 1..2**62: both sides
    compute it, so a client whose offer timed out knows what to detach. As unguessable as
    the nonce, which only the segment's mappers can read."""
    return (int.from_bytes(hashlib.sha256(b"glmcache-segment\0" + nonce).digest()[:8], "little") >> 2) + 1


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class SharedMapping:
    """``MAP_SHARED`` read-write mapping of a file that keeps no descriptor of it (Python's
    ``mmap.mmap`` keeps a duplicate per mapping until 3.13's ``trackfd``: a server mapping
    a thousand segments would hold a thousand descriptors, enough to run out of them).

    Its bytes are reached only through :meth:`array`; it is unmapped once the last array
    (and every view of one) is gone, never under a view still in use."""

    def __init__(self, fd: int, size: int) -> None:
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._addr, self.size = addr, size
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, False), "version": 3}

    def array(self) -> np.ndarray:
        """A new uint8 array over the whole mapping, whose base is this mapping: views of it
        keep it alive, and collapse their base onto it (not past it)."""
        return np.asarray(self)

    def __del__(self) -> None:
        try:
            _libc.munmap(self._addr, self.size)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ClientSegment:
    """One client-created shared-memory segment: a sealed memfd (see the module docstring)."""

    def __init__(self, size: int) -> None:
        if size <= DATA_OFFSET:
            raise ValueError(f"segment size must exceed {DATA_OFFSET}, got {size}")
        self.size = size
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.seg_id: int | None = None  # the server's id once attached
        self.busy = False  # a get's views into it are alive, or a request is using it
        fd = os.memfd_create(f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # our pages, reserved now (ENOMEM now, not at first touch)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.mapping: SharedMapping | None = SharedMapping(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd  # open until the server has answered the offer
        self.view: Any = self.mapping.array()
        self.view[:NONCE_BYTES] = np.frombuffer(self.nonce, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return self.size - DATA_OFFSET

    def describe(self, host: str) -> dict[str, Any]:
        """The ``shm`` map of ``hello`` / ``shm_attach``."""
        return {"boot": host, "pid": os.getpid(), "fd": self._fd, "size": self.size, "nonce": self.nonce}

    def close_fd(self) -> None:
        """Close the descriptor the offer named (the mapping keeps the memory)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Close the descriptor and unmap; the mapping stays while views of a get are still
        alive (it goes with the last of them)."""
        self.close_fd()
        self.view = None
        self.mapping = None


@dataclass
class _Mapped:
    size: int
    owner: bytes | None  # the client connection (ZMQ identity) that attached it
    last_used: float
    view: Any = field(default=None)  # numpy uint8 view over the whole mapping


class SegmentTable:
    """The server's mapped client segments, by id. Thread-safe."""

    def __init__(self, enabled: bool, idle_drop_s: float = IDLE_DROP_S, max_segments: int = MAX_SEGMENTS,
                 max_mapped_bytes: int = MAX_MAPPED_BYTES, max_segments_per_client: int = MAX_SEGMENTS_PER_CLIENT,
                 max_bytes_per_client: int = MAX_BYTES_PER_CLIENT) -> None:
        self.enabled = enabled
        self.idle_drop_s = idle_drop_s
        self.max_segments = max_segments
        self.max_mapped_bytes = max_mapped_bytes
        self.max_segments_per_client = max_segments_per_client
        self.max_bytes_per_client = max_bytes_per_client
        self.host = boot_id() if enabled and memfd_supported() else None
        self._lock = threading.Lock()
        self._segments: OrderedDict[int, _Mapped] = OrderedDict()
        # Segments and bytes per client connection and in all, those being opened included.
        self._held: dict[bytes | None, list[int]] = {}
        # The process behind each connection with a segment (the pid its memfd was opened in,
        # checked by the open), and connections whose last segment went since the server
        # last asked (:meth:`take_gone`: it drops their read pins).
        self._peers: dict[bytes | None, Peer] = {}
        self._gone: list[bytes | None] = []
        self._opening: set[int] = set()
        self._count = 0
        self._bytes = 0
        self.attached_total = 0
        self.refused_total = 0
        self.get_bytes = 0  # payload bytes served into segments
        self.put_bytes = 0  # payload bytes taken from segments

    def count(self, get_bytes: int = 0, put_bytes: int = 0) -> None:
        with self._lock:
            self.get_bytes += get_bytes
            self.put_bytes += put_bytes

    def attach(self, spec: Any, owner: bytes | None = None) -> dict[str, Any]:
        """Answer a client's offer (the ``shm`` map of hello / shm_attach) from the client
        connection ``owner``: ``{"seg": id}`` when agreed, else ``{"seg": None, "reason":
        ...}``. Never raises on a bad offer, and maps nothing past the bounds."""
        reason = self._refusal(spec)
        seg_id = segment_id(spec["nonce"]) if reason is None else 0
        size = spec["size"] if reason is None else 0
        if reason is None:
            with self._lock:
                reason = self._bound_refusal_locked(owner, size, seg_id)
                if reason is None:  # held for this offer while it is opened outside the lock
                    self._charge_locked(owner, size, 1)
                    self._opening.add(seg_id)
        if reason is not None:
            with self._lock:
                self.refused_total += 1
            return {"seg": None, "reason": reason}
        try:
            opened = _open_sealed(spec)
        except Exception as e:  # noqa: BLE001 - a bad offer is refused, never raised
            opened = f"cannot map the segment: {type(e).__name__}: {e}"
        with self._lock:
            self._opening.discard(seg_id)
            if isinstance(opened, str):
                self._charge_locked(owner, size, -1)
                self.refused_total += 1
                return {"seg": None, "reason": opened}
            self._segments[seg_id] = _Mapped(size, owner, time.monotonic(), opened)
            self.attached_total += 1
            peer = process_identity(spec["pid"])
            if peer is not None:
                self._peers[owner] = peer
        return {"seg": seg_id}

    def peer_of(self, owner: bytes | None) -> Peer | None:
        """The process behind client connection ``owner`` (None: it has no segment)."""
        with self._lock:
            return self._peers.get(owner)

    def reap_exited(self) -> int:
        """Drop the segments of connections whose process has exited (or whose pid is now
        another process's): they would otherwise wait ``idle_drop_s``; returns how many."""
        with self._lock:
            peers = dict(self._peers)
        gone = {peer for peer in set(peers.values()) if process_identity(peer[0]) != peer}  # once per process
        exited = {owner for owner, peer in peers.items() if peer in gone}
        if not exited:
            return 0
        with self._lock:
            dead = [s for s, m in self._segments.items() if m.owner in exited]
            for s in dead:
                self._drop_locked(s)
        return len(dead)

    def take_gone(self) -> list[bytes | None]:
        """The connections whose last segment went (detached, idle, or their process exited)
        since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def _refusal(self, spec: Any) -> str | None:
        if not self.enabled:
            return "shared memory is off on the server (--no-shm)"
        if self.host is None:
            return "the server cannot read its boot id or make memfds"
        if not isinstance(spec, dict):
            return "shm must be a map"
        pid, fd, size, nonce, host = (spec.get(k) for k in ("pid", "fd", "size", "nonce", "boot"))
        if not isinstance(host, str) or host != self.host:
            return "another host (boot ids differ)"
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (pid, fd)) or pid < 1 or fd < 0:
            return "pid and fd must name the client's sealed memfd (a /dev/shm path is not accepted)"
        if not isinstance(size, int) or isinstance(size, bool) or size <= DATA_OFFSET:
            return "bad segment size"
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return f"nonce must be {NONCE_BYTES} bytes"
        return None

    def _bound_refusal_locked(self, owner: bytes | None, size: int, seg_id: int) -> str | None:
        """Why an offer of ``size`` bytes from ``owner`` would pass a bound (None: it would not)."""
        count, held = self._held.get(owner, (0, 0))
        if count >= self.max_segments_per_client:
            return (f"this client connection has {count} segments mapped, the most the server maps for one; "
                    "detach one first")
        if held + size > self.max_bytes_per_client:
            return (f"this client connection would have {held + size} bytes mapped; the server maps at most "
                    f"{self.max_bytes_per_client} for one")
        if self._count >= self.max_segments:
            return f"the server maps {self._count} segments, its most; payloads over TCP"
        if self._bytes + size > self.max_mapped_bytes:
            return f"the server would map {self._bytes + size} bytes, past its {self.max_mapped_bytes}"
        if seg_id in self._segments or seg_id in self._opening:
            return "this segment is attached already"
        return None

    def _charge_locked(self, owner: bytes | None, size: int, n: int) -> None:
        held = self._held.setdefault(owner, [0, 0])
        held[0] += n
        held[1] += n * size
        self._count += n
        self._bytes += n * size
        if held[0] <= 0:
            del self._held[owner]
            if self._peers.pop(owner, None) is not None:
                self._gone.append(owner)

    def use(self, seg_id: int) -> _Mapped | None:
        """The mapping of ``seg_id`` (its use noted), or None if unknown or dropped."""
        with self._lock:
            mapped = self._segments.get(seg_id)
            if mapped is not None:
                mapped.last_used = time.monotonic()
                self._segments.move_to_end(seg_id)
            return mapped

    def detach(self, seg_id: int) -> bool:
        with self._lock:
            return self._drop_locked(seg_id)

    def expire(self) -> int:
        """Drop mappings idle for ``idle_drop_s``; returns how many."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s, m in self._segments.items() if now - m.last_used > self.idle_drop_s]
            for s in idle:
                self._drop_locked(s)
        return len(idle)

    def close(self) -> None:
        with self._lock:
            for s in list(self._segments):
                self._drop_locked(s)

    def _drop_locked(self, seg_id: int) -> bool:
        mapped = self._segments.pop(seg_id, None)
        if mapped is None:
            return False
        self._charge_locked(mapped.owner, mapped.size, -1)
        mapped.view = None  # unmapped now, or when the request still copying through it is done
        return True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled and self.host is not None, "segments": len(self._segments),
                    "mapped_bytes": sum(m.size for m in self._segments.values()),
                    "clients": len({m.owner for m in self._segments.values()}),
                    "attached_total": self.attached_total, "refused_total": self.refused_total,
                    "get_bytes": self.get_bytes, "put_bytes": self.put_bytes,
                    "limits": {"segments": self.max_segments, "mapped_bytes": self.max_mapped_bytes,
                               "segments_per_client": self.max_segments_per_client,
                               "bytes_per_client": self.max_bytes_per_client}}

    def request_view(self, spec: Any) -> np.ndarray:
        """The mapped bytes of the segment a request's ``shm`` map names (``shm_unknown``
        if it is not mapped, or no longer)."""
        if not isinstance(spec, dict):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "shm must be a map")
        mapped = self.use(p.int_field(spec, "seg", minimum=1))
        view = mapped.view if mapped is not None else None
        if view is None:
            raise p.ProtocolError(p.ErrorCode.SHM_UNKNOWN, "unknown shared-memory segment; attach a new one")
        return view


def _open_sealed(spec: dict[str, Any]) -> np.ndarray | str:
    """The mapped bytes of the memfd an offer names, or why it is refused (the module docstring
    says what is checked; the order matters: the size is read only once the seals hold it)."""
    size = spec["size"]
    try:  # O_PATH: a reference to the file without opening it (no side effect of any kind)
        ref = os.open(f"/proc/{spec['pid']}/fd/{spec['fd']}", os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        return (f"cannot open the client's descriptor here ({e.strerror}): another container, another user, "
                "or a process the server may not inspect")
    try:
        if not stat.S_ISREG(os.fstat(ref).st_mode) or not _MEMFD_LINK_RE.match(os.readlink(f"/proc/self/fd/{ref}")):
            return "the descriptor is not a glmcache memfd"
        fd = os.open(f"/proc/self/fd/{ref}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        return f"cannot open the client's memfd here ({e.strerror})"
    finally:
        os.close(ref)
    try:
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            return ("the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | "
                    "F_SEAL_SEAL): its owner could truncate it under the server")
        if _fs_type(fd) != TMPFS_MAGIC:
            return "the memfd is not plain shared memory (hugetlbfs or another file system)"
        actual = os.fstat(fd).st_size
        if actual != size:
            return f"the memfd is {actual} bytes, not the {size} offered"
        view = SharedMapping(fd, size).array()
    except OSError as e:
        return f"cannot map the segment: {e.strerror}"
    finally:
        os.close(fd)
    if view[:NONCE_BYTES].tobytes() != spec["nonce"]:
        return "the segment here holds another nonce (another process of that pid: another pid namespace)"
    return view


def _fs_type(fd: int) -> int:
    """``f_type`` of ``fstatfs(fd)`` (os has no fstatfs): the first field of struct statfs,
    a C long on Linux."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], sys.byteorder)
