"""Chunk keys read off vLLM's own block hashes (``chunk_keys: vllm``, the default where
usable): nothing is hashed by the connector, at admission or on save.

A real glm-cache-server process; the scheduler side is built without an engine from
hand-made vLLM configs and real vLLM requests whose ``block_hashes`` vLLM's own block
hasher computed (see testing/sched_harness.py). The end-to-end tests run engines with
the default setting, so their reloads go through these keys."""

from __future__ import annotations

import pytest

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from testing.sched_harness import request
from testing.vllm_keys import vllm_chunk_keys

C = 256  # the shared server fixture's minimum chunk (conftest.py)
PROMPT = list(range(16, 1016))  # 1000 tokens: strict prefix 3 chunks (768)



def _answer(side, req):
    first = side.get_num_new_matched_tokens(req, 0)
    assert first == (None, False)
    side._requests[req.request_id].lookup.future.result()
    return side.get_num_new_matched_tokens(req, 0)


def _grid_key(block_hash: bytes, chunk: int) -> bytes:
    from blake3 import blake3

    return blake3(b"glm-cache-grid:" + chunk.to_bytes(4, "big") + block_hash).digest()


def test_keys_are_vllms_block_hashes_at_chunk_ends(sides):
    """Chunk k's key is vLLM's block hash at token (k+1)*C bound to the chunk size C, with
    blocks of any span that divides the chunk; the same as vllm_chunk_keys computes
    outside the engine."""
    for span in (C, C // 4):
        side = sides(hash_block=span)
        assert side.keys.scheme.span is not None and side.keys.scheme.span == span
        req = request(f"r{span}", PROMPT, "salt", hash_block=span)
        per_chunk = C // span
        expected = [_grid_key(req.block_hashes[(k + 1) * per_chunk - 1], C) for k in range(3)]
        assert side.request_keys(req, 3) == expected
        assert expected == vllm_chunk_keys(PROMPT, C, span, "salt")
        assert expected != chunk_hashes(PROMPT, C, "salt")  # not the token chain
    # Chunks of another grid that end at the same token share no key.
    assert vllm_chunk_keys(PROMPT, 2 * C, C, "salt")[0] != vllm_chunk_keys(PROMPT, C, C, "salt")[1]
    # The salt is in vLLM's hash: another salt shares no key.
    other = sides().request_keys(request("o", PROMPT, "another", hash_block=C), 3)
    assert not set(other) & set(vllm_chunk_keys(PROMPT, C, C, "salt"))


def test_a_held_prompt_is_admitted_with_one_lookup_and_nothing_hashed(server, sides, monkeypatch):
    """The server holds the prefix under block-hash keys (another replica saved it): one
    lookup answers it; no token is hashed (no probe, no chain)."""
    import connector.keys

    side = sides()
    hashes = vllm_chunk_keys(PROMPT, C, C, "held")
    with CacheClient(server.url) as c:
        items = [(h, 1, 0, b"a" * 64) for h in hashes] + [(hashes[-1], 0, 0, b"s" * 64)]
        assert set(c.put(side.namespace, items, parent=[None, *hashes[:-1], hashes[1]])) == {"stored"}
        lookups = c.stats()["lookups"]

        def no_hashing(*a, **k):
            raise AssertionError("chunk keys hashed from token ids")

        monkeypatch.setattr(connector.keys, "extend_chunk_hashes", no_hashing)  # the lookup thread's too (ChunkKeys.chain)
        out = _answer(side, request("held", PROMPT, "held", hash_block=C))
        assert out == (768, True)
        assert c.stats()["lookups"] == lookups + 1
        assert len(side.keys.memo.entries) == 0


def test_the_namespace_names_the_key_scheme(sides):
    """Engines that would key the same tokens differently never share a namespace: block
    hashes vs the token chain, and block hashes of another algorithm or span. Keys from
    token ids stay in the token chain's namespace, whatever the other settings."""
    token_chain = sides(chunk_keys="lmcache")
    assert token_chain.keys.scheme.span is None
    spaces = {
        token_chain.namespace,
        sides().namespace,
        sides(hash_algo="sha256_cbor").namespace,
        sides(hash_block=C // 2).namespace,
    }
    assert len(spaces) == 4
    assert sides(chunk_keys="vllm").namespace == sides(chunk_keys="auto").namespace


def test_non_cryptographic_block_hashes_keep_token_keys(sides):
    """xxhash block hashes are not collision resistant (nor the same in every process
    without PYTHONHASHSEED): the connector keeps hashing token ids, in the token chain's
    namespace, even when asked for vLLM's keys."""
    for wanted in ("auto", "vllm"):
        side = sides(hash_algo="xxhash", chunk_keys=wanted)
        assert side.keys.scheme.span is None
        assert side.namespace == sides(hash_algo="xxhash", chunk_keys="lmcache").namespace
        assert side.request_keys(request(f"x-{wanted}", PROMPT, "s", hash_block=C), 3) == chunk_hashes(PROMPT, C, "s")


def test_chunk_keys_setting_is_checked():
    from vllm.config import KVTransferConfig

    from connector.config import Settings

    def settings(value):
        cfg = KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both",
                               kv_connector_extra_config={"chunk_keys": value})
        return Settings.from_config(cfg)

    assert settings("VLLM").chunk_keys == "vllm"
    assert Settings().chunk_keys == "auto"
    with pytest.raises(ValueError, match="chunk_keys must be one of auto, vllm, lmcache"):
        settings("blake3")


def test_a_vllm_without_the_seed_api_keeps_token_keys(sides, monkeypatch):
    """Keys from vLLM's hashes need vLLM's seed rule (``resolve_none_hash_seed``, vLLM
    0.32): a version without it gets the token chain, in the chain's namespace."""
    import vllm.v1.core.kv_cache_utils as kcu

    chain = sides(chunk_keys="lmcache").namespace
    monkeypatch.delattr(kcu, "resolve_none_hash_seed")
    side = sides()
    assert side.keys.scheme.span is None
    assert side.namespace == chain
