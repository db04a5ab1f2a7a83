"""Hostile clients against a real glm-cache-server process: well-formed requests that claim
huge counts, sizes and lengths (every count of the protocol is bounded before the server
builds anything from it, and its memory stays flat), a seeded fuzzer over every op, and
leases (random ids, released only by the connection that took them)."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from cache_server import protocol as p
from cache_server.client import CacheClient
from testing.server_process import ServerProcess

NS = "hostile-ns"
MIB = 1 << 20
HEADER_KB = 4096  # room for headers that claim more keys and hashes than the bounds allow
FLAT_MIB = 24  # what the whole hostile batch may add to the server's peak memory (10^9 ranks was 100 GB)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# the server fixture's (conftest.py)
SERVER_ARGS = ("--l1-size-gb", "0.05", "--debug-fault-hooks", "--max-header-kb", str(HEADER_KB),
               "--max-leases-per-client", "100000")


@pytest.fixture(scope="module")
def raw(server):
    """A bare DEALER: sends any frames, returns the reply header."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(server.url)
    ids = iter(range(1, 1 << 30))

    def ask(header: dict | bytes, frames: list[bytes] = ()) -> dict:
        if isinstance(header, dict):
            header = p.pack_header({**header, "id": next(ids)})
        sock.send_multipart([header, *frames])
        return msgpack.unpackb(sock.recv_multipart()[0])

    yield ask
    sock.close()


def memory_mib(server: ServerProcess) -> tuple[float, float]:
    """(VmHWM, VmRSS) of the server process, in MiB: its peak and current resident memory."""
    fields = {}
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024
    return fields["VmHWM"], fields["VmRSS"]


def lookup(**kw) -> dict:
    return {"op": "lookup", "ns": NS, "hashes": [h(0)], "attn_groups": [0], "state_groups": [], "world_size": 1,
            **kw}


def hello(**kw) -> dict:
    return {"op": "hello", "v": p.PROTOCOL_VERSION, "ns": NS, "alignment": 16, **kw}


def keyed(op: str, keys: list, **kw) -> dict:
    return {"op": op, "ns": NS, "keys": keys, **kw}


def put(keys: list, **kw) -> dict:
    return keyed("put", keys, sums=[bytes(16)] * len(keys), **kw)


LONG = "x" * (2 * MIB)  # two million characters
PAD = b"\0" * 10_000  # header bytes, so a list of a few hundred small ints passes the header parse's own bound
NESTED = b"\x82\xa2op\xa4ping\xa3pad" + b"\x91" * 100_000 + b"\xc0"  # 100,000 arrays deep
NESTED_KEYS = (b"\x83\xa2op\xa3get\xa2ns" + msgpack.packb(NS) + b"\xa4keys" + b"\x91" * 5_000 + b"\xc0")

