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


def store(capacity: int = 1000, max_object: int = 1000, ttl: float = 10.0, clock=None, **kw) -> ObjectStore:
    return ObjectStore(capacity, max_object, ttl, clock or FakeClock(), **kw)


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


def test_each_object_is_charged_its_overhead_so_tiny_ones_are_evicted_too():
    """With a per-object overhead, empty and 1-byte objects fill the budget and are evicted
    like any other (uncharged, 10,000 of them would all be kept in a 1 KB budget); a put
    whose charge alone exceeds the budget is refused; the payload sum stays ``used_bytes``;
    an empty object in a declared namespace is valued per byte of its charge (no division by
    zero)."""
    from cache_server.layout import Layout

    s = store(capacity=1000, object_overhead_bytes=100)
    s.set_layout(NS, Layout(frozenset({ATTN}), frozenset({STATE}), 1, frozenset(), 16))
    prev = None
    for i in range(10_000):
        assert s.put((NS, h(i), ATTN, 0), bytes(i % 2), parent=prev) is PutResult.STORED
        prev = h(i)
    snap = s.snapshot()
    n = snap["objects"]
    assert 9 <= n <= 10 and snap["charged_bytes"] == n * 100 + snap["used_bytes"] <= 1000
    assert snap["used_bytes"] <= 5 and s.counters.evictions == 10_000 - n
    assert s.put((NS, h(-1 % 2**32), ATTN, 0), b"a" * 901) is PutResult.TOO_LARGE
    assert store(capacity=1000).put((NS, h(1), ATTN, 0), b"") is PutResult.STORED


def test_the_chunk_tree_is_bounded_by_the_objects_held_not_the_chunks_ever_put():
    """A conversation of 10,000 chunks through a budget of ten objects: the tree keeps the
    resident tail and at most one empty node above it (it had every chunk before)."""
    from cache_server.layout import Layout

    s = store(capacity=1000, object_overhead_bytes=90)
    s.set_layout(NS, Layout(frozenset({ATTN}), frozenset({STATE}), 1, frozenset(), 16))
    prev = None
    for i in range(10_000):
        assert s.put((NS, h(i), ATTN, 0), b"a" * 10, parent=prev) is PutResult.STORED
        prev = h(i)
    assert len(s) == 10 and len(s._trees[NS].nodes) <= 11


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


# --- retention after eviction (an evicted child must not keep its parent superseded) -------


def test_parent_whose_only_child_was_evicted_is_no_longer_superseded():
    s = store(capacity=300)
    s.put((NS, h(1), STATE, 0), b"p" * 100)  # parent state
    s.put((NS, h(2), STATE, 0), b"c" * 100, prev=h(1))  # its only child
    assert s.is_superseded((NS, h(1), STATE, 0))
    _, lease = s.lookup(NS, [h(1)], [], [STATE], 1)  # pin the parent so the child goes first
    s.put((NS, h(3), ATTN, 0), b"x" * 100)
    assert s.put((NS, h(4), ATTN, 0), b"y" * 100) is PutResult.STORED
    assert (NS, h(2), STATE, 0) not in s  # the child was the oldest unleased object
    assert not s.is_superseded((NS, h(1), STATE, 0))
    assert s.snapshot()["superseded_objects"] == 0
    s.release(lease)
    s.get((NS, h(1), STATE, 0))  # the parent is now the most recently used object
    assert s.put((NS, h(5), ATTN, 0), b"z" * 100) is PutResult.STORED
    assert (NS, h(1), STATE, 0) in s  # kept under plain LRU; while superseded it went first
    assert (NS, h(3), ATTN, 0) not in s


def test_fork_point_that_loses_a_branch_becomes_superseded():
    s = store(capacity=300)
    s.put((NS, h(1), STATE, 0), b"p" * 100)
    s.put((NS, h(2), STATE, 0), b"a" * 100, prev=h(1))
    s.put((NS, h(3), STATE, 0), b"b" * 100, prev=h(1))
    assert not s.is_superseded((NS, h(1), STATE, 0))  # a fork point
    _, lease = s.lookup(NS, [h(1)], [], [STATE], 1)
    s.put((NS, h(4), ATTN, 0), b"x" * 100)  # evicts branch a, the oldest unleased object
    assert (NS, h(2), STATE, 0) not in s
    assert s.is_superseded((NS, h(1), STATE, 0))  # branch b resumes all it could
    s.release(lease)
    s.get((NS, h(1), STATE, 0))
    s.put((NS, h(5), ATTN, 0), b"y" * 100)
    assert (NS, h(1), STATE, 0) not in s  # superseded goes first though most recently used
    assert s.snapshot()["superseded_objects"] == 0


