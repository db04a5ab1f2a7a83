"""Unit tests of the object store: accounting, LRU eviction, leases, lookup semantics."""

import pytest

from cache_server.protocol import PutResult
from cache_server.store import ObjectStore

NS = "ns"
ATTN, STATE = 0, 1


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(capacity: int = 1000, max_object: int = 1000, ttl: float = 10.0, clock=None) -> ObjectStore:
    return ObjectStore(capacity, max_object, ttl, clock or FakeClock())


def test_byte_accounting_is_exact_per_group():
    s = store()
    assert s.put((NS, h(1), ATTN, 0), b"a" * 100) is PutResult.STORED
    assert s.put((NS, h(1), STATE, 0), memoryview(b"b" * 250)) is PutResult.STORED
    snap = s.snapshot()
    assert snap["used_bytes"] == 350
    assert snap["bytes_by_group"] == {"0": 100, "1": 250}
    assert snap["objects"] == 2
    assert s.clear() == 2
    assert s.snapshot()["used_bytes"] == 0


def test_put_existing_key_is_skipped_not_double_counted():
    s = store()
    s.put((NS, h(1), ATTN, 0), b"x" * 100)
    assert s.put((NS, h(1), ATTN, 0), b"y" * 100) is PutResult.EXISTS
    assert s.used_bytes == 100
    assert bytes(s.get((NS, h(1), ATTN, 0))) == b"x" * 100


def test_lru_evicts_least_recently_used_whole_objects():
    s = store(capacity=300)
    for i in range(3):
        s.put((NS, h(i), ATTN, 0), bytes([i]) * 100)
    s.get((NS, h(0), ATTN, 0))  # 0 becomes the most recent; 1 is now the oldest
    assert s.put((NS, h(3), ATTN, 0), b"z" * 100) is PutResult.STORED
    assert (NS, h(1), ATTN, 0) not in s
    assert all((NS, h(i), ATTN, 0) in s for i in (0, 2, 3))
    assert s.used_bytes == 300
    assert s.counters.evictions == 1 and s.counters.evicted_bytes == 100


def test_eviction_frees_enough_for_a_large_object():
    s = store(capacity=300)
    for i in range(3):
        s.put((NS, h(i), ATTN, 0), b"a" * 100)
    assert s.put((NS, h(9), STATE, 0), b"s" * 250) is PutResult.STORED
    assert len(s) == 1 and s.used_bytes == 250


def test_too_large_object_is_refused():
    s = store(capacity=1000, max_object=100)
    assert s.put((NS, h(1), ATTN, 0), b"a" * 101) is PutResult.TOO_LARGE
    assert len(s) == 0


def test_leased_objects_are_not_evicted_and_no_space_evicts_nothing():
    s = store(capacity=200)
    s.put((NS, h(0), ATTN, 0), b"a" * 100)
    s.put((NS, h(0), STATE, 0), b"s" * 100)
    hit, lease = s.lookup(NS, [h(0)], [ATTN], [STATE], world_size=1)
    assert hit == 1 and lease is not None
    assert s.put((NS, h(1), ATTN, 0), b"b" * 100) is PutResult.NO_SPACE
    assert len(s) == 2  # nothing was evicted for a put that could not succeed
    assert s.release(lease) is True
    assert s.put((NS, h(1), ATTN, 0), b"b" * 100) is PutResult.STORED
    assert s.release(lease) is False


def test_lease_expires_after_ttl():
    clock = FakeClock()
    s = store(capacity=100, ttl=5.0, clock=clock)
    s.put((NS, h(0), ATTN, 0), b"a" * 100)
    _, lease = s.lookup(NS, [h(0)], [ATTN], [], world_size=1)
    assert s.is_leased((NS, h(0), ATTN, 0))
    clock.now = 4.9
    assert s.put((NS, h(1), ATTN, 0), b"b" * 100) is PutResult.NO_SPACE
    clock.now = 5.0
    assert s.put((NS, h(1), ATTN, 0), b"b" * 100) is PutResult.STORED
    assert s.counters.leases_expired == 1
    assert s.release(lease) is False


def _fill(s: ObjectStore, chunks, groups, ranks=(0,)):
    for i in chunks:
        for g in groups:
            for r in ranks:
                s.put((NS, h(i), g, r), b"x")


def test_lookup_needs_attention_for_every_chunk_and_state_at_the_last():
    s = store()
    _fill(s, range(4), [ATTN])
    _fill(s, [1], [STATE])  # state only at chunk index 1 (after 2 chunks)
    hashes = [h(i) for i in range(4)]
    assert s.lookup(NS, hashes, [ATTN], [STATE], 1)[0] == 2
    _fill(s, [3], [STATE])
    assert s.lookup(NS, hashes, [ATTN], [STATE], 1)[0] == 4


def test_lookup_stops_at_an_attention_gap_even_if_state_is_deeper():
    s = store()
    _fill(s, [0, 1, 3], [ATTN])
    _fill(s, [0, 3], [STATE])
    assert s.lookup(NS, [h(i) for i in range(4)], [ATTN], [STATE], 1)[0] == 1


