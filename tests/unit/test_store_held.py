"""ObjectStore.held: what a client need not send again."""

from cache_server.store import ObjectStore

NS = "ns"
H = [bytes([i]) * 32 for i in range(6)]
ATTN, STATE, LATENT = 1, 0, 2  # LATENT: replicated across TP (stored under rank 0 only)


def _store():
    return ObjectStore(capacity_bytes=1 << 20, max_object_bytes=1 << 16)


def _put(store, h, group, ranks):
    for r in ranks:
        store.put((NS, h, group, r), b"x" * 8)


def test_held_counts_attention_of_every_group_and_rank_from_chunk_zero():
    store = _store()
    for h in H[:4]:
        _put(store, h, ATTN, [0, 1])
        _put(store, h, LATENT, [0])  # replicated: rank 0 is enough
    _put(store, H[4], ATTN, [0])  # rank 1 missing: chunk 4 is not held
    _put(store, H[5], ATTN, [0, 1])
    _put(store, H[5], LATENT, [0])
    depth, _ = store.held(NS, H, [ATTN, LATENT], [STATE], 2, 0, replicated_groups=[LATENT])
    assert depth == 4  # contiguous from 0: chunk 5 is behind the hole at 4
    # Without the replicated declaration, rank 1 of LATENT is required and missing.
    assert store.held(NS, H, [ATTN, LATENT], [STATE], 2, 0)[0] == 0


def test_held_reports_the_states_at_the_lookup_start():
    store = _store()
    for h in H[:3]:
        _put(store, h, ATTN, [0])
    _put(store, H[2], STATE, [0])
    assert store.held(NS, H, [ATTN], [STATE], 1, 3) == (3, True)
    assert store.held(NS, H, [ATTN], [STATE], 1, 2) == (3, False)  # no state at chunk 1
    assert store.held(NS, H, [ATTN], [STATE], 1, 0) == (3, False)  # nothing before chunk 0
    assert store.held(NS, H, [ATTN], [], 1, 3) == (3, False)  # no state groups: nothing to report


def test_held_touches_nothing():
    store = _store()
    _put(store, H[0], ATTN, [0])
    before = store.snapshot()
    store.held(NS, H, [ATTN], [STATE], 1, 1)
    after = store.snapshot()
    assert after["lookups"] == before["lookups"] and after["get_hits"] == before["get_hits"]


def test_chunk_hashes_ignore_an_unhashed_tail_and_extend_incrementally():
    """keys.chunk_hashes packs a whole list at once when only a partial chunk follows;
    an invalid id there (never hashed) must not fail it, and extending a chain equals
    hashing from scratch."""
    from cache_server.chunk_keys import chunk_hashes, extend_chunk_hashes

    assert chunk_hashes([1, 2, 3, 4, -1], 4) == chunk_hashes([1, 2, 3, 4], 4)
    tokens = list(range(100, 140))
    chain = chunk_hashes(tokens[:16], 4, "s")
    assert extend_chunk_hashes(chain, tokens, 4, "s", max_chunks=9) == chunk_hashes(tokens[:36], 4, "s")