def test_evicted_parent_leaves_its_child_consistent():
    s = store(capacity=300)
    s.put((NS, h(1), STATE, 0), b"p" * 100)
    s.put((NS, h(2), STATE, 0), b"c" * 100, prev=h(1))
    s.put((NS, h(3), ATTN, 0), b"x" * 200)  # evicts the superseded parent only
    assert (NS, h(1), STATE, 0) not in s and (NS, h(2), STATE, 0) in s
    s.put((NS, h(1), STATE, 0), b"q" * 100)  # the parent comes back, unlinked
    assert not s.is_superseded((NS, h(1), STATE, 0))
    s.clear()
    assert s.snapshot()["superseded_objects"] == 0 and s.used_bytes == 0


# --- eviction order against a scan-everything reference ----------------------------------


class _Reference:
    """The retention rules written the slow, obvious way: scan everything per eviction."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity, self.ttl, self.tick = capacity, ttl, 0
        self.objects: dict = {}  # key -> [nbytes, tick, leases, children, parent]
        self.leases: dict = {}  # id -> (expires_at, key)

    def _touch(self, key) -> None:
        self.tick += 1
        self.objects[key][1] = self.tick

    def expire(self, now: float) -> None:
        for lid in [i for i, (t, _) in self.leases.items() if t <= now]:
            self.release(lid)

    def release(self, lid) -> None:
        _, key = self.leases.pop(lid)
        self.objects[key][2] -= 1

    def put(self, key, nbytes: int, prev) -> str:
        if key in self.objects:
            self._touch(key)
            return "exists"
        used = sum(o[0] for o in self.objects.values())
        free = sum(o[0] for o in self.objects.values() if o[2] == 0)
        need = used + nbytes - self.capacity
        if need > free:
            return "no_space"
        while need > 0:
            cands = [(len(o[3]) != 1, o[1], k) for k, o in self.objects.items() if o[2] == 0]
            victim = min(cands)[2]
            need -= self.objects[victim][0]
            parent = self.objects.pop(victim)[4]
            if parent is not None and (victim[0], parent, *victim[2:]) in self.objects:
                self.objects[(victim[0], parent, *victim[2:])][3].discard(victim[1])
        self.tick += 1
        self.objects[key] = [nbytes, self.tick, 0, set(), None]
        pkey = (key[0], prev, *key[2:])
        if prev is not None and prev != key[1] and pkey in self.objects:
            self.objects[key][4] = prev
            self.objects[pkey][3].add(key[1])
        return "stored"


def test_eviction_order_matches_a_scan_everything_reference():
    import random

    rng = random.Random(11)
    clock = FakeClock()
    s = store(capacity=2000, max_object=400, ttl=5.0, clock=clock)
    ref = _Reference(2000, 5.0)
    leases: dict[int, int] = {}  # store lease id -> reference lease id
    for step in range(4000):
        clock.now += rng.choice([0.0, 0.0, 0.5])
        ref.expire(clock.now)
        for lid in [i for i in leases if ref.leases.get(leases[i]) is None]:
            del leases[lid]
        i, g = rng.randrange(60), rng.choice([ATTN, STATE])
        key = (NS, h(i), g, 0)
        op = rng.random()
        if op < 0.55:
            nbytes = rng.randrange(1, 400)
            prev = h(rng.randrange(60)) if g == STATE and rng.random() < 0.7 else None
            assert s.put(key, b"x" * nbytes, prev=prev).value == ref.put(key, nbytes, prev), step
        elif op < 0.75:
            assert (s.get(key) is not None) == (key in ref.objects)
            if key in ref.objects:
                ref._touch(key)
        elif op < 0.9:
            hit, lid = s.lookup(NS, [h(i)], [g], [], 1)
            assert hit == (1 if key in ref.objects else 0)
            if hit:
                ref._touch(key)
                ref.objects[key][2] += 1
                ref.leases[step] = (clock.now + 5.0, key)
                leases[lid] = step
        elif leases:
            lid = rng.choice(list(leases))
            assert s.release(lid) is True
            ref.release(leases.pop(lid))
        s.expire_leases()
        assert set(s._objects) == set(ref.objects), step
        assert s.used_bytes == sum(o[0] for o in ref.objects.values())
        assert s.snapshot()["superseded_objects"] == sum(len(o[3]) == 1 for o in ref.objects.values())
    assert s.counters.evictions > 500  # the run exercised eviction, not just inserts


# --- lease caps (lookups must not pin every object, leaving every put NO_SPACE) -----------


def test_leases_cannot_pin_more_than_the_cap_and_puts_keep_succeeding():
    s = ObjectStore(1000, 100, 60.0, FakeClock(), max_leased_bytes=500)
    for i in range(10):
        s.put((NS, h(i), ATTN, 0), b"a" * 100)
    leases = [s.lookup(NS, [h(i % 10)], [ATTN], [], 1)[1] for i in range(1000)]
    assert all(lease is not None for lease in leases)
    assert s.leased_bytes == 500 and s.snapshot()["leased_objects"] == 5
    assert s.counters.leases_dropped_leased_bytes == 1000 - 5
    assert s.release(leases[0]) is False and s.release(leases[-1]) is True  # the oldest went first
    results = [s.put((NS, h(100 + i), ATTN, 0), b"b" * 100) for i in range(20)]
    assert results == [PutResult.STORED] * 20


def test_lookup_whose_objects_exceed_the_lease_cap_gets_no_lease_and_drops_none():
    s = ObjectStore(900, 500, 60.0, FakeClock(), max_leased_bytes=300)
    s.put((NS, h(0), ATTN, 0), b"a" * 100)
    _, small = s.lookup(NS, [h(0)], [ATTN], [], 1)
    s.put((NS, h(1), ATTN, 0), b"b" * 400)
    assert s.lookup(NS, [h(1)], [ATTN], [], 1) == (1, None)
    assert s.counters.leases_refused == 1
    assert s.put((NS, h(2), ATTN, 0), b"c" * 500) is PutResult.STORED  # the unleased hit stays evictable
    assert (NS, h(1), ATTN, 0) not in s and (NS, h(0), ATTN, 0) in s
    assert s.release(small) is True  # the older, smaller lease was not sacrificed


def test_per_owner_lease_cap_drops_that_owners_oldest_lease():
    s = ObjectStore(1000, 100, 60.0, FakeClock(), max_leases_per_owner=2)
    s.put((NS, h(0), ATTN, 0), b"a" * 10)
    a = [s.lookup(NS, [h(0)], [ATTN], [], 1, owner=b"A")[1] for _ in range(3)]
    b = s.lookup(NS, [h(0)], [ATTN], [], 1, owner=b"B")[1]
    assert s.counters.leases_dropped_client_cap == 1
    assert [s.release(x) for x in a] == [False, True, True]
    assert s.release(b) is True
    assert not s.is_leased((NS, h(0), ATTN, 0))


def test_leases_expire_in_order_without_touching_live_ones():
    clock = FakeClock()
    s = store(capacity=1000, ttl=5.0, clock=clock)
    s.put((NS, h(0), ATTN, 0), b"a" * 10)
    first = s.lookup(NS, [h(0)], [ATTN], [], 1)[1]
    clock.now = 3.0
    second = s.lookup(NS, [h(0)], [ATTN], [], 1)[1]
    clock.now = 5.0
    assert s.expire_leases() == 1
    assert s.release(first) is False and s.is_leased((NS, h(0), ATTN, 0))
    clock.now = 8.0
    assert s.expire_leases() == 1 and s.release(second) is False
    assert s.leased_bytes == 0


def test_group_and_namespace_tables_shrink_when_emptied():
    s = store()
    for g in range(50):
        s.put((f"ns{g}", h(0), g, 0), b"x")
    assert s.namespace_objects("ns7") == 1
    s.clear()
    assert not s._held.bytes_by_group and not s._held.objects_by_group and s.namespace_objects("ns7") == 0


def test_replicated_groups_need_only_the_rank_0_copy():
    """Groups identical on every TP rank are stored once (rank 0); sharded ones per rank."""
    s = store()
    _fill(s, range(3), [ATTN], ranks=(0,))  # latent: one copy
    _fill(s, [2], [STATE], ranks=(0, 1, 2, 3))  # KDA state: every rank's shard
    hashes = [h(i) for i in range(3)]
    assert s.lookup(NS, hashes, [ATTN], [STATE], world_size=4, replicated_groups=[ATTN])[0] == 3
    # without the replicated flag every rank's latent copy would be required
    assert s.lookup(NS, hashes, [ATTN], [STATE], world_size=4)[0] == 0
    # a sharded group stays per rank even when another group is replicated
    s.delete((NS, h(2), STATE, 3))
    assert s.lookup(NS, hashes, [ATTN], [STATE], world_size=4, replicated_groups=[ATTN])[0] == 0


# --- usable prefixes and value-aware retention -------------------------------------------

from cache_server.layout import Layout  # noqa: E402

CHUNK = 100


def tracked(capacity: int = 10_000, world: int = 2, **kw) -> ObjectStore:
    """A store whose namespace declared attention (replicated, one copy) and state (per rank)."""
    s = store(capacity=capacity, max_object=capacity, **kw)
    s.set_layout(NS, Layout(frozenset({ATTN}), frozenset({STATE}), world, frozenset({ATTN}), CHUNK))
    return s


def _conversation(s: ObjectStore, ids: list[int], state_at: int | None, nbytes: int = 10, world: int = 2,
                  prev: int | None = None) -> None:
    """Attention for chunks ``ids`` (a chain), a state on every rank at ``state_at``."""
    for k, i in enumerate(ids):
        s.put((NS, h(i), ATTN, 0), b"a" * nbytes, parent=h(ids[k - 1]) if k else None)
    if state_at is not None:
        k = ids.index(state_at)
        for r in range(world):
            s.put((NS, h(state_at), STATE, r), b"s" * nbytes, prev=None if prev is None else h(prev),
                  parent=h(ids[k - 1]) if k else None)


def test_usable_prefixes_follow_attention_and_states_both_ways():
    s = tracked()
    _conversation(s, [1, 2, 3], state_at=3)
    _conversation(s, [1, 2, 4], state_at=None)  # a branch without a state resumes nothing yet
    u = s.usable_prefixes(NS)
    assert (u["resumable_tokens"], u["resumable_states"], u["states_held"]) == (3 * CHUNK, 1, 1)
    s.delete((NS, h(2), ATTN, 0))  # a hole in the path: nothing below it resumes
    u = s.usable_prefixes(NS)
    assert (u["resumable_tokens"], u["resumable_states"], u["states_held"]) == (0, 0, 1)
    assert u["worthless_objects"] == 4  # chunk 1 and 3's attention, chunk 3's two state shards
    s.put((NS, h(2), ATTN, 0), b"a" * 10, parent=h(1))  # recomputed and saved again
    u = s.usable_prefixes(NS)
    assert (u["resumable_tokens"], u["resumable_states"], u["worthless_objects"]) == (3 * CHUNK, 1, 0)
    s.delete((NS, h(3), STATE, 1))  # one rank's shard missing: not resumable
    assert s.usable_prefixes(NS)["resumable_tokens"] == 0
    assert s.lookup(NS, [h(1), h(2), h(3)], [ATTN], [STATE], 2, replicated_groups=[ATTN], lease=False)[0] == 0


def test_state_arriving_before_its_attention_counts_once_the_path_is_whole():
    """TP ranks put independently: a state shard can come before rank 0's attention."""
    s = tracked()
    for r in range(2):
        s.put((NS, h(2), STATE, r), b"s" * 10, parent=h(1))
    assert s.usable_prefixes(NS)["resumable_tokens"] == 0
    assert s.usable_prefixes(NS)["worthless_objects"] == 0  # pending, not worthless
    _conversation(s, [1, 2], state_at=None)
    assert s.usable_prefixes(NS)["resumable_tokens"] == 2 * CHUNK


