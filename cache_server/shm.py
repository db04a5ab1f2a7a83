"""Same-host fast path of glm-cache-server: payload bytes through shared memory.

How a client and the server agree (``hello``, or ``shm_attach`` for another segment):

1. The client creates a file ``/dev/shm/glmcache-<pid>-<random>`` (mode 0600, created
   exclusively), reserves its pages with ``posix_fallocate`` (a full tmpfs is an error now,
   not a SIGBUS later), maps it, and writes a random 16-byte nonce at offset 0. It sends the
   path, the size, the nonce and this host's boot id.
2. The server agrees only if its boot id is the same, the path is a plain ``glmcache-*``
   file directly in ``/dev/shm`` of exactly that size, and the nonce it reads there is the
   client's: then both really map the same memory (two containers on one host share a boot
   id but not their /dev/shm; the nonce tells them apart). It answers a random segment id.
3. Whatever the answer, the client unlinks the file as soon as the reply is in: from then on
   the memory lives exactly as long as the two mappings, so nothing is ever left behind in
   /dev/shm, even when a client or the server is killed.

Payloads live at or after :data:`DATA_OFFSET` (the first page holds the nonce). A ``get``
names a region of a segment; the server copies found objects into it and answers their
offsets (an object that does not fit comes as a frame, as over TCP). A ``put`` names
where each payload lies; the server copies them out into its store. One client sends one
request at a time (its lock), and a client abandons its segments after a timeout (the
server may still be writing into them), so a region is never written by two requests.

The server's own copy of a put payload is made here too (:func:`owned_copy`): the client
reuses its segment as soon as the put is answered.

The server drops a mapping on ``shm_detach`` (a client closing), after
:data:`IDLE_DROP_S` without use (a client that died), or the least recently used one when
it holds :data:`MAX_SEGMENTS`. A request naming a dropped segment gets ``shm_unknown``; the
client then attaches a new one and repeats the request.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_server import protocol as p

SHM_DIR = "/dev/shm"
NAME_PREFIX = "glmcache-"
NONCE_BYTES = 16
DATA_OFFSET = 4096  # payloads start on the second page; the first holds the nonce
ALIGN = 64  # objects in a get region start on cache-line boundaries
IDLE_DROP_S = 300.0
MAX_SEGMENTS = 1024
MAX_SEGMENT_BYTES = 1 << 40  # refuse absurd sizes (a mapping costs nothing until touched, but still)
_NAME_RE = re.compile(r"^glmcache-[A-Za-z0-9_-]{1,80}$")


def boot_id() -> str | None:
    """This host's boot id (one per kernel boot, shared by every container on the host), or
    None where it cannot be read (then no shared memory is offered or accepted)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ClientSegment:
    """One client-created shared-memory segment (see the module docstring)."""

    def __init__(self, size: int) -> None:
        if size <= DATA_OFFSET:
            raise ValueError(f"segment size must exceed {DATA_OFFSET}, got {size}")
        self.size = size
        self.path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.seg_id: int | None = None  # the server's id once attached
        self.busy = False  # a get's views into it are alive, or a request is using it
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.mm[:NONCE_BYTES] = self.nonce
        self.view: Any = np.frombuffer(self.mm, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return self.size - DATA_OFFSET

    def describe(self, host: str) -> dict[str, Any]:
        """The ``shm`` map of ``hello`` / ``shm_attach``."""
        return {"boot": host, "path": self.path, "size": self.size, "nonce": self.nonce}

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink and unmap; the mapping stays while views of a get are still alive (it
        goes with the last of them)."""
        self.unlink()
        self.view = None
        try:
            self.mm.close()
        except BufferError:  # views still exported: the mmap is freed with them
            pass


@dataclass
class _Mapped:
    mm: mmap.mmap
    size: int
    last_used: float
    view: Any = field(default=None)  # numpy uint8 view over the whole mapping


class SegmentTable:
    """The server's mapped client segments, by id. Thread-safe."""

    def __init__(self, enabled: bool, idle_drop_s: float = IDLE_DROP_S, max_segments: int = MAX_SEGMENTS) -> None:
        self.enabled = enabled
        self.idle_drop_s = idle_drop_s
        self.max_segments = max_segments
        self.host = boot_id() if enabled else None
        self._lock = threading.Lock()
        self._segments: OrderedDict[int, _Mapped] = OrderedDict()
        self.attached_total = 0
        self.refused_total = 0
        self.get_bytes = 0  # payload bytes served into segments
        self.put_bytes = 0  # payload bytes taken from segments

    def count(self, get_bytes: int = 0, put_bytes: int = 0) -> None:
        with self._lock:
            self.get_bytes += get_bytes
            self.put_bytes += put_bytes

    def attach(self, spec: Any) -> dict[str, Any]:
        """Answer a client's offer (the ``shm`` map of hello / shm_attach): ``{"seg": id}``
        when agreed, else ``{"seg": None, "reason": ...}``. Never raises on a bad offer."""
        reason = self._refusal(spec)
        if reason is not None:
            self.refused_total += 1
            return {"seg": None, "reason": reason}
        try:
            fd = os.open(spec["path"], os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            self.refused_total += 1
            return {"seg": None, "reason": f"cannot open the segment here: {e.strerror}"}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != spec["size"]:
                self.refused_total += 1
                return {"seg": None, "reason": "the segment here is not the client's (type or size differ)"}
            mm = mmap.mmap(fd, spec["size"])
        except OSError as e:
            self.refused_total += 1
            return {"seg": None, "reason": f"cannot map the segment: {e.strerror}"}
        finally:
            os.close(fd)
        if mm[:NONCE_BYTES] != spec["nonce"]:
            mm.close()
            self.refused_total += 1
            return {"seg": None, "reason": "the segment here holds another nonce (another /dev/shm)"}
        mapped = _Mapped(mm, spec["size"], time.monotonic(), np.frombuffer(mm, dtype=np.uint8))
        with self._lock:
            seg_id = secrets.randbits(62) + 1
            while seg_id in self._segments:
                seg_id = secrets.randbits(62) + 1
            self._segments[seg_id] = mapped
            while len(self._segments) > self.max_segments:
                self._drop_locked(next(iter(self._segments)))
            self.attached_total += 1
        return {"seg": seg_id}

    def _refusal(self, spec: Any) -> str | None:
        if not self.enabled:
            return "shared memory is off on the server (--no-shm)"
        if self.host is None:
            return "the server cannot read its boot id"
        if not isinstance(spec, dict):
            return "shm must be a map"
        path, size, nonce, host = spec.get("path"), spec.get("size"), spec.get("nonce"), spec.get("boot")
        if not isinstance(host, str) or host != self.host:
            return "another host (boot ids differ)"
        if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR \
                or not _NAME_RE.match(os.path.basename(path)):
            return f"path must be {SHM_DIR}/{NAME_PREFIX}<name>"
        if not isinstance(size, int) or isinstance(size, bool) or not DATA_OFFSET < size <= MAX_SEGMENT_BYTES:
            return "bad segment size"
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return f"nonce must be {NONCE_BYTES} bytes"
        return None

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
        mapped.view = None
        try:
            mapped.mm.close()
        except BufferError:  # a request still copies through it: unmapped when it is done
            pass
        return True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled and self.host is not None, "segments": len(self._segments),
                    "mapped_bytes": sum(m.size for m in self._segments.values()),
                    "attached_total": self.attached_total, "refused_total": self.refused_total,
                    "get_bytes": self.get_bytes, "put_bytes": self.put_bytes}

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


def request_span(view: np.ndarray, off: Any, n: Any, what: str) -> tuple[int, int]:
    """``(off, n)`` of a request, checked to lie in the data part of the segment ``view``."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, n)) or off < DATA_OFFSET \
            or n < 0 or off + n > view.nbytes:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                              f"{what} must lie within the segment, at or after byte {DATA_OFFSET}")
    return off, n


class GetRegion:
    """The region of a segment a ``get`` names: found objects are copied in, in order, each
    on an :data:`ALIGN` boundary, while they fit."""

    def __init__(self, segments: SegmentTable, spec: Any) -> None:
        self.view = segments.request_view(spec)
        self.cursor, length = request_span(self.view, spec.get("off"), spec.get("len"), "the get region")
        self.end = self.cursor + length
        self.copied = 0  # payload bytes placed

    def place(self, payload: bytes | memoryview) -> list[int] | None:
        """Copy ``payload`` in and answer ``[offset, length]``; None if it does not fit."""
        n = memoryview(payload).nbytes
        if self.cursor + n > self.end:
            return None
        if n:  # numpy copies without the GIL
            np.copyto(self.view[self.cursor:self.cursor + n], np.frombuffer(payload, dtype=np.uint8))
        place = [self.cursor, n]
        self.cursor = align_up(self.cursor + n)
        self.copied += n
        return place


def put_spans(view: np.ndarray, at: Any, keys: int) -> list[tuple[int, int]]:
    """Where a put's ``keys`` payloads lie in ``view``, from its ``shm.at``: offset then
    length per key, little-endian uint64s in one bin. Not arrays of small integers: those
    spend an element every few header bytes, which the header bound
    (``protocol.unpack_header``) refuses for a put of more than a few dozen objects."""
    if not isinstance(at, bytes) or len(at) != 16 * keys:
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                              "shm.at must be 16 bytes per key: offset and length, uint64 little-endian")
    pairs = np.frombuffer(at, dtype="<u8").reshape(-1, 2).tolist()
    return [request_span(view, off, n, f"shm.at[{i}]") for i, (off, n) in enumerate(pairs)]


class SizedSpan:
    """Stands for a payload in shared memory where only its size is checked."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


_POPULATED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
OWN_MAPPING_BYTES = 1 << 20


def owned_copy(src: np.ndarray) -> memoryview:
    """The store's own copy of a payload a client left in shared memory.

    A large one gets its own pre-faulted anonymous mapping (freed with the object). Not
    ``np.empty``: numpy asks for transparent huge pages on large arrays, and once the
    kernel has no free huge pages each allocation waits on memory compaction: measured
    here, 4 ms per 40 MB copy while they last, then 120-870 ms, against 15-25 ms for a
    pre-faulted mapping (MAP_POPULATE faults every page in one call). libc would give a
    mapping of its own too, past the server's mmap threshold (``cli``)."""
    n = src.nbytes
    if n < OWN_MAPPING_BYTES:
        return memoryview(src.tobytes())
    buf = mmap.mmap(-1, n, flags=_POPULATED)
    np.copyto(np.frombuffer(buf, dtype=np.uint8), src)  # without the GIL
    return memoryview(buf)
