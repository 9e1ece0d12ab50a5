"""Paged KV cache bookkeeping: chapter 07's fix for the memory a contiguous cache wastes.

A contiguous cache reserves `max_len` slots per sequence up front, most of them empty for
most of the sequence's life. Paging, as in an operating system, cuts the cache into
fixed-size *blocks* (pages) of `block_size` tokens drawn from one shared pool; each
sequence keeps a *block table* (its page table) from logical block i (tokens
i*block_size .. (i+1)*block_size-1) to a physical block. A sequence holds at most one
partly filled block, so at most block_size-1 slots per sequence are wasted.

Blocks carry reference counts, so several tables can point at one block:

- **fork** (parallel sampling, beam search): a child's table is a copy of its parent's;
  the shared last block is copied the first time either writes to it (copy-on-write).
- **prefix cache**: a full block is named by a hash of its tokens chained with the hash
  of the block before it, so equal hashes mean equal prefixes (checked by comparing
  tokens). A new prompt whose first blocks are already in the pool reuses them and skips
  their prefill. A cached block nobody uses stays in the pool until memory is needed,
  then the least recently used one is evicted.

`BlockManager` is pure Python (block ids, no tensors); `minillm.cache.paged.PagedKVCache`
holds the tensors. When the pool is exhausted the manager raises `OutOfBlocks` and changes
nothing: a scheduler catches it and preempts a sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """The pool has no free block for this request; nothing was changed. Free or preempt a
    sequence (or give the pool more blocks) and try again."""


def block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block: its tokens chained with the previous block's hash (None for
    the first block), so a hash names the whole prefix, not just the block."""
    return hash((prev_hash, tuple(token_ids)))


@dataclass
class Block:
    """One physical block: who uses it and, once full, which tokens it holds."""

    id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to verify a hit


@dataclass
class SeqBlocks:
    """A sequence's block table and the tokens whose K/V it stores (or is about to)."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_cached: int = 0  # prompt tokens found in the prefix cache (their prefill is skipped)


class BlockManager:
    """Allocate, share and free fixed-size KV blocks for many sequences (ids are ints)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        prefix_cache: bool = True,
        hash_fn: Callable[[int | None, Sequence[int]], int] = block_hash,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size, self.prefix_cache, self.hash_fn = block_size, prefix_cache, hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # unused, holding nothing cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unused but cached, LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[int, SeqBlocks] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached but unreferenced."""
        return len(self.free_ids) + len(self.evictable)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seq(seq_id).token_ids)

    def slot(self, seq_id: int, position: int) -> int:
        """Flat slot index (block id * block_size + offset) of a token position."""
        blocks = self._seq(seq_id).block_ids
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _seq(self, seq_id: int) -> SeqBlocks:
        if seq_id not in self.tables:
            raise KeyError(f"sequence {seq_id} has no blocks: allocate() it first")
        return self.tables[seq_id]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Ids of the cached blocks that hold this prompt's first full blocks. The block of
        the last token never counts: its logits must be computed, so it is prefilled."""
        hits, h, bs = [], None, self.block_size
        if not self.prefix_cache:
            return hits
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(h, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # miss/collision
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether allocate(token_ids) would succeed now."""
        hits = self._prefix_hits(token_ids)
        revived = sum(b in self.evictable for b in hits)  # reused, so no longer evictable
        need = self._blocks_for(len(token_ids)) - len(hits)
        return need <= self.num_free_blocks - revived

    def can_append(self, seq_id: int) -> bool:
        """Whether append_slot(seq_id, ...) would succeed now."""
        seq = self._seq(seq_id)
        n = len(seq.token_ids)
        if n % self.block_size == 0:  # the table is full: the next token opens a block
            return self.num_free_blocks >= 1
        return self.blocks[seq.block_ids[-1]].ref_count == 1 or self.num_free_blocks >= 1

    # ------------------------------------------------------------------ changes
    def _take_block(self) -> Block:
        """A block with no owner and nothing cached; evicts the LRU cached block if needed."""
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        elif self.evictable:
            block = self.blocks[self.evictable.popitem(last=False)[0]]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block.ref_count = 1
        return block

    def _block_full(self, seq: SeqBlocks, index: int) -> None:
        """The table's block `index` just filled: hash it and put it in the prefix cache
        (if an equal block is cached already, the first one stays the cached one)."""
        bs = self.block_size
        chunk = tuple(seq.token_ids[index * bs : (index + 1) * bs])
        seq.hashes.append(self.hash_fn(seq.hashes[-1] if index else None, chunk))
        block = self.blocks[seq.block_ids[index]]
        if self.prefix_cache and block.hash is None and seq.hashes[-1] not in self.cached:
            self.cached[seq.hashes[-1]] = block.id
            block.hash, block.token_ids = seq.hashes[-1], chunk

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its prompt, reusing cached prefix blocks. Returns
        how many leading prompt tokens are already cached (a multiple of block_size).
        Raises OutOfBlocks, changing nothing, when the pool cannot hold the prompt."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks: free() it first")
        if len(token_ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        if not self.can_allocate(token_ids):
            raise OutOfBlocks(
                f"prompt of {len(token_ids)} tokens needs {self._blocks_for(len(token_ids))} "
                f"blocks of {self.block_size}; {self.num_free_blocks} free"
            )
        seq = SeqBlocks(token_ids=list(token_ids))
        for block_id in self._prefix_hits(token_ids):
            self.evictable.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
            seq.block_ids.append(block_id)
        seq.num_cached = len(seq.block_ids) * self.block_size
        while len(seq.block_ids) < self._blocks_for(len(token_ids)):
            seq.block_ids.append(self._take_block().id)
        self.tables[seq_id] = seq
        for i in range(len(token_ids) // self.block_size):  # full blocks join the cache
            self._block_full(seq, i)
        return seq.num_cached

    def append_slot(self, seq_id: int, token_id: int) -> tuple[int, tuple[int, int] | None]:
        """Reserve the slot for the sequence's next token. Returns (slot, copy): `copy` is
        (src, dst) block ids whose K/V the cache must copy first when the last block was
        shared (copy-on-write), else None. Raises OutOfBlocks, changing nothing."""
        seq = self._seq(seq_id)
        if not self.can_append(seq_id):
            raise OutOfBlocks(f"sequence {seq_id} needs a new block; none is free")
        n, copy = len(seq.token_ids), None
        if n % self.block_size == 0:
            seq.block_ids.append(self._take_block().id)
        else:
            last = self.blocks[seq.block_ids[-1]]
            if last.ref_count > 1:  # shared with a fork: write into a private copy
                last.ref_count -= 1
                new = self._take_block()
                seq.block_ids[-1] = new.id
                copy = (last.id, new.id)
        seq.token_ids.append(token_id)
        if (n + 1) % self.block_size == 0:
            self._block_full(seq, n // self.block_size)
        return self.slot(seq_id, n), copy

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks (shared, ref counts + 1) and tokens."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks: free() it first")
        parent = self._seq(parent_id)
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        self.tables[child_id] = SeqBlocks(
            list(parent.block_ids), list(parent.token_ids), list(parent.hashes), parent.num_cached
        )

    def free(self, seq_id: int) -> None:
        """Drop a sequence's references. A block nobody uses any more becomes free, or
        evictable if cached (tail blocks first in LRU order: they are the least shareable)."""
        seq = self.tables.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} has no blocks (freed twice?)")
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
