"""PagedKVCache: cache objects are a group's pages, layer-major, read from and written to
exactly the bytes vLLM's KVCacheTensor placement assigns (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from connector.geometry import CacheGroup, LayerPage
from connector.kv_pages import PagedKVCache

vkv = pytest.importorskip("vllm.v1.kv_cache_interface")

NUM_BLOCKS = 6
PAGE = 64  # bytes of content per block per layer
STRIDE = 96  # block stride: content plus padding


def _cache():
    """Two layers sharing one backing buffer, block-outermost, with padding per page."""
    size = 2 * NUM_BLOCKS * STRIDE + 32
    tensor = vkv.KVCacheTensor(size=size, layers=["a.0", "a.1"], layer_stride=NUM_BLOCKS * STRIDE,
                               block_stride=STRIDE, offset=32)
    config = vkv.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[])
    buf = torch.zeros(size, dtype=torch.int8)
    views = {
        name: torch.as_strided(buf, (NUM_BLOCKS, PAGE), (STRIDE, 1), 32 + i * NUM_BLOCKS * STRIDE)
        for i, name in enumerate(tensor.layers)
    }
    group = CacheGroup(group_id=1, is_state=False, block_size=16,
                       layers=tuple(LayerPage(n, PAGE, "int8", 16, 16, "FullAttentionSpec") for n in ("a.0", "a.1")))
    return PagedKVCache(views, config, (group,)), views, buf


def test_object_is_layer_major_pages_of_the_blocks():
    pages, views, _ = _cache()
    for name, v in views.items():
        for b in range(NUM_BLOCKS):
            v[b] = (b + (100 if name == "a.1" else 0)) % 128
    data = pages.read(1, [4, 2])
    assert len(data) == pages.object_bytes(1, 2) == 2 * 2 * PAGE
    expect = bytes([4] * PAGE + [2] * PAGE + [104] * PAGE + [102] * PAGE)
    assert data == expect


def test_write_restores_exactly_the_pages_and_not_the_padding():
    pages, views, buf = _cache()
    for v in views.values():
        v.copy_(torch.randint(-100, 100, v.shape, dtype=torch.int8))
    data = pages.read(1, [0, 3])
    before = buf.clone()
    for v in views.values():
        v[5].zero_()
        v[1].zero_()
    pages.write(1, [5, 1], data)
    for v in views.values():
        assert torch.equal(v[5], v[0]) and torch.equal(v[1], v[3])
    assert pages.read(1, [5, 1]) == data
    # Padding bytes between pages are untouched.
    pad = torch.ones(STRIDE - PAGE, dtype=torch.bool)
    for i in range(2 * NUM_BLOCKS):
        start = 32 + i * STRIDE + PAGE
        assert torch.equal(buf[start:start + STRIDE - PAGE] == before[start:start + STRIDE - PAGE], pad)


def test_wrong_size_object_is_rejected():
    pages, _, _ = _cache()
    with pytest.raises(ValueError):
        pages.write(1, [0], b"short")


def test_single_layer_page_write_for_partially_held_chunks():
    pages, views, _ = _cache()
    pages.write_layer_page("a.1", 1, 2, bytes([7]) * PAGE)
    assert bool((views["a.1"][2] == 7).all())
    assert bool((views["a.0"][2] == 0).all())


SMALL, LARGE, BS, NB5 = 24, 64, 320, 5
# Per layer an indexer-like small page and a latent-like large page, alternating in the
# group's layer list as GLM-5.3-Flash's attention group does; the small pages of a block
# packed together, the large ones after them.
_REGULAR = [0, 80, SMALL, 80 + LARGE + 8, 2 * SMALL, 80 + 2 * (LARGE + 8)]
_UNEVEN = [0, 80, SMALL, 150, 2 * SMALL, 240]  # large pages 70 then 90 bytes apart
_REVERSED = [0, 80 + 2 * (LARGE + 8), SMALL, 80 + LARGE + 8, 2 * SMALL, 80]  # large ones backwards


def _packed_cache(bases: list[int]):
    names = [f"x.{i}" for i in range(len(bases))]
    pages = [SMALL if i % 2 == 0 else LARGE for i in range(len(bases))]
    size = NB5 * BS
    tensors = [vkv.KVCacheTensor(size=size, layers=[n], layer_stride=0, block_stride=BS, offset=base)
               for n, base in zip(names, bases)]
    config = vkv.KVCacheConfig(num_blocks=NB5, kv_cache_tensors=tensors, kv_cache_groups=[])
    buf = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    views = {n: torch.as_strided(buf, (NB5, p), (BS, 1), base) for n, p, base in zip(names, pages, bases)}
    group = CacheGroup(group_id=4, is_state=False, block_size=16,
                       layers=tuple(LayerPage(n, p, "int8", 16, 16, "FullAttentionSpec") for n, p in zip(names, pages)))
    return PagedKVCache(views, config, (group,)), buf, list(zip(bases, pages))


@pytest.mark.parametrize("bases", [_REGULAR, _UNEVEN, _REVERSED], ids=["regular", "uneven", "reversed"])
def test_write_places_every_page_where_its_placement_says_and_nothing_else(bases):
    pages, buf, layout = _packed_cache(bases)
    blocks = [3, None, 0, 4]
    n = len(blocks)
    obj = torch.randint(0, 256, (pages.object_bytes(4, n),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(9)).numpy().tobytes()
    # The reference: page by page, from the object's layout (layer-major, then block).
    expect = buf.clone().view(torch.uint8)
    src = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
    pos = 0
    for base, page in layout:
        for t, b in enumerate(blocks):
            if b is not None:
                expect[base + b * BS: base + b * BS + page] = src[pos + t * page: pos + (t + 1) * page]
        pos += n * page
    assert pos == len(obj)
    pages.write(4, blocks, obj)
    assert torch.equal(buf.view(torch.uint8), expect)
    assert pages.read(4, [3, 0, 4]) == b"".join(
        obj[o + t * page: o + (t + 1) * page] for o, (_, page) in zip(
            [sum(n * p for _, p in layout[:i]) for i in range(len(layout))], layout) for t in (0, 2, 3))
