"""KV caches the model runs on: contiguous (chapter 02) and paged (chapter 07), with the
paged pool's bookkeeping (`BlockManager`)."""

from minillm.cache.block_manager import BlockManager, OutOfBlocks
from minillm.cache.contiguous import KVCache
from minillm.cache.paged import PagedKVCache

__all__ = ["BlockManager", "KVCache", "OutOfBlocks", "PagedKVCache"]
