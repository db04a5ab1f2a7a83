"""A same-host client that misbehaves with its shared memory cannot hurt glm-cache-server
(a real server process): a segment it could shrink is never mapped (a truncated mapping
would kill the server with SIGBUS, and every engine's objects with it), offers past the
server's bounds are refused before anything is mapped, and client timeouts leave no
segment mapped on the server."""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets

import numpy as np
import pytest

from cache_server import protocol as p
from cache_server import shm as shm_mod
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.shm import (
    DATA_OFFSET,
    MAX_BYTES_PER_CLIENT,
    MAX_SEGMENTS,
    MAX_SEGMENTS_PER_CLIENT,
    NONCE_BYTES,
    SEALS,
    boot_id,
    segment_id,
)
from testing.server_process import ServerProcess

NS = "shm-hostile"
SEG = 2 << 20


def _key(i: int, tag: int) -> tuple[bytes, int, int]:
    return (bytes([tag]) * 16 + i.to_bytes(16, "big"), 0, 0)


def _status(server: ServerProcess) -> dict:
    return server.status()["shm"]


class Memfd:
    """A segment made by hand, as a hostile client would: a memfd of ``size`` bytes with
    ``seals`` (none: unsealed), offered as ``offered`` bytes, the nonce at offset 0."""

    def __init__(self, size: int = SEG, seals: int = SEALS, offered: int | None = None) -> None:
        self.fd = os.memfd_create(f"glmcache-{os.getpid()}-{secrets.token_hex(8)}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.mm[:NONCE_BYTES] = self.nonce
        if seals:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        self.size = size
        self.offered = size if offered is None else offered
        self.seg = segment_id(self.nonce)  # what the server would answer, answer or not

    def offer(self) -> dict:
        return {"boot": boot_id(), "pid": os.getpid(), "fd": self.fd, "size": self.offered, "nonce": self.nonce}

    def close(self) -> None:
        os.close(self.fd)
        self.mm.close()


def _attach(client: CacheClient, seg: Memfd) -> dict:
    return client.request({"op": "shm_attach", "shm": seg.offer()})[0]["shm"]


def _put_through(client: CacheClient, seg: int, key: tuple[bytes, int, int], off: int, n: int) -> None:
    client.request({"op": "put", "ns": NS, "keys": [list(key)], "sums": [p.checksum(b"\0" * n, NS, key)],
                    "shm": {"seg": seg, "at": np.asarray([off, n], dtype="<u8").tobytes()}})


def _get_into(client: CacheClient, seg: int, key: tuple[bytes, int, int], off: int, n: int) -> dict:
    return client.request({"op": "get", "ns": NS, "keys": [list(key)], "shm": {"seg": seg, "off": off, "len": n}})[0]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--l1-size-gb", "0.25") as srv:
        yield srv


@pytest.fixture(scope="module")
def victim(server):
    """Another engine's client and object, stored before any hostile client shows up."""
    payload = os.urandom(3 << 20)
    with CacheClient(server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        assert client.transport == "shm"
        assert client.put(NS, [(*_key(1, 0xEE), payload)]) == ["stored"]
        yield client, payload


def _assert_still_serving(server: ServerProcess, victim) -> None:
    client, payload = victim
    assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode})"
    got = client.get(NS, [_key(1, 0xEE)])[0]
    assert got is not None and bytes(got) == payload
    with CacheClient(server.url, timeout_s=10) as other:  # and a new client is served too
        other.hello(NS, 16)
        assert other.transport == "shm"
        assert bytes(other.get(NS, [_key(1, 0xEE)])[0]) == payload


@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL], ids=["unsealed", "no-shrink-seal"])
@pytest.mark.parametrize("truncate_to", [0, SEG // 2], ids=["to-0", "to-half"])
def test_a_client_that_truncates_an_unsealed_segment_cannot_kill_the_server(server, victim, seals, truncate_to):
    """The measured crash: a client maps a segment, the server maps it too, the client
    truncates it and names it in a put or a get: the server's copy touched pages that no
    longer exist and died of SIGBUS. Such a segment must never be mapped."""
    seg = Memfd(seals=seals)
    key = _key(truncate_to, 0x11 + seals)
    with CacheClient(server.url, timeout_s=5, shm=False) as hostile:
        before = _status(server)
        answer = _attach(hostile, seg)
        hostile.put(NS, [(*key, b"\0" * 4096)])  # an object for the get to copy into what is gone
        os.ftruncate(seg.fd, truncate_to)
        named = answer["seg"] or seg.seg
        errors = []
        for send in (lambda: _put_through(hostile, named, _key(99, 0x11), SEG - (256 << 10), 128 << 10),
                     lambda: _get_into(hostile, named, key, SEG - (256 << 10), 128 << 10)):
            with pytest.raises((CacheServerError, CacheServerUnavailable)) as e:  # payload or region in what is gone
                send()
            errors.append(e.value)
        assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode})"
        assert [getattr(e, "code", e) for e in errors] == ["shm_unknown", "shm_unknown"]
        assert answer["seg"] is None and "not sealed" in answer["reason"]
        after = _status(server)
        assert after["segments"] == before["segments"] and after["refused_total"] == before["refused_total"] + 1
    seg.close()
    _assert_still_serving(server, victim)


