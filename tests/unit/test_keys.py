"""The chunk-hash chain: LMCache's blake3 definition, salts, whole chunks only."""

import pytest
from blake3 import blake3

from cache_server.chunk_keys import NONE_HASH, chain_seed, chunk_hashes

# Computed once from the definition (blake3 over big-endian bytes) and pinned here, so a
# change of byte order, width or seed shows up as a mismatch.
NONE_HASH_HEX = "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
RANGE8_CHUNK4_HEX = ["a2981a4d792b45f791d784bfd025148836ce3032f546cc490ef9fb7db9e639de",
                     "f76a7280af54e664fff4e1239c4a72936fedc49ba027e3a969a314ae980dbfd5"]


def test_none_hash_is_lmcache_definition():
    assert NONE_HASH == blake3((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big")).digest()
    assert NONE_HASH.hex() == NONE_HASH_HEX


def test_chain_matches_pinned_vectors_and_definition():
    hashes = chunk_hashes(list(range(8)), 4)
    assert [x.hex() for x in hashes] == RANGE8_CHUNK4_HEX
    prev = NONE_HASH
    for c in range(2):
        prev = blake3(prev + b"".join(t.to_bytes(4, "big") for t in range(4 * c, 4 * c + 4))).digest()
        assert hashes[c] == prev


def test_partial_last_chunk_has_no_key():
    assert chunk_hashes(list(range(11)), 4) == chunk_hashes(list(range(8)), 4)
    assert chunk_hashes([1, 2, 3], 4) == []


def test_hash_covers_the_whole_prefix():
    a = chunk_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second chunk, different first chunk


def test_cache_salt_changes_every_key():
    plain = chunk_hashes(list(range(12)), 4)
    salted = chunk_hashes(list(range(12)), 4, cache_salt="tenant-a")
    other = chunk_hashes(list(range(12)), 4, cache_salt="tenant-b")
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert chunk_hashes(list(range(12)), 4, cache_salt="") == plain
    assert chain_seed("tenant-a") == blake3(NONE_HASH + b"cache_salt:tenant-a").digest()


def test_invalid_input_raises():
    with pytest.raises(ValueError):
        chunk_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        chunk_hashes([-1, 2], 2)
    with pytest.raises(ValueError):
        chunk_hashes([2**32, 2], 2)