def test_worthless_attention_is_evicted_before_older_resumable_objects():
    s = tracked(capacity=120)
    _conversation(s, [1, 2], state_at=2)  # A: 40 bytes, oldest
    _conversation(s, [5, 6], state_at=6)  # B: 40 bytes
    s.delete((NS, h(6), STATE, 0))  # B lost its state: its attention resumes nothing
    s.get((NS, h(5), ATTN, 0))  # ...though it was used most recently
    s.put((NS, h(9), ATTN, 0), b"n" * 80, parent=None)  # needs 30 bytes: all of B that is left
    assert (NS, h(5), ATTN, 0) not in s and (NS, h(6), STATE, 1) not in s  # worthless went first
    assert all((NS, h(i), ATTN, 0) in s for i in (1, 2))  # A is still resumable
    assert s.usable_prefixes(NS)["resumable_tokens"] == 2 * CHUNK


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_pending_prefix_is_not_evicted_as_worthless(eviction):
    """A prompt whose state has not been saved yet keeps its first chunks."""
    s = tracked(capacity=60, eviction=eviction)
    _conversation(s, [1], state_at=1)  # 30 bytes, older
    s.put((NS, h(5), ATTN, 0), b"a" * 10, parent=None)
    s.put((NS, h(6), ATTN, 0), b"a" * 10, parent=h(5))
    s.put((NS, h(7), ATTN, 0), b"a" * 20, parent=h(6))  # needs room
    assert all((NS, h(i), ATTN, 0) in s for i in (5, 6, 7))
    # the older conversation went: by LRU its attention first, by value its state (worth
    # less per byte than its attention), which leaves the attention worthless
    assert s.lookup(NS, [h(1)], [ATTN], [STATE], 2, replicated_groups=[ATTN], lease=False)[0] == 0
    assert ((NS, h(1), ATTN, 0) in s) == (eviction == "value")