@pytest.mark.parametrize("offered", [2 * SEG, SEG // 2], ids=["offered-larger", "offered-smaller"])
def test_a_wrongly_sized_segment_is_refused(server, victim, offered):
    """Sealed, but not the size offered: mapping the offered size of a smaller file would
    fault past its end (SIGBUS again)."""
    seg = Memfd(offered=offered)
    with CacheClient(server.url, timeout_s=5, shm=False) as hostile:
        answer = _attach(hostile, seg)
        with pytest.raises((CacheServerError, CacheServerUnavailable)) as e:
            _put_through(hostile, answer["seg"] or seg.seg, _key(offered, 0x12), offered - (64 << 10), 32 << 10)
        assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode})"
        assert getattr(e.value, "code", e.value) == "shm_unknown"
        assert answer["seg"] is None and f"not the {offered} offered" in answer["reason"]
    seg.close()
    _assert_still_serving(server, victim)


def test_a_dev_shm_path_offer_is_refused(server, victim):
    """The old offer (a /dev/shm file the client still controls, the issue's probe: hello
    with a 2 MiB file, ftruncate(fd, 0), one put) is not accepted."""
    path = f"/dev/shm/glmcache-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, SEG)
        nonce = secrets.token_bytes(NONCE_BYTES)
        os.pwrite(fd, nonce, 0)
        with CacheClient(server.url, timeout_s=5, shm=False) as hostile:
            reply, _ = hostile.request({"op": "hello", "v": p.PROTOCOL_VERSION, "ns": NS, "alignment": 16,
                                        "shm": {"boot": boot_id(), "path": path, "size": SEG, "nonce": nonce}})
            os.ftruncate(fd, 0)
            with pytest.raises((CacheServerError, CacheServerUnavailable)) as e:
                _put_through(hostile, reply["shm"]["seg"] or segment_id(nonce), _key(1, 0x13), DATA_OFFSET, 1 << 20)
            assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode})"
            assert getattr(e.value, "code", e.value) == "shm_unknown"
            assert reply["shm"]["seg"] is None and "/dev/shm path is not accepted" in reply["shm"]["reason"]
    finally:
        os.close(fd)
        os.unlink(path)
    _assert_still_serving(server, victim)