# name -> (request header, payload frames, the error code, a part of its message)
HOSTILE = {
    # ranks: a lookup claiming 3,000,000 ranks made the server build 200 MiB; 10^9 needs 100 GB
    "lookup world_size 10^9": (lookup(world_size=10**9), [], "bad_request", "world_size"),
    "lookup world_size 10^18": (lookup(world_size=10**18), [], "bad_request", "world_size"),
    "lookup world_size 2^64-1": (lookup(world_size=2**64 - 1), [], "bad_request", "world_size"),
    "lookup world_size 1025": (lookup(world_size=1025), [], "bad_request", "<= 1024"),
    "hello world_size 10^9": (hello(world_size=10**9), [], "bad_request", "world_size"),
    "hello layout world_size 10^18": (hello(world_size=10**18, attn_groups=[0], state_groups=[1]), [],
                                      "bad_request", "world_size"),
    # groups, and what groups x ranks x chunks multiply to
    "lookup 300 groups": (lookup(attn_groups=list(range(300)), pad=PAD), [], "too_large", "attn_groups"),
    "lookup group id 10^9": (lookup(attn_groups=[10**9]), [], "bad_request", "group ids"),
    "lookup replicated group 2^63": (lookup(replicated_groups=[2**63]), [], "bad_request", "group ids"),
    "lookup 256 groups x 1024 ranks": (lookup(attn_groups=list(range(256)), world_size=1024, pad=PAD), [], "too_large",
                                       "objects per chunk"),
    "hello layout 8 groups x 1024 ranks": (hello(world_size=1024, attn_groups=list(range(4)),
                                                 state_groups=list(range(4, 8))), [], "too_large",
                                           "objects per chunk"),
    "lookup 2000 chunks x 1024 ranks": (lookup(hashes=[h(i) for i in range(2000)], world_size=1024), [],
                                        "too_large", "objects"),
    "lookup 70,000 hashes": (lookup(hashes=[h(i) for i in range(70_000)]), [], "too_large", "hashes"),
    "lookup start_chunk 10^18": (lookup(start_chunk=10**18), [], "bad_request", "start_chunk"),
    # keys per message, their groups and ranks
    "get 70,000 keys": (keyed("get", [[h(i), 0, 0] for i in range(70_000)]), [], "too_large", "keys"),
    "delete 70,000 keys": (keyed("delete", [[h(i), 0, 0] for i in range(70_000)]), [], "too_large", "keys"),
    "put 70,000 keys": (put([[h(i), 0, 0] for i in range(70_000)]), [b"x"] * 70_000, "too_large", ""),
    "get rank 10^18": (keyed("get", [[h(0), 0, 10**18]]), [], "bad_request", "rank"),
    "get rank 1024": (keyed("get", [[h(0), 0, 1024]]), [], "bad_request", "rank"),
    "put group 2^63": (put([[h(0), 2**63, 0]]), [b"x"], "bad_request", "group"),
    "delete rank 2^64-1": (keyed("delete", [[h(0), 0, 2**64 - 1]]), [], "bad_request", "rank"),
    "debug_corrupt two keys": (keyed("debug_corrupt", [[h(0), 0, 0], [h(1), 0, 0]]), [], "bad_request", "one key"),
    # frame counts: payload frames beyond what the header has keys for
    "put 1 key, 5000 empty frames": (put([[h(0), 0, 0]]), [b""] * 5000, "too_large", "payload frames"),
    "ping with 1000 frames": ({"op": "ping"}, [b"x"] * 1000, "too_large", "payload frames"),
    # byte sizes and other numbers
    "hello alignment 2^63": (hello(alignment=2**63), [], "bad_request", "alignment"),
    "release lease_id 2^64-1": ({"op": "release", "lease_id": 2**64 - 1}, [], None, None),
    "debug_corrupt offset 2^64-1": (keyed("debug_corrupt", [[h(6), 0, 0]], offset=2**64 - 1), [], None, None),
    # string lengths
    "hello ns of 2M chars": (hello(ns=LONG), [], "bad_request", "'ns'"),
    "lookup ns of 2M chars": (lookup(ns=LONG), [], "bad_request", "'ns'"),
    "get ns of 2M chars": (keyed("get", [[h(0), 0, 0]], ns=LONG), [], "bad_request", "'ns'"),
    "put ns of 2M chars": (put([[h(0), 0, 0]], ns=LONG), [b"x"], "bad_request", "'ns'"),
    "delete ns of 2M chars": (keyed("delete", [[h(0), 0, 0]], ns=LONG), [], "bad_request", "'ns'"),
    "clear ns of 2M chars": ({"op": "clear", "ns": LONG}, [], "bad_request", "'ns'"),
    "op of 2M chars": ({"op": LONG}, [], "unknown_op", "unknown op"),
    "debug_die_on on of 2M chars": ({"op": "debug_die_on", "on": LONG}, [], "bad_request", "'on'"),
    "group_names id of 5000 digits": (hello(attn_groups=[0], state_groups=[], group_names={"9" * 5000: "a"}), [],
                                      "bad_request", "group_names"),
    "group_names id a unicode digit": (hello(attn_groups=[0], state_groups=[], group_names={"\u00b2": "a"}), [],
                                       "bad_request", "group_names"),
    # nesting
    "ping nested 100,000 deep": (NESTED, [], "bad_request", "msgpack"),
    "get keys nested 5,000 deep": (NESTED_KEYS, [], "bad_request", ""),
}