def test_states_evicted_while_newest_are_counted_superseded_ones_not():
    s = tracked(capacity=70, world=1)
    _conversation(s, [1], state_at=1, world=1)
    _conversation(s, [1, 2], state_at=2, world=1, prev=1)  # supersedes the state at 1
    assert s.usable_prefixes(NS)["states_held"] == 2
    s.put((NS, h(8), ATTN, 0), b"x" * 40, parent=None)  # evicts the superseded state first
    assert (NS, h(1), STATE, 0) not in s and (NS, h(2), STATE, 0) in s
    assert s.usable_prefixes(NS)["states_evicted_newest"] == 0
    s.put((NS, h(9), ATTN, 0), b"x" * 70, parent=None)  # room for it means everything else goes
    u = s.usable_prefixes(NS)
    assert u["states_evicted_newest"] == 1 and u["states_held"] == 0


def test_usable_prefix_figures_match_a_brute_force_count():
    """Random puts, deletes and evictions on a chunk tree; the incremental figures must
    equal a recount from the resident objects after every operation."""
    import random

    rng = random.Random(12)
    world = 2
    s = tracked(capacity=3000, world=world)
    parent = {0: None} | {i: (rng.randrange(i) if rng.random() < 0.85 else None) for i in range(1, 40)}

    def recount() -> tuple[int, int, int]:
        objs = set(s._objects)
        attn = {i for i in parent if (NS, h(i), ATTN, 0) in objs}
        state = {i for i in parent if all((NS, h(i), STATE, r) in objs for r in range(world))}

        def path(i):
            while i is not None:
                yield i
                i = parent[i]
        resumable = [i for i in state if all(j in attn for j in path(i))]
        covered = {j for i in resumable for j in path(i)}
        return len(covered) * CHUNK, len(resumable), len(state)

    for step in range(3000):
        i = rng.randrange(40)
        p = None if parent[i] is None else h(parent[i])
        op = rng.random()
        if op < 0.6:
            key = (NS, h(i), ATTN, 0) if rng.random() < 0.5 else (NS, h(i), STATE, rng.randrange(world))
            s.put(key, b"x" * rng.randrange(20, 200), parent=p)
        elif op < 0.8:
            s.delete((NS, h(i), rng.choice([ATTN, STATE]), rng.randrange(world)))
        else:
            s.lookup(NS, [h(j) for j in reversed(list(_path(parent, i)))], [ATTN], [STATE], world,
                     replicated_groups=[ATTN], lease=False)
        u = s.usable_prefixes(NS)
        assert (u["resumable_tokens"], u["resumable_states"], u["states_held"]) == recount(), step
        # the tree keeps a node only while it, or a child of it, holds an object
        nodes = s._trees[NS].nodes
        holding = {d for d, n in nodes.items() if n.attn or n.state}
        assert all(d in holding or any(c in holding for c in n.child_chunks) for d, n in nodes.items()), step
        # every unleased object is an eviction candidate at its current priority and class
        items = {item for by_class in s._eviction.heaps for heap in by_class for item in heap}
        for key, e in s._objects.items():
            assert e.leases or (e.prio, e.tick, key) in items, (step, key)
            assert e.prio == e.base + s._density_locked(key, e), (step, key)
    assert s.counters.evictions > 200


