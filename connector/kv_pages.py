"""Worker side: vLLM's KV cache as byte pages, read into and written from cache objects.

vLLM allocates one flat backing buffer; ``KVCacheTensor`` says where block ``b`` of layer
``l`` starts (``offset + l * layer_stride + b * block_stride``). A cache object is the
concatenation, layer by layer, of a group's pages for a list of blocks: the attention
object of a chunk covers that chunk's blocks; a state object is one block (the state
snapshot at the chunk's end). Pages are opaque bytes: the connector never interprets them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connector.geometry import CacheGroup

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class _LayerPages:
    base: int  # byte offset of block 0 in the backing buffer
    block_stride: int


class PagedKVCache:
    """Byte-level reader/writer of the cached groups' pages in vLLM's KV buffer."""

    def __init__(
        self,
        kv_caches: dict[str, Any],
        kv_cache_config: KVCacheConfig,
        groups: tuple[CacheGroup, ...],
    ) -> None:
        any_cache = next(iter(kv_caches.values()))
        tensor = any_cache if isinstance(any_cache, torch.Tensor) else any_cache[0]
        storage = tensor.untyped_storage()
        # One uint8 view over the whole backing allocation (shared by every layer).
        self._raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self._groups = {g.group_id: g for g in groups}
        self._layers: dict[str, _LayerPages] = {}
        for t in kv_cache_config.kv_cache_tensors:
            for idx, name in enumerate(t.layers):
                self._layers[name] = _LayerPages(t.offset + idx * t.layer_stride, t.block_stride)
        missing = [n for g in groups for n in g.layer_names if n not in self._layers]
        if missing:
            raise ValueError(f"no KV cache tensor placement for layers {missing}")
        self._check_views(kv_caches, groups)

    def _check_views(self, kv_caches: dict[str, Any], groups: tuple[CacheGroup, ...]) -> None:
        """Verify the placement arithmetic against the views vLLM bound to the layers."""
        base_ptr = self._raw.data_ptr()
        for g in groups:
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if cache is None:
                    continue
                view = cache if isinstance(cache, torch.Tensor) else cache[0]
                if view.untyped_storage().data_ptr() != base_ptr:
                    raise ValueError(f"layer {name} is not in the shared KV buffer")
                if view.data_ptr() - base_ptr != self._layers[name].base:
                    raise ValueError(
                        f"layer {name}: view starts at byte {view.data_ptr() - base_ptr}, "
                        f"placement says {self._layers[name].base}"
                    )

    def object_bytes(self, group_id: int, num_blocks: int) -> int:
        g = self._groups[group_id]
        return g.page_bytes * len(g.layer_names) * num_blocks

    def read(self, group_id: int, block_ids: list[int]) -> bytes:
        """The object for ``block_ids`` of one group: layer-major, then block order."""
        g = self._groups[group_id]
        parts = []
        for name in g.layer_names:
            lp = self._layers[name]
            for b in block_ids:
                start = lp.base + b * lp.block_stride
                parts.append(self._raw[start : start + g.page_bytes])
        data = torch.cat(parts)
        if data.device.type != "cpu":
            data = data.cpu()
        return data.numpy().tobytes()

    def write(self, group_id: int, block_ids: list[int], payload: bytes | memoryview) -> None:
        """Scatter an object read by :meth:`read` back into ``block_ids``."""
        g = self._groups[group_id]
        expected = self.object_bytes(group_id, len(block_ids))
        if len(payload) != expected:
            raise ValueError(f"group {group_id}: object of {len(payload)} bytes, expected {expected}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we only read from it
            src = torch.frombuffer(payload, dtype=torch.uint8)
        if self._raw.device.type != "cpu":
            src = src.to(self._raw.device)
        pos = 0
        for name in g.layer_names:
            lp = self._layers[name]
            for b in block_ids:
                start = lp.base + b * lp.block_stride
                self._raw[start : start + g.page_bytes].copy_(src[pos : pos + g.page_bytes])
                pos += g.page_bytes

    def write_layer_page(self, layer_name: str, group_id: int, block_id: int,
                         page: bytes | memoryview) -> None:
        """Write one layer's page of one block (loads that skip locally held blocks)."""
        g = self._groups[group_id]
        if len(page) != g.page_bytes:
            raise ValueError(f"page of {len(page)} bytes, expected {g.page_bytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src = torch.frombuffer(page, dtype=torch.uint8)
        lp = self._layers[layer_name]
        start = lp.base + block_id * lp.block_stride
        self._raw[start : start + g.page_bytes].copy_(src.to(self._raw.device))