def _check(reply: dict, code: str | None, part: str | None, name: str) -> None:
    if code is None:  # a number the op can take: answered, not an error
        assert reply["ok"] is True, (name, reply)
        return
    assert reply["ok"] is False and reply["code"] == code, (name, reply)
    assert part in reply["message"], (name, reply)
    assert len(reply["message"]) < 400, (name, len(reply["message"]))  # no echo of what was sent


def _warm_up(raw) -> None:
    """Requests of the sizes the hostile batch has, within the bounds: what the server's
    memory peak is measured against."""
    assert raw(lookup(hashes=[h(i) for i in range(60_000)]))["ok"]
    assert raw(lookup(hashes=[h(i) for i in range(1000)], world_size=1024))["ok"]
    assert raw(keyed("get", [[h(i), 0, 0] for i in range(60_000)]))["ok"]
    assert raw(keyed("delete", [[h(i), 0, 0] for i in range(100_000, 160_000)]))["ok"]
    refused = raw(keyed("put", [[h(i), 0, 0] for i in range(60_000)]), [b"x"] * 60_000)  # no sums
    assert refused["code"] == "bad_request" and "sums" in refused["message"]
    assert raw(hello(ns="y" * 1024))["ok"]
    assert raw({"op": "clear", "ns": "y" * 1024})["ok"]
    assert raw({"op": "ping", "pad": "z" * (3 * MIB)})["ok"]


def test_huge_counts_sizes_and_lengths_are_refused_and_memory_stays_flat(server, raw):
    """Every count a request claims is checked before anything is built from it: each of
    these well-formed requests gets its error reply (code and message), the server's peak
    memory does not move, and it serves on."""
    with CacheClient(server.url, timeout_s=10) as c:
        c.put(NS, [(h(0), 0, 0, b"payload"), (h(6), 0, 0, b"to flip")])
    _warm_up(raw)
    peak, rss = memory_mib(server)
    for name, (header, frames, code, part) in HOSTILE.items():
        _check(raw(header, frames), code, part, name)
    after_peak, after_rss = memory_mib(server)
    assert after_peak - peak < FLAT_MIB, (peak, after_peak)
    assert after_rss - rss < FLAT_MIB, (rss, after_rss)
    assert raw({"op": "ping"})["ok"] is True
    with CacheClient(server.url, timeout_s=10) as c:  # nothing was lost, and the server serves
        assert c.get(NS, [(h(0), 0, 0)])[0] == b"payload"
        assert c.lookup(NS, [h(0)], [0], [], world_size=1, lease=False)[0] == 1
        assert c.stats()["namespaces"].keys() >= {NS}
        assert not any(len(ns) > p.MAX_NAMESPACE_CHARS for ns in c.stats()["namespaces"])


def test_the_bounds_let_real_requests_through(server, raw):
    """At each bound the request is served: 1024 ranks, 256 groups, 65,536 keys, a
    1024-character namespace, 4096 objects per chunk and 2^20 per lookup."""
    assert raw(lookup(world_size=p.MAX_WORLD_SIZE))["ok"]
    assert raw(lookup(attn_groups=list(range(p.MAX_GROUP_ID + 1)), replicated_groups=list(range(256)),
                      pad=2 * PAD))["ok"]
    assert raw(lookup(attn_groups=[0, 1, 2, 3], world_size=1024))["ok"]  # 4096 objects per chunk
    assert raw(lookup(hashes=[h(i) for i in range(256)], attn_groups=[0, 1, 2, 3], world_size=1024))["ok"]
    assert raw(keyed("get", [[h(i), 255, 1023] for i in range(p.MAX_KEYS)]))["ok"]
    assert raw(hello(ns="n" * p.MAX_NAMESPACE_CHARS, world_size=1024, attn_groups=[0, 1], state_groups=[2, 3],
                     replicated_groups=[0], group_names={"0": "latent", "3": "kda_state"}))["ok"]
    assert raw({"op": "clear", "ns": "n" * p.MAX_NAMESPACE_CHARS})["ok"]