def _path(parent: dict, i):
    while i is not None:
        yield i
        i = parent[i]


# --- value-aware order (Marconi: recomputation saved per byte, with recency) -------------


def _conv(s: ObjectStore, ids: list[int], state_bytes: int = 40, prev: int | None = None) -> None:
    """One conversation on one rank: 10-byte attention chunks, a ``state_bytes`` state at the end."""
    for k, i in enumerate(ids):
        s.put((NS, h(i), ATTN, 0), b"a" * 10, parent=h(ids[k - 1]) if k else None)
    s.put((NS, h(ids[-1]), STATE, 0), b"s" * state_bytes, parent=h(ids[-2]) if len(ids) > 1 else None,
          prev=None if prev is None else h(prev))


def _resumes(s: ObjectStore, ids: list[int]) -> int:
    return s.lookup(NS, [h(i) for i in ids], [ATTN], [STATE], 1, replicated_groups=[ATTN], lease=False)[0]


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_deep_state_outlives_a_shallow_one_of_the_same_class(eviction):
    s = tracked(capacity=130, world=1, eviction=eviction)
    deep, shallow = [1, 2, 3, 4], [11]
    _conv(s, deep)  # older: 80 bytes, resumes 4 chunks
    _conv(s, shallow)  # newer: 50 bytes, resumes 1 chunk for the same state bytes
    s.put((NS, h(20), ATTN, 0), b"n" * 10, parent=None)  # pressure: 10 bytes
    if eviction == "value":  # the shallow state saved a quarter as much per byte: it goes
        assert (NS, h(11), STATE, 0) not in s
        assert _resumes(s, deep) == 4 and _resumes(s, shallow) == 0
        assert s.usable_prefixes(NS)["worthless_objects"] == 1  # the shallow conversation's attention
    else:  # least recently used: the deep conversation's first chunk, and with it all of it
        assert (NS, h(1), ATTN, 0) not in s
        assert _resumes(s, deep) == 0 and _resumes(s, shallow) == 1