def test_lookup_requires_every_rank_and_every_group():
    s = store()
    _fill(s, range(2), [0, 2], ranks=(0, 1))
    _fill(s, range(2), [1], ranks=(0,))  # state of rank 1 missing
    hashes = [h(0), h(1)]
    assert s.lookup(NS, hashes, [0, 2], [1], world_size=2)[0] == 0
    assert s.lookup(NS, hashes, [0, 2], [1], world_size=1)[0] == 2


def test_lookup_from_start_chunk_ignores_earlier_attention():
    s = store()
    _fill(s, [2, 3], [ATTN])  # chunks 0-1 evicted here, but held locally by the engine
    _fill(s, [3], [STATE])
    hashes = [h(i) for i in range(4)]
    assert s.lookup(NS, hashes, [ATTN], [STATE], 1, start_chunk=0)[0] == 0
    assert s.lookup(NS, hashes, [ATTN], [STATE], 1, start_chunk=2)[0] == 4
    assert s.lookup(NS, hashes, [ATTN], [STATE], 1, start_chunk=4) == (0, None)


def test_lookup_never_crosses_namespaces():
    s = store()
    _fill(s, [0], [ATTN, STATE])
    assert s.lookup("other", [h(0)], [ATTN], [STATE], 1) == (0, None)
    assert s.lookup(NS, [h(0)], [ATTN], [STATE], 1)[0] == 1


def test_lookup_leases_exactly_the_objects_the_resume_needs():
    s = store()
    _fill(s, range(3), [ATTN, STATE])
    hit, lease = s.lookup(NS, [h(0), h(1), h(2)], [ATTN], [STATE], 1)
    assert hit == 3
    assert all(s.is_leased((NS, h(i), ATTN, 0)) for i in range(3))
    assert s.is_leased((NS, h(2), STATE, 0))
    assert not s.is_leased((NS, h(0), STATE, 0)) and not s.is_leased((NS, h(1), STATE, 0))
    s.release(lease)
    assert not any(s.is_leased((NS, h(i), g, 0)) for i in range(3) for g in (ATTN, STATE))


def test_clear_drops_leases_on_cleared_objects():
    s = store()
    _fill(s, [0], [ATTN])
    s.lookup(NS, [h(0)], [ATTN], [], 1)
    assert s.clear(NS) == 1
    assert s.snapshot()["active_leases"] == 0


def test_hit_and_miss_counters():
    s = store()
    _fill(s, [0], [ATTN])
    s.lookup(NS, [h(0)], [ATTN], [], 1, lease=False)
    s.lookup(NS, [h(5)], [ATTN], [], 1, lease=False)
    s.get((NS, h(0), ATTN, 0))
    s.get((NS, h(5), ATTN, 0))
    snap = s.snapshot()
    assert (snap["hits"], snap["misses"], snap["get_hits"], snap["get_misses"]) == (1, 1, 1, 1)


def test_invalid_lookup_arguments_raise():
    s = store()
    with pytest.raises(ValueError):
        s.lookup(NS, [h(0)], [], [], 1)
    with pytest.raises(ValueError):
        s.lookup(NS, [h(0)], [ATTN], [], 0)


def test_superseded_state_is_evicted_before_older_lru_objects():
    s = store(capacity=400)
    s.put((NS, h(0), ATTN, 0), b"a" * 100)  # the oldest object
    s.put((NS, h(1), STATE, 0), b"s" * 100)  # turn 1's state
    s.put((NS, h(2), STATE, 0), b"t" * 100, prev=h(1))  # turn 2's state supersedes it
    s.put((NS, h(3), ATTN, 0), b"b" * 100)
    assert s.snapshot()["superseded_objects"] == 1
    assert s.put((NS, h(4), ATTN, 0), b"c" * 100) is PutResult.STORED
    assert (NS, h(1), STATE, 0) not in s  # superseded went first...
    assert (NS, h(0), ATTN, 0) in s  # ...although the attention object was older


def test_fork_point_state_is_kept_by_plain_lru():
    s = store(capacity=500)
    s.put((NS, h(1), STATE, 0), b"s" * 100)  # shared system prompt
    s.put((NS, h(2), STATE, 0), b"t" * 100, prev=h(1))  # user A continues
    s.put((NS, h(3), STATE, 0), b"u" * 100, prev=h(1))  # user B forks from the same point
    s.put((NS, h(4), ATTN, 0), b"a" * 100)
    s.put((NS, h(5), ATTN, 0), b"b" * 100)
    assert s.snapshot()["superseded_objects"] == 0
    s.put((NS, h(6), ATTN, 0), b"c" * 100)
    assert (NS, h(1), STATE, 0) not in s  # plain LRU: the fork point was the oldest
    assert (NS, h(2), STATE, 0) in s


def test_leased_superseded_state_is_not_evicted():
    s = store(capacity=300)
    s.put((NS, h(1), STATE, 0), b"s" * 100)
    s.put((NS, h(2), STATE, 0), b"t" * 100, prev=h(1))
    s.put((NS, h(1), ATTN, 0), b"a" * 100)
    _, lease = s.lookup(NS, [h(1)], [ATTN], [STATE], 1)
    assert s.put((NS, h(3), ATTN, 0), b"b" * 100) is PutResult.STORED
    assert (NS, h(1), STATE, 0) in s and (NS, h(2), STATE, 0) not in s
    s.release(lease)