def test_a_refused_hello_admits_no_namespace(server, raw):
    """A hello refused for its layout changes nothing: its namespace is not admitted (an
    admitted one could push out an idle namespace at --max-namespaces)."""
    reply = raw(hello(ns="refused-ns", world_size=10**9, attn_groups=[0], state_groups=[1]))
    assert reply["ok"] is False and reply["code"] == "bad_request"
    with CacheClient(server.url, timeout_s=10) as c:
        assert "refused-ns" not in c.stats()["namespaces"]


def test_many_empty_frames_cost_no_python_object_each(server, raw):
    """A message of 300,000 empty frames (600 kB sent) is refused, and costs the server only
    libzmq's own buffering of it (about 128 bytes a frame in its two pipes, held before any
    Python code sees the message: +39 MiB measured here). Each frame used to become Python
    objects too: +98 MiB for these, 720 MiB for a million."""
    peak, _ = memory_mib(server)
    reply = raw(put([[h(0), 0, 0]]), [b""] * 300_000)
    assert reply["ok"] is False and reply["code"] == "too_large" and "payload frames" in reply["message"]
    assert memory_mib(server)[0] - peak < 64, (peak, memory_mib(server))
    assert raw({"op": "ping"})["ok"]


# --- the fuzzer ---------------------------------------------------------------------------

HUGE_INTS = [10**9, 10**18, 2**63, 2**64 - 1, -2**63, 1025, 256, 65_537]
TEMPLATES = {
    "hello": lambda: hello(attn_groups=[0], state_groups=[1], replicated_groups=[0], world_size=2),
    "lookup": lambda: lookup(hashes=[h(0), h(1)], attn_groups=[0], state_groups=[1], replicated_groups=[0],
                             world_size=2, start_chunk=1, held=True),
    "get": lambda: keyed("get", [[h(0), 0, 0], [h(1), 1, 1]]),
    "put": lambda: put([[h(2), 0, 0]], prev=[None], parent=[None]),
    "delete": lambda: keyed("delete", [[h(3), 0, 0]], reason="client"),
    "debug_corrupt": lambda: keyed("debug_corrupt", [[h(4), 0, 0]], offset=3),
    "release": lambda: {"op": "release", "lease_id": 7},
    "clear": lambda: {"op": "clear", "ns": "fuzz-clear"},
    "stats": lambda: {"op": "stats"},
    "ping": lambda: {"op": "ping"},
}


def _nested(depth: int):
    value = None
    for _ in range(depth):
        value = [value]
    return value


def _hostile_values(value) -> list:
    """Well-formed but hostile replacements for a field's ``value``: huge numbers, huge
    counts of its own well-formed elements, its keys with huge groups and ranks, long
    strings, deep nestings, and values of other types."""
    out = [*HUGE_INTS, "s" * 1025, "s" * 1_500_000, _nested(50), _nested(500), {"k": 2**63}, b"\0" * (1 << 20)]
    if isinstance(value, list) and value:
        out += [value * 300, value * 70_000]
        if all(isinstance(k, list) and len(k) == 3 for k in value):  # object keys
            out += [[[k[0], big, 0] for k in value] for big in (256, 10**18)]
            out += [[[k[0], 0, big] for k in value] for big in (1024, 2**64 - 1)]
        else:
            out += [[*value, big] for big in (256, 10**9, 2**63)]
    return out


def _fuzz_requests(rng: random.Random) -> list[tuple[str, dict]]:
    """Every field of every op with each of its hostile values, then 200 requests with two
    fields replaced at random."""
    requests = []
    for op, template in sorted(TEMPLATES.items()):
        base = template()
        for name in [k for k in base if k != "op"] or ["extra"]:  # stats, ping: a field they do not read
            for value in _hostile_values(base.get(name, [h(0)])):
                requests.append((op, {**template(), name: value}))
    for _ in range(200):
        op = rng.choice(sorted(TEMPLATES))
        header = TEMPLATES[op]()
        for name in rng.sample(sorted(k for k in header if k != "op") or ["extra"], k=1 if len(header) < 3 else 2):
            header[name] = rng.choice(_hostile_values(header.get(name, [h(0)])))
        requests.append((op, header))
    return requests