def test_recency_still_wins_over_value_in_the_end():
    """GreedyDual: each eviction raises L, so a deep state nobody uses goes eventually."""
    s = tracked(capacity=130, world=1)
    _conv(s, [1, 2, 3, 4])
    for n in range(12):  # one-chunk conversations, each newer than the last
        _conv(s, [100 + n])
    assert (NS, h(4), STATE, 0) not in s  # the deep state went after some shallow newer ones...
    assert _resumes(s, [111]) == 1  # ...and the newest conversation is resumable
    assert s.counters.evictions > 12


def test_superseded_state_goes_before_a_plain_one_worth_less_per_byte():
    s = tracked(capacity=10_000, world=1)
    _conv(s, [1, 2, 3, 4])  # state at depth 4, worth 4 chunks...
    _conv(s, [1, 2, 3, 4, 5], prev=4)  # ...superseded by depth 5
    _conv(s, [11])  # a plain state worth 1 chunk
    s.capacity_bytes = s.used_bytes  # no room left: the next put evicts
    s.put((NS, h(30), ATTN, 0), b"n" * 10, parent=None)
    assert (NS, h(4), STATE, 0) not in s  # superseded first, although worth more per byte
    assert (NS, h(11), STATE, 0) in s and (NS, h(5), STATE, 0) in s
    assert _resumes(s, [1, 2, 3, 4, 5]) == 5 and _resumes(s, [11]) == 1


