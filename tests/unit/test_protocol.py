"""Protocol helpers: chunk-size negotiation and header validation."""

import msgpack
import pytest

from cache_server import protocol as p
from cache_server.config import ServerConfig
from cache_server.server import CacheServer


@pytest.mark.parametrize("minimum,alignment,chunk", [(256, 1152, 1152), (256, 16, 256), (256, 100, 300), (256, 96, 288),
                                                     (256, 256, 256), (2048, 1152, 2304), (1, 7, 7)])
def test_negotiated_chunk_is_smallest_multiple_of_alignment_at_least_the_minimum(minimum, alignment, chunk):
    assert p.negotiate_chunk_size(minimum, alignment) == chunk


def test_negotiation_rejects_non_positive_values():
    with pytest.raises(ValueError):
        p.negotiate_chunk_size(256, 0)


def test_header_must_be_a_msgpack_map():
    with pytest.raises(p.ProtocolError):
        p.unpack_header(b"\xc1")  # never-used msgpack byte
    with pytest.raises(p.ProtocolError):
        p.unpack_header(msgpack.packb("hello"))
    assert p.unpack_header(msgpack.packb({"op": "ping"})) == {"op": "ping"}


def test_field_validation_rejects_bool_for_int_and_wrong_types():
    with pytest.raises(p.ProtocolError, match="got bool"):
        p.int_field({"n": True}, "n")
    with pytest.raises(p.ProtocolError, match="must be >= 1"):
        p.int_field({"n": 0}, "n", minimum=1)
    with pytest.raises(p.ProtocolError, match="missing"):
        p.field({}, "ns", str)
    assert p.int_field({}, "n", default=3) == 3


def test_handle_answers_every_request_exactly_once_without_raising():
    server = CacheServer(ServerConfig(port=0, http_port=0, l1_size_bytes=1 << 20, max_object_bytes=1 << 10))
    try:
        for frames in ([], [b""], [b"\x93\x01\x02\x03"], [msgpack.packb({"op": "ping", "id": 5})]):
            reply = server.handle(frames)
            assert len(reply) == 1
            header = msgpack.unpackb(reply[0])
            assert set(header) >= {"ok", "id"}
        assert msgpack.unpackb(server.handle([msgpack.packb({"op": "ping", "id": 5})])[0]) == {"ok": True, "id": 5}
    finally:
        server.stop()
        server.serve_forever()


def test_a_slow_answer_is_logged_with_its_op_and_id(monkeypatch, caplog):
    """A request answered after SLOW_REQUEST_S is a warning in the server's log: what its
    client's timeout message ('did not answer') is matched against."""
    import time

    from cache_server import deadlines

    server = CacheServer(ServerConfig(port=0, http_port=0, l1_size_bytes=1 << 20, max_object_bytes=1 << 10))
    monkeypatch.setattr(deadlines, "SLOW_REQUEST_S", 0.05)
    real_ping = server._handlers["ping"]
    monkeypatch.setitem(server._handlers, "ping", lambda h, f: (time.sleep(0.1), real_ping(h, f))[1])
    try:
        with caplog.at_level("WARNING", logger="glm_cache_server"):
            assert msgpack.unpackb(server.handle([msgpack.packb({"op": "ping", "id": 7})])[0])["ok"]
            assert msgpack.unpackb(server.handle([msgpack.packb({"op": "stats", "id": 8})])[0])["ok"]
        slow = [r.getMessage() for r in caplog.records if "to answer" in r.getMessage()]
        assert len(slow) == 1 and slow[0].startswith("'ping' (request 7) took 0.1 s"), slow
    finally:
        server.stop()
        server.serve_forever()
