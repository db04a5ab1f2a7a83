"""The server's arena (cache_server.arena) against a real glm-cache-server process: reloads
read in place are the stored bytes, verified once (by the server as it places them: a put
whose checksum does not match its bytes lands unchecked, and the reader verifies it), a
corrupted arena object fails its checksum and is deleted, read pins keep a range from reuse until released or expired, no client can write
into or resize the arena, a full arena stores and serves by copy, and hostile get and
unpin headers get clear errors."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cache_server.arena import MIN_ARENA_BYTES, NAME_PREFIX, pack_pins
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from testing.server_process import ServerProcess

NS = "arena-test"
MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _key(i: int, tag: int = 0) -> tuple[bytes, int, int]:
    return (bytes([tag]) * 16 + i.to_bytes(16, "big"), 0, 0)


def _payload(i: int, n: int = MIB) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def _arena_fd(pid: int) -> str:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{NAME_PREFIX}"):
                return f"/proc/{pid}/fd/{fd}"
        except OSError:
            pass
    raise AssertionError("the server holds no arena memfd")


def _arena_stats(client: CacheClient) -> dict:
    return client.stats()["shm"]["arena"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--l1-size-gb", "0.25", "--debug-fault-hooks") as srv:
        yield srv


@pytest.fixture()
def small():
    """About 4 MiB of L1 (and of arena): four 1 MiB objects fill it."""
    with ServerProcess("--l1-size-gb", "0.004") as srv:
        yield srv


def test_a_reload_in_place_is_the_stored_bytes_verified_once_by_the_server(server):
    big, small, other = _payload(1, 3 * MIB + 5), _payload(2, MIN_ARENA_BYTES - 1), _payload(3, MIN_ARENA_BYTES)
    keys = [_key(1), _key(2), _key(3), _key(4)]  # the last is absent
    with CacheClient(server.url) as c:
        c.hello(NS, 16)
        assert c.put(NS, [(*keys[0], big), (*keys[1], small), (*keys[2], other)]) == ["stored"] * 3
        got = c.get_in_place(NS, keys)
        assert got.pin and time.monotonic() < got.deadline < time.monotonic() + 30
        # the arena's two were verified as the server placed them, the small one by copy here
        assert got.unverified == [None] * 4
        assert bytes(got.payloads[0]) == big and bytes(got.payloads[1]) == small and bytes(got.payloads[2]) == other
        assert got.payloads[3] is None
        assert got.payloads[0].readonly and got.payloads[2].readonly  # read-only mappings of the server's arena
        assert not got.payloads[1].readonly  # copied to us
        assert _arena_stats(c)["pins"] == 1
        c.release_pin(got.pin)
        assert c.unpin() == 1
        assert _arena_stats(c)["pins"] == 0
        assert c.get(NS, keys) == [big, small, other, None]  # plain gets copy out of the arena
    with CacheClient(server.url, shm=False) as c:  # and over TCP (frames from the arena)
        assert c.get(NS, keys) == [big, small, other, None]
        got = c.get_in_place(NS, keys)
        assert got.pin is None and got.unverified == [None] * 4 and bytes(got.payloads[0]) == big


def test_a_put_whose_checksum_lies_lands_unchecked_and_its_reader_finds_it(server, monkeypatch):
    """The server verifies an arena object as it places it; one whose bytes do not match the
    checksum it came with (a client's bug, bytes changed on the way) is stored all the
    same, not marked checked: the reader verifies it in the copy, fails it and deletes it."""
    from cache_server import protocol

    key, data = _key(12), _payload(12, 2 * MIB)
    with CacheClient(server.url) as c:
        c.hello(NS, 16)
        real = protocol.checksum
        monkeypatch.setattr(protocol, "checksum", lambda v, ns, k: real(bytes(v)[:-1] + b"?", ns, k))
        assert c.put(NS, [(*key, data)]) == ["stored"]
        monkeypatch.setattr(protocol, "checksum", real)
        got = c.get_in_place(NS, [key])
        assert got.pin and got.payloads[0].readonly and got.unverified[0] is not None
        pages = _pages(2 * MIB)
        assert pages.write_verified(0, [0], got.payloads[0], *got.unverified[0]) is False
        c.release_pin(got.pin)
        c.delete_corrupt(NS, [key])
        assert c.get(NS, [key]) == [None]


def test_a_corrupted_arena_object_fails_its_checksum_in_the_copy_and_is_deleted(server):
    key, data = _key(10), _payload(10, 2 * MIB)
    with CacheClient(server.url) as c:
        c.hello(NS, 16)
        assert c.put(NS, [(*key, data)]) == ["stored"]
        assert c.request({"op": "debug_corrupt", "ns": NS, "keys": [list(key)], "offset": 12345})[0]["corrupted"]
        got = c.get_in_place(NS, [key])
        assert got.unverified[0] is not None  # still in the arena: flipped in place
        view = got.payloads[0]
        assert view[12345] == data[12345] ^ 0xFF
        pages = _pages(2 * MIB)
        assert pages.write_verified(0, [0], view, *got.unverified[0]) is False
        c.delete_corrupt(NS, [key])
        assert c.corrupt_objects == 1 and c.get(NS, [key]) == [None]
        # An intact object passes, and lands byte for byte.
        key2, data2 = _key(11), _payload(11, 2 * MIB)
        assert c.put(NS, [(*key2, data2)]) == ["stored"]
        got = c.get_in_place(NS, [key2])
        assert got.unverified[0] is None  # checked by the server as it was placed
        pages.write(0, [0], got.payloads[0])
        assert pages.read(0, [0]) == data2


def _pages(nbytes: int):
    """A one-group, two-layer paged cache whose one-block object is ``nbytes``."""
    from connector.geometry import CacheGroup, LayerPage
    from connector.kv_pages import PagedKVCache

    vkv = pytest.importorskip("vllm.v1.kv_cache_interface")
    page, blocks = nbytes // 2, 2
    size = 2 * blocks * page
    t = vkv.KVCacheTensor(size=size, layers=["l.0", "l.1"], layer_stride=blocks * page, block_stride=page, offset=0)
    config = vkv.KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[t], kv_cache_groups=[])
    buf = torch.zeros(size, dtype=torch.uint8)
    views = {f"l.{i}": torch.as_strided(buf, (blocks, page), (page, 1), i * blocks * page) for i in range(2)}
    group = CacheGroup(0, False, 16, tuple(LayerPage(f"l.{i}", page, "uint8", 16, 16, "FullAttentionSpec")
                                          for i in range(2)))
    return PagedKVCache(views, config, (group,))


def test_a_pin_keeps_a_deleted_objects_range_until_released_and_a_full_arena_serves_by_copy(small):
    a, rest = _payload(20), [_payload(21 + i) for i in range(4)]
    with CacheClient(small.url) as c:
        c.hello(NS, 16)
        assert c.put(NS, [(*_key(20), a)]) == ["stored"]
        got = c.get_in_place(NS, [_key(20)])
        view, pin = got.payloads[0], got.pin
        assert pin and view.readonly
        assert c.delete(NS, [_key(20)]) == 1  # gone from the store; its range is pinned
        for i, data in enumerate(rest):  # the store has room for four; the arena for three besides A
            assert c.put(NS, [(*_key(21 + i), data)]) == ["stored"]
        assert bytes(view) == a  # nothing was written over the pinned range
        stats = _arena_stats(c)
        assert stats["full_total"] >= 1 and stats["pins"] == 1
        # The one that did not fit is stored all the same, and served by copy (verified here).
        got_all = c.get_in_place(NS, [_key(21 + i) for i in range(4)])
        assert [bytes(x) for x in got_all.payloads] == rest
        assert sum(not x.readonly for x in got_all.payloads) >= 1
        c.release_pin(got_all.pin)
        c.release_pin(pin)
        assert c.unpin() == 2
        # Released: the range is reused by the next object that needs it.
        assert c.delete(NS, [_key(21 + i) for i in range(4)]) == 4
        fresh = _payload(30)
        assert c.put(NS, [(*_key(30), fresh)]) == ["stored"]
        assert bytes(view) == fresh  # the old view now shows the new object: why a copy must end under its pin


def test_an_expired_pin_frees_its_range(small):
    a, b = _payload(40), _payload(41)
    with CacheClient(small.url) as c:
        c.hello(NS, 16)
        assert c.put(NS, [(*_key(40), a)]) == ["stored"]
        got = c.get_in_place(NS, [_key(40)], pin_s=1.0)
        assert got.deadline < time.monotonic() + 1.0  # the client's deadline is earlier than the server's
        assert c.delete(NS, [_key(40)]) == 1
        # the housekeeping loop drops pins past their deadline every second: poll for it
        deadline = time.monotonic() + 60
        while (stats := _arena_stats(c))["pins"] != 0:
            assert time.monotonic() < deadline, f"the expired pin was never dropped: {stats}"
            time.sleep(0.05)
        assert stats["pins"] == 0 and stats["expired_total"] == 1
        assert c.put(NS, [(*_key(41), b)]) == ["stored"]
        assert bytes(got.payloads[0]) == b


def test_no_client_can_write_into_or_resize_the_arena_and_the_server_keeps_serving(server):
    key, data = _key(50), _payload(50)
    with CacheClient(server.url) as c:
        c.hello(NS, 16)
        assert c.put(NS, [(*key, data)]) == ["stored"]
        path = _arena_fd(server.proc.pid)
        fd = os.open(path, os.O_RDWR)  # opening is allowed (same user); nothing done through it is
        try:
            size = os.fstat(fd).st_size
            with pytest.raises(PermissionError):
                os.write(fd, b"x")
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 8192)
            for new in (0, size // 2, size + mmap.PAGESIZE):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, new)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            assert _libc.fallocate(fd, 3, 0, mmap.PAGESIZE) == -1  # FALLOC_FL_PUNCH_HOLE | KEEP_SIZE
            assert ctypes.get_errno() == errno.EPERM
            ro = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            addr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
            _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            assert _libc.mprotect(addr, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == -1
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
        got = c.get_in_place(NS, [key])
        assert bytes(got.payloads[0]) == data and got.unverified[0] is None
        c.release_pin(got.pin)
        c.unpin()
    # A client cannot pass the arena off as its own segment either.
    offer = SimpleNamespace(pid=server.proc.pid, fd=int(path.rsplit("/", 1)[1]))
    with CacheClient(server.url, shm=False) as c:
        from cache_server.shm import boot_id

        reply, _ = c.request({"op": "shm_attach", "shm": {"boot": boot_id(), "pid": offer.pid, "fd": offer.fd,
                                                           "size": size, "nonce": bytes(16)}})
        assert reply["shm"]["seg"] is None and "not a glmcache memfd" in reply["shm"]["reason"]
        assert c.get(NS, [key]) == [data]


@pytest.mark.parametrize("header, code, words", [
    ({"arena": "yes"}, "bad_request", "arena"),
    ({"arena": 1}, "bad_request", "arena"),
    ({"arena": True, "no_shm": True}, "bad_request", "shm region"),
    ({"arena": True, "pin_s": -1}, "bad_request", "pin_s"),
    ({"arena": True, "pin_s": 0}, "bad_request", "pin_s"),
    ({"arena": True, "pin_s": float("nan")}, "bad_request", "pin_s"),
    ({"arena": True, "pin_s": float("inf")}, "bad_request", "pin_s"),
    ({"arena": True, "pin_s": "30"}, "bad_request", "pin_s"),
    ({"arena": True, "pin_s": True}, "bad_request", "pin_s"),
    ({"unpin": 5}, "bad_request", "unpin"),
    ({"unpin": [1]}, "bad_request", "unpin"),
    ({"unpin": "12345678"}, "bad_request", "unpin"),
    ({"unpin": b"1234567"}, "bad_request", "unpin"),
    ({"unpin": bytes(8 * 1025)}, "too_large", "unpin"),
])
def test_hostile_get_headers_get_a_clear_error(server, header, code, words):
    with CacheClient(server.url) as c:
        c.hello(NS, 16)
        seg = c._segments[0]
        h = {"op": "get", "ns": NS, "keys": [list(_key(1))], **header}
        if not h.pop("no_shm", False):
            h["shm"] = {"seg": seg.seg_id, "off": 4096, "len": seg.capacity}
        with pytest.raises(CacheServerError) as e:
            c.request(h)
        assert e.value.code == code and words in e.value.message
        c.ping()


@pytest.mark.parametrize("pins, code", [(5, "bad_request"), ([1], "bad_request"), (b"\x01" * 9, "bad_request"),
                                        (bytes(8 * 1025), "too_large"), ({"1": 1}, "bad_request")])
def test_hostile_unpin_gets_a_clear_error(server, pins, code):
    with CacheClient(server.url, shm=False) as c:
        with pytest.raises(CacheServerError) as e:
            c.request({"op": "unpin", "pins": pins})
        assert e.value.code == code and "pins" in e.value.message
        with pytest.raises(CacheServerError):
            c.request({"op": "unpin"})


def test_a_huge_pin_s_is_bounded_and_another_connection_cannot_release_a_pin(server):
    key, data = _key(60), _payload(60)
    with CacheClient(server.url) as owner, CacheClient(server.url) as other:
        owner.hello(NS, 16)
        other.hello(NS, 16)
        assert owner.put(NS, [(*key, data)]) == ["stored"]
        seg = owner._segments[0]
        reply, _ = owner.request({"op": "get", "ns": NS, "keys": [list(key)], "arena": True, "pin_s": 1e308,
                                  "shm": {"seg": seg.seg_id, "off": 4096, "len": seg.capacity}})
        assert reply["pin_s"] == 60.0 and reply["pin"]
        pins = pack_pins([reply["pin"]])
        assert other.request({"op": "unpin", "pins": pins})[0]["unpinned"] == 0
        assert _arena_stats(owner)["refused_release_total"] >= 1
        assert owner.request({"op": "unpin", "pins": pack_pins([0, 1, 2 ** 64 - 1])})[0]["unpinned"] == 0  # unknown
        assert owner.request({"op": "unpin", "pins": pins})[0]["unpinned"] == 1
        assert owner.request({"op": "unpin", "pins": pins})[0]["unpinned"] == 0  # once


PAGE = 128 << 10  # per layer per block: a chunk of two blocks and two layers is a 512 KiB object
BLOCKS = 16


def _arena_worker(url: str):
    """A WorkerSide over one attention group of two layers (objects big enough for the arena)."""
    from connector.config import Settings
    from connector.geometry import CacheGroup, Geometry, LayerPage
    from connector.worker import WorkerSide

    vkv = pytest.importorskip("vllm.v1.kv_cache_interface")
    size = 2 * BLOCKS * PAGE
    t = vkv.KVCacheTensor(size=size, layers=["a.0", "a.1"], layer_stride=BLOCKS * PAGE, block_stride=PAGE, offset=0)
    config = vkv.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[t], kv_cache_groups=[])
    buf = torch.zeros(size, dtype=torch.uint8)
    views = {f"a.{i}": torch.as_strided(buf, (BLOCKS, PAGE), (PAGE, 1), i * BLOCKS * PAGE) for i in range(2)}
    group = CacheGroup(0, False, 16, tuple(LayerPage(f"a.{i}", PAGE, "uint8", 16, 16, "FullAttentionSpec")
                                          for i in range(2)))
    geo = Geometry((group,), (16,), 16, 32)
    w = WorkerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), config,
                   Settings(url=url, batch_bytes=3 * 4 * PAGE), geo, None)
    w.register_kv_caches(views)
    return w


def test_a_worker_load_reads_the_arena_in_place_and_a_corrupt_object_fails_it(server):
    from connector.metadata import GlmConnectorMetadata, LoadJob, ObjectMove
    from testing.worker_loads import wait_load

    ns, chunks = f"{NS}-worker", 5
    objs = [_payload(100 + k, 4 * PAGE) for k in range(chunks)]
    keys = [_key(100 + k, 1) for k in range(chunks)]
    with CacheClient(server.url) as c:
        c.hello(ns, 16)
        assert c.put(ns, [(*key, data) for key, data in zip(keys, objs)]) == ["stored"] * chunks
        before, pins_before = _arena_stats(c)["granted_total"], _arena_stats(c)["pins"]
    w = _arena_worker(server.url)
    try:
        moves = [ObjectMove(keys[k][0], 0, [2 * k, 2 * k + 1]) for k in range(chunks)]
        w.start_load_kv(GlmConnectorMetadata(namespace=ns, loads=[LoadJob("r-ok", moves)]))
        assert wait_load(w, "r-ok")
        for k in range(chunks):  # layer-major object: layer 0's two pages, then layer 1's
            assert w._pages.read(0, [2 * k, 2 * k + 1]) == objs[k]
        with CacheClient(server.url) as c:
            stats = _arena_stats(c)
            assert stats["granted_total"] - before == 2  # two batches, each read in place under a pin
            assert stats["pins"] == pins_before  # handed back at the end of the load
            assert c.request({"op": "debug_corrupt", "ns": ns, "keys": [list(keys[3])], "offset": 7})[0]["corrupted"]
        w.start_load_kv(GlmConnectorMetadata(namespace=ns, loads=[LoadJob("r-bad", moves)]))
        assert wait_load(w, "r-bad") is False  # vLLM recomputes
        assert w.stats["load_corrupt_objects"] == 1 and w._load_client.corrupt_objects == 1
        with CacheClient(server.url) as c:
            assert c.get(ns, [keys[3]]) == [None]  # deleted with reason checksum
            assert c.get(ns, [keys[2]]) == [objs[2]]
    finally:
        w.shutdown()


def test_write_verified_with_a_concurrent_hash_lands_the_bytes_and_catches_a_flip():
    from concurrent.futures import ThreadPoolExecutor

    from cache_server import protocol
    from connector.kv_pages import glibc_non_temporal_threshold

    assert glibc_non_temporal_threshold({}) is None
    assert glibc_non_temporal_threshold({"GLIBC_TUNABLES": "glibc.malloc.x=1:glibc.cpu.x86_non_temporal_threshold=0x40000"}) \
        == 0x40000
    assert glibc_non_temporal_threshold({"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=lots"}) is None
    pages, key, data = _pages(2 * MIB), _key(70), _payload(70, 2 * MIB)
    prefix, good = protocol.key_prefix(NS, key), protocol.checksum(data, NS, key)
    with ThreadPoolExecutor(1) as hasher:
        assert pages.write_verified(0, [1], memoryview(data), prefix, good, hasher=hasher)
        assert pages.read(0, [1]) == data
        bad = bytearray(data)
        bad[MIB + 3] ^= 1
        assert not pages.write_verified(0, [0], memoryview(bytes(bad)), prefix, good, hasher=hasher)
        assert not pages.write_verified(0, [0], memoryview(data), prefix, protocol.checksum(data, NS, _key(71)),
                                        hasher=hasher)  # another key's checksum


def test_an_arena_named_as_a_fifo_or_a_device_is_refused_without_blocking(tmp_path):
    """The client trusts no path a server names: a FIFO with no writer (an open to read would
    block the engine's thread, client lock held, outside every timeout) and a character
    device are refused as not a file, at once."""
    import threading

    from cache_server.arena import NONCE_BYTES, map_arena

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # ours: no writer, so a plain open to read blocks
    device = os.open("/dev/null", os.O_RDONLY)
    try:
        for fd in (reader, device):
            spec = {"pid": os.getpid(), "fd": fd, "size": MIN_ARENA_BYTES, "nonce": bytes(NONCE_BYTES)}
            out: list = []
            t = threading.Thread(target=lambda: out.append(map_arena(spec)), daemon=True)
            t.start()
            t.join(60)  # a generous bound: a hang fails, a slow machine does not
            assert out == [(None, "the server named something other than a file as its arena")]
    finally:
        os.close(reader)
        os.close(device)


_PIN_HOLDER = """
import sys, time
from cache_server.client import CacheClient
c = CacheClient(sys.argv[1])
c.hello(sys.argv[2], 16)
got = c.get_in_place(sys.argv[2], [(bytes.fromhex(sys.argv[3]), 0, 0)], pin_s=60)
print("pinned" if got.pin else "copied", flush=True)
time.sleep(600)
"""


def test_pins_are_capped_per_process_and_go_with_a_process_that_exits(server):
    """Two connections of this process hold what pins they can: together at most the
    per-client cap (it counts a process, not a connection), while another process still
    gets a pin; that process killed, its pin is dropped for it (not left to expire)."""
    import subprocess
    import sys

    from cache_server.arena import MAX_PINS_PER_OWNER

    n = 40  # per connection: two connections want 80 pins, over the cap of 64
    keys = [_key(i, tag=7) for i in range(n + 1)]
    with CacheClient(server.url) as a, CacheClient(server.url) as b:
        a.hello(NS, 16)
        b.hello(NS, 16)
        for i, key in enumerate(keys):
            assert a.put(NS, [(*key, _payload(i, 256 << 10))]) == ["stored"]
        before = _arena_stats(a)
        got = [c.get_in_place(NS, [key], pin_s=60) for c in (a, b) for key in keys[:n]]
        assert sum(bool(g.pin) for g in got) == MAX_PINS_PER_OWNER - before["pins"]
        assert _arena_stats(a)["pins"] == MAX_PINS_PER_OWNER
        holder = subprocess.Popen([sys.executable, "-c", _PIN_HOLDER, server.url, NS, keys[n][0].hex()],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "pinned"  # another process: pins left for it
            assert _arena_stats(a)["pins"] == MAX_PINS_PER_OWNER + 1
        finally:
            holder.kill()
            holder.wait(60)
        deadline = time.monotonic() + 120  # the housekeeping loop checks its clients' processes every second
        while (stats := _arena_stats(a))["pins"] != MAX_PINS_PER_OWNER:
            assert time.monotonic() < deadline, f"the exited process's pin stayed: {stats}"
            time.sleep(0.05)
        assert stats["dropped_total"] == before["dropped_total"] + 1 and stats["expired_total"] == before["expired_total"]
        for g in got:
            if g.pin:
                a.release_pin(g.pin) if g in got[:n] else b.release_pin(g.pin)
        a.unpin()
        b.unpin()


def test_the_arena_warns_of_same_user_readers_and_no_arena_serves_by_copy():
    """The arena's readers are the host's user: a server with an arena names, at start-up,
    another process of its user running beside it (here a sibling the test started); with
    --no-arena it keeps none, says why, and a same-host get comes by copy, unpinned."""
    import subprocess
    import sys

    from cache_server.arena import same_user_processes

    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert f"python[{sibling.pid}]" not in same_user_processes()  # our own child: related
        with ServerProcess("--l1-size-gb", "0.05") as srv:
            assert "can be read by every process of uid" in srv.log()  # the sibling at least
        with ServerProcess("--l1-size-gb", "0.05", "--no-arena") as srv, CacheClient(srv.url) as c:
            assert "no arena (--no-arena)" in srv.log() and "can be read by every process" not in srv.log()
            c.hello(NS, 16)
            data = _payload(70)
            assert c.put(NS, [(*_key(70), data)]) == ["stored"]
            got = c.get_in_place(NS, [_key(70)])
            assert [bytes(x) for x in got.payloads] == [data] and not got.pin
            assert "arena" not in c.stats()["shm"]
    finally:
        sibling.kill()
        sibling.wait(60)