def test_fork_point_is_not_superseded_and_outlasts_a_superseded_deeper_state():
    s = tracked(capacity=10_000, world=1)
    _conv(s, [1, 2])  # a shared prefix's state (depth 2)...
    _conv(s, [1, 2, 3], prev=2)  # ...continued by two branches: a fork point
    _conv(s, [1, 2, 4], prev=2)
    _conv(s, [7, 8, 9])  # another conversation: depth 3 superseded by depth 4
    _conv(s, [7, 8, 9, 10], prev=9)
    assert not s.is_superseded((NS, h(2), STATE, 0)) and s.is_superseded((NS, h(9), STATE, 0))
    s.capacity_bytes = s.used_bytes
    s.put((NS, h(30), ATTN, 0), b"n" * 40, parent=None)  # one state's worth
    assert (NS, h(9), STATE, 0) not in s
    assert (NS, h(2), STATE, 0) in s and _resumes(s, [1, 2, 5]) == 2  # the fork point still resumes


def test_worthless_goes_before_anything_resumable_under_value_order():
    s = tracked(capacity=10_000, world=1)
    _conv(s, [1])  # shallow, low value per byte
    _conv(s, [5, 6, 7, 8])  # deep, high value per byte, newer
    s.delete((NS, h(8), STATE, 0))  # lost its state: its attention is worth nothing
    s.capacity_bytes = s.used_bytes
    s.put((NS, h(30), ATTN, 0), b"n" * 40, parent=None)
    assert not any((NS, h(i), ATTN, 0) in s for i in (5, 6, 7, 8))  # all 40 bytes from worthless
    assert _resumes(s, [1]) == 1
    assert s.usable_prefixes(NS)["worthless_objects"] == 0


def test_lru_policy_ignores_value_and_bad_options_are_refused():
    for kw in ({"eviction": "fifo"}, {"value_alpha": -1.0}, {"state_share": 0.0}, {"state_share": 1.0}):
        with pytest.raises(ValueError):
            store(**kw)


# --- a separate share of the budget for states ----------------------------------------------


def test_state_share_evicts_states_only_for_states_and_attention_only_for_attention():
    s = tracked(capacity=200, world=1, state_share=0.5)  # 100 bytes for states, 100 for the rest
    for c in ([1], [2], [3]):
        _conv(s, c)  # 10 + 40 bytes each: the third state passes the state share
    assert s.used_bytes == 3 * 10 + 2 * 40  # conversation 1's state went (its attention: worthless)...
    assert (NS, h(1), STATE, 0) not in s  # ...although the store as a whole had room
    states = [(NS, h(i), STATE, 0) for i in (2, 3)]
    s.put((NS, h(40), ATTN, 0), b"x" * 60, parent=None)  # other share: 90 of 100 used now
    s.put((NS, h(41), ATTN, 0), b"x" * 20, parent=None)  # evicts attention only
    assert all(k in s for k in states)
    assert (NS, h(1), ATTN, 0) not in s  # the worthless attention went first
    assert s.put((NS, h(5), STATE, 0), b"s" * 101, parent=None) is PutResult.NO_SPACE  # over the share
    assert all(k in s for k in states)  # and nothing was evicted for it


def test_without_a_share_one_budget_serves_both():
    s = tracked(capacity=200, world=1)
    for c in ([1], [2], [3]):
        _conv(s, c)
    assert s.counters.evictions == 0 and all((NS, h(i), STATE, 0) in s for i in (1, 2, 3))


def test_a_paths_first_chunk_is_worth_its_deepest_state_not_its_own_depth():
    """Evicting a path's first attention chunk would lose the whole path: it carries the
    value of the deepest state below it, so the state (more bytes) goes before it."""
    s = tracked(capacity=10_000, world=1)
    _conv(s, [1, 2, 3, 4])  # 4 x 10 bytes of attention, a 40-byte state worth 4 chunks
    _conv(s, [11, 12], state_bytes=10)  # newer, a small state: more value per byte
    s.capacity_bytes = s.used_bytes
    s.put((NS, h(30), ATTN, 0), b"n" * 10, parent=None)
    assert (NS, h(4), STATE, 0) not in s  # the state, worth least per byte
    assert all((NS, h(i), ATTN, 0) in s for i in (1, 2, 3, 4))  # now worthless, first to go next
    assert s.usable_prefixes(NS)["worthless_objects"] == 4
    assert _resumes(s, [11, 12]) == 2