def test_a_sealed_segment_stays_whole_and_is_served(server, victim):
    """A client's own segment is sealed: not even its owner can shrink it. A well-formed
    offer is agreed, and puts and gets through it work."""
    own = shm_mod.ClientSegment(SEG)
    for size in (0, SEG // 2):
        with pytest.raises(PermissionError):
            os.ftruncate(own._fd, size)
    own.close()
    seg = Memfd()
    with CacheClient(server.url, timeout_s=5, shm=False) as client:
        assert _attach(client, seg)["seg"] == seg.seg  # (with where the server's arena is: cache_server.arena)
        for size in (0, SEG // 2):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, size)
        payload = os.urandom(1 << 20)
        key = _key(1, 0x14)
        seg.mm[DATA_OFFSET:DATA_OFFSET + len(payload)] = payload
        client.request({"op": "put", "ns": NS, "keys": [list(key)], "sums": [p.checksum(payload, NS, key)],
                        "shm": {"seg": seg.seg, "at": np.asarray([DATA_OFFSET, len(payload)], dtype="<u8").tobytes()}})
        reply = _get_into(client, seg.seg, key, SEG // 2, SEG // 2)
        (off, n), = reply["shm"]
        assert bytes(seg.mm[off:off + n]) == payload
        assert client.request({"op": "shm_detach", "seg": seg.seg})[0]["detached"] is True
    seg.close()
    _assert_still_serving(server, victim)


@pytest.mark.parametrize("lie", ["unsealed", "size"])
def test_the_client_falls_back_to_frames_when_its_segment_is_refused(server, victim, monkeypatch, lie):
    """A client whose segment the server refuses says why and moves payloads as frames."""
    if lie == "unsealed":
        monkeypatch.setattr(shm_mod, "SEALS", fcntl.F_SEAL_GROW)  # the client's seals, not the server's
    else:
        describe = shm_mod.ClientSegment.describe
        monkeypatch.setattr(shm_mod.ClientSegment, "describe", lambda self, host: {**describe(self, host),
                                                                                  "size": self.size + 4096})
    before = _status(server)
    with CacheClient(server.url, timeout_s=10) as client:
        client.hello(NS, 16)
        assert client.transport == "tcp"
        assert ("not sealed" if lie == "unsealed" else "offered") in client.shm_refusal
        payload, key = os.urandom(1 << 20), _key(len(lie), 0x15)
        assert client.put(NS, [(*key, payload)]) == ["stored"]
        got = client.get(NS, [key])[0]
        assert bytes(got) == payload and not isinstance(got.obj, np.ndarray)  # a frame, not a segment view
    after = _status(server)
    assert after["refused_total"] == before["refused_total"] + 1
    assert (after["get_bytes"], after["put_bytes"]) == (before["get_bytes"], before["put_bytes"])
    monkeypatch.undo()
    _assert_still_serving(server, victim)


def test_a_timed_out_offer_is_detached_by_its_id(server):
    """The id of a segment is known without the server's answer: a client whose offer
    timed out after the server mapped it can still detach it."""
    seg = Memfd()
    with CacheClient(server.url, timeout_s=5, shm=False) as client:
        before = _status(server)["segments"]
        client.request({"op": "shm_attach", "shm": seg.offer()})  # the answer, as if it were lost
        assert _status(server)["segments"] == before + 1
        assert client.request({"op": "shm_detach", "seg": seg.seg})[0]["detached"] is True
        assert _status(server)["segments"] == before
    seg.close()


def test_client_timeouts_leave_no_segment_mapped_on_the_server():
    """Each timeout makes the client abandon its segments (the server may still write into
    them) and attach new ones; it detaches the abandoned ones as soon as the server answers
    again, so however many timeouts, the server maps only what the client uses. Real
    timeouts: the server is stopped (SIGSTOP) under a get, a put, and the offer itself."""
    payload = os.urandom(1 << 20)
    with ServerProcess("--l1-size-gb", "0.25") as srv, CacheClient(srv.url, timeout_s=10, shm_bytes=SEG) as client:
        client.put(NS, [(*_key(1, 0x20), payload)])  # a client that never says hello: offers at its first put
        assert client.transport == "shm" and _status(srv)["segments"] == 1
        for i in range(5):
            srv.pause()
            try:
                with pytest.raises(CacheServerUnavailable):
                    if i % 2:
                        client.put(NS, [(*_key(2 + i, 0x20), payload)], timeout_s=0.3)
                    else:
                        client.get(NS, [_key(1, 0x20)], timeout_s=0.3)
            finally:
                srv.resume()
            got = client.get(NS, [_key(1, 0x20)])[0]
            assert bytes(got) == payload and isinstance(got.obj, np.ndarray)  # through a new segment
            del got
            assert _status(srv)["segments"] == len(client._segments) == 1, f"after timeout {i + 1}"
        # The offer itself timing out: the client abandons the segment it offered.
        client._segments[0].busy = True  # make the next get need another segment
        srv.pause()
        try:
            with pytest.raises(CacheServerUnavailable):
                client.get(NS, [_key(1, 0x20)], timeout_s=0.3)
        finally:
            srv.resume()
        assert bytes(client.get(NS, [_key(1, 0x20)])[0]) == payload
        status = _status(srv)
        assert status["segments"] == len(client._segments) == 1 and status["attached_total"] >= 7
        client.close()
        assert _status(srv)["segments"] == 0


def test_an_offer_whose_answer_came_too_late_is_detached():
    """The server mapped an offered segment but its answer came after the client's
    timeout (simulated: the real answer is read, then the call raises as a timeout would):
    the client detaches it by its id at its next request, and offers another."""
    payload = os.urandom(1 << 20)
    with ServerProcess("--l1-size-gb", "0.25") as srv, CacheClient(srv.url, timeout_s=10) as client:
        real = client._send_header_locked

        def late(header, timeout_s):
            reply = real(header, timeout_s)
            if header["op"] == "shm_attach":
                client._reset()  # what a timeout does
                raise CacheServerUnavailable("the answer came too late")
            return reply

        client._send_header_locked = late
        with pytest.raises(CacheServerUnavailable):
            client.put(NS, [(*_key(1, 0x21), payload)])  # never said hello: offers at this put
        assert _status(srv)["segments"] == 1  # mapped there, unknown here
        client._send_header_locked = real
        assert client.put(NS, [(*_key(1, 0x21), payload)]) == ["stored"]
        assert client.transport == "shm"
        assert _status(srv)["segments"] == len(client._segments) == 1


def test_segments_are_bounded_per_client_connection_and_in_total():
    """A connection gets at most MAX_SEGMENTS_PER_CLIENT segments and MAX_BYTES_PER_CLIENT
    bytes mapped, the server MAX_SEGMENTS in all: past a bound an offer is refused, before
    anything is opened, and the segments it has are kept. A mapped segment holds no
    descriptor on the server (a thousand would exhaust a default limit of 1024)."""
    with ServerProcess("--l1-size-gb", "0.25") as srv:
        n_conns = -(-MAX_SEGMENTS // MAX_SEGMENTS_PER_CLIENT) + 1  # one more than it takes to fill the server
        conns = [CacheClient(srv.url, timeout_s=10, shm=False) for _ in range(n_conns)]
        try:
            for c in conns:
                c.ping()  # connected: the server's descriptors now are its sockets'
            fds = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
            first = conns[0]
            segs = [Memfd(8192) for _ in range(MAX_SEGMENTS_PER_CLIENT + 1)]
            answers = [_attach(first, s) for s in segs]
            assert all(a.get("seg") == s.seg for a, s in zip(answers[:-1], segs))
            assert answers[-1]["seg"] is None and "the most the server maps for one" in answers[-1]["reason"]
            assert _status(srv)["segments"] == MAX_SEGMENTS_PER_CLIENT
            # Bytes: one sparse sealed segment larger than a connection's share, on a fresh connection.
            big = Memfd(MAX_BYTES_PER_CLIENT + (1 << 20))
            answer = _attach(conns[1], big)
            assert answer["seg"] is None and f"at most {MAX_BYTES_PER_CLIENT}" in answer["reason"]
            big.close()
            # Detaching one makes room for one again.
            assert first.request({"op": "shm_detach", "seg": segs[0].seg})[0]["detached"] is True
            assert _attach(first, segs[-1])["seg"] == segs[-1].seg
            for s in segs:
                s.close()  # the server keeps its own mappings
            # In total: fill the server from other connections, MAX_SEGMENTS_PER_CLIENT each.
            refused = []
            for conn in conns[1:]:
                for _ in range(MAX_SEGMENTS_PER_CLIENT):
                    s = Memfd(8192)
                    answer = _attach(conn, s)
                    s.close()
                    if answer["seg"] is None:
                        refused.append(answer["reason"])
            status = _status(srv)
            assert status["segments"] == MAX_SEGMENTS
            assert len(os.listdir(f"/proc/{srv.proc.pid}/fd")) < fds + 16
            assert refused and all(f"the server maps {MAX_SEGMENTS} segments" in r for r in refused)
            assert status["limits"] == {"segments": MAX_SEGMENTS, "mapped_bytes": shm_mod.MAX_MAPPED_BYTES,
                                        "segments_per_client": MAX_SEGMENTS_PER_CLIENT,
                                        "bytes_per_client": MAX_BYTES_PER_CLIENT}
            assert srv.proc.poll() is None
        finally:
            for c in conns:
                c.close()


def test_a_client_keeps_to_the_per_client_bound_by_itself(server):
    """A client holding many gets' views (each keeps its segment busy) stops attaching at the
    server's per-connection bound and serves the rest as frames: no offer refused."""
    payload = os.urandom(8192)
    before = _status(server)["refused_total"]
    with CacheClient(server.url, timeout_s=10, shm_bytes=DATA_OFFSET + 16384) as client:
        client.hello(NS, 16)
        client.put(NS, [(*_key(1, 0x30), payload)])
        held = [client.get(NS, [_key(1, 0x30)])[0] for _ in range(MAX_SEGMENTS_PER_CLIENT + 4)]
        assert all(bytes(v) == payload for v in held)
        assert sum(isinstance(v.obj, np.ndarray) for v in held) == MAX_SEGMENTS_PER_CLIENT
        assert len(client._segments) == MAX_SEGMENTS_PER_CLIENT
        del held
    assert _status(server)["refused_total"] == before