def test_fuzzer_every_op_with_huge_values_is_answered_never_internal_and_memory_stays_flat(server, raw):
    """Seeded fuzzer: every field of every op's well-formed header replaced, one at a time,
    by each of its hostile values (huge numbers, counts, strings, nestings), then 200 random
    pairs of them. Every request is answered with a reply header (never ``internal``: no
    handler trips over its input), the server's memory stays flat, and it serves on."""
    _warm_up(raw)
    peak, _ = memory_mib(server)
    codes: dict[str, int] = {}
    for i, (op, header) in enumerate(_fuzz_requests(random.Random(31))):
        frames = [b"p"] * len(header["keys"]) if op == "put" and isinstance(header.get("keys"), list) else []
        try:
            packed = p.pack_header(header)
        except (ValueError, OverflowError):  # msgpack cannot encode it: no client can send it either
            continue
        reply = raw(packed, frames)
        assert isinstance(reply.get("ok"), bool), (i, op, reply)
        code = "ok" if reply["ok"] else reply["code"]
        assert code != "internal", (i, op, {k: v for k, v in header.items() if k != "hashes"}, reply)
        codes[code] = codes.get(code, 0) + 1
    assert codes.get("bad_request", 0) > 200 and codes.get("too_large", 0) >= 5 and codes.get("ok", 0), codes
    assert memory_mib(server)[0] - peak < FLAT_MIB, (peak, memory_mib(server))
    assert raw({"op": "ping"})["ok"]
    with CacheClient(server.url, timeout_s=10) as c:  # /status still reads: no namespace of 1.5M characters
        assert all(len(ns) <= p.MAX_NAMESPACE_CHARS for ns in c.stats()["namespaces"])


# --- leases ---------------------------------------------------------------------------------


def test_lease_ids_are_random_64_bit_numbers(server):
    """Lease ids are not a counter another client can count along: 200 leases have 200
    distinct ids spread over 64 bits."""
    with CacheClient(server.url, timeout_s=10) as c:
        c.put(NS, [(h(10), 0, 0, b"leased")])
        ids = [c.lookup(NS, [h(10)], [0], [])[1] for _ in range(200)]
        assert all(isinstance(i, int) and 0 < i < 2**64 for i in ids)
        assert len(set(ids)) == 200
        assert sum(i >= 2**48 for i in ids) > 190  # sequential ids would all be small
        assert sum(b - a == 1 for a, b in zip(ids, ids[1:])) < 3
        assert all(c.release(i) for i in ids)


def test_only_the_connection_that_took_a_lease_can_release_it(server, raw):
    """A release from another connection is refused (``not_owner``) and changes nothing:
    the object stays pinned until its owner releases it."""
    with CacheClient(server.url, timeout_s=10) as owner, CacheClient(server.url, timeout_s=10) as other:
        owner.put(NS, [(h(11), 0, 0, b"mine")])
        before = owner.stats()
        hit, lease = owner.lookup(NS, [h(11)], [0], [])
        assert hit == 1 and lease is not None
        reply, _ = other.request({"op": "release", "lease_id": lease})
        assert reply["released"] is False and reply["reason"] == "not_owner"
        reply = raw({"op": "release", "lease_id": lease})
        assert reply["ok"] is True and reply["released"] is False and reply["reason"] == "not_owner"
        stats = owner.stats()
        assert stats["active_leases"] == before["active_leases"] + 1
        assert stats["leased_objects"] == before["leased_objects"] + 1
        assert stats["lease_releases_refused"] == before["lease_releases_refused"] + 2
        assert owner.release(lease) is True
        assert owner.stats()["active_leases"] == before["active_leases"]
        reply, _ = owner.request({"op": "release", "lease_id": lease})  # released already
        assert reply == {"released": False, "reason": "unknown", "ok": True, "id": reply["id"]}
