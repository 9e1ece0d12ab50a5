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
  their prefill. A block joins the cache only once its K/V are written (`mark_computed`):
  a prompt prefilled in chunks must not be "found" before its blocks hold anything. A
  cached block nobody uses stays in the pool until memory is needed, then the least
  recently used one is evicted.
- **swap** (preemption): a sequence's blocks can be copied to a second, CPU pool and their
  device blocks released, then copied back into fresh blocks when it resumes.

The manager keeps no per-sequence state: a sequence (`PagedSequence`, which the engine's
`Sequence` extends) owns its tokens, its block table and its counts, and the manager reads
and updates them. It is pure Python (block ids, no tensors); `minillm.cache.paged.
PagedKVCache` holds the tensors. When the pool is exhausted it raises `OutOfBlocks` and
changes nothing: a scheduler catches it and preempts a sequence.
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
    """One physical block: who uses it and, once full and written, which tokens it holds."""

    id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to verify a hit


@dataclass(eq=False)
class PagedSequence:
    """A sequence as the block manager sees it: every token whose K/V it needs (prompt and
    output) and where those K/V live. The sequence owns this; the manager updates it."""

    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)  # physical block per logical block
    block_hashes: list[int] = field(default_factory=list)  # chained hash per computed full block
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at allocation
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    swapped: bool = False  # True: block_table holds CPU swap blocks
    # False: allocate computes every token, cached or not (a request that wants the
    # log-probabilities of its prompt needs the logits of every prompt position)
    reads_prefix_cache: bool = True

    def __len__(self) -> int:
        return len(self.token_ids)


class BlockManager:
    """Allocate, share, publish, swap and free fixed-size KV blocks for many sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        prefix_cache: bool = True,
        hash_fn: Callable[[int | None, Sequence[int]], int] = block_hash,
        num_swap_blocks: int = 0,
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
        self.free_swap_ids: deque[int] = deque(range(num_swap_blocks))  # CPU swap blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached but unreferenced."""
        return len(self.free_ids) + len(self.evictable)

    def slot(self, seq: PagedSequence, position: int) -> int:
        """Flat slot index (block id * block_size + offset) of a token position."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, seq: PagedSequence) -> list[int]:
        """Ids of the cached blocks that hold this prompt's first full blocks. The block of
        the last token never counts: its logits must be computed, so it is prefilled."""
        hits, h, bs, token_ids = [], None, self.block_size, seq.token_ids
        if not self.prefix_cache or not seq.reads_prefix_cache:
            return hits
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(h, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # miss/collision
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: PagedSequence) -> bool:
        """Whether allocate(seq) would succeed now."""
        hits = self._prefix_hits(seq)
        revived = sum(b in self.evictable for b in hits)  # reused, so no longer evictable
        need = self.blocks_for(len(seq)) - len(hits)
        return need <= self.num_free_blocks - revived

    def can_append(self, seq: PagedSequence) -> bool:
        """Whether append_slots(seq) would succeed now."""
        return self._append_need(seq) <= self.num_free_blocks

    def _append_need(self, seq: PagedSequence) -> int:
        """New blocks append_slots needs: to cover every token, plus a private copy of a
        shared last block that still has room (the next token would be written into it)."""
        covered = len(seq.block_table) * self.block_size
        new = self.blocks_for(len(seq)) - len(seq.block_table)
        first_write = seq.num_computed_tokens
        last = self.blocks[seq.block_table[-1]] if seq.block_table else None
        shared_tail = last is not None and last.ref_count > 1 and first_write < covered
        return new + shared_tail

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

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unused block becomes free, or evictable if cached."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def allocate(self, seq: PagedSequence) -> int:
        """Give a new sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns how many leading tokens are already cached (a multiple of block_size; their
        prefill is skipped). Raises OutOfBlocks, changing nothing, when the pool is short."""
        if seq.block_table:
            raise ValueError("the sequence already has blocks: free() it first")
        if len(seq) == 0:
            raise ValueError("empty prompt: give at least one token")
        if not self.can_allocate(seq):
            raise OutOfBlocks(
                f"{len(seq)} tokens need {self.blocks_for(len(seq))} blocks of "
                f"{self.block_size}; {self.num_free_blocks} free"
            )
        seq.block_hashes = []
        for block_id in self._prefix_hits(seq):
            self.evictable.pop(block_id, None)
            block = self.blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size
        while len(seq.block_table) < self.blocks_for(len(seq)):
            seq.block_table.append(self._take_block().id)
        return seq.num_cached_tokens

    def append_slots(self, seq: PagedSequence) -> list[tuple[int, int]]:
        """Make the table cover every token of the sequence (the ones appended since its
        last step included). Returns the (src, dst) block copies the cache must make first:
        a shared last block with room left is replaced by a private copy (copy-on-write).
        Raises OutOfBlocks, changing nothing."""
        if not self.can_append(seq):
            raise OutOfBlocks(f"the sequence needs {self._append_need(seq)} new blocks")
        copies = []
        covered = len(seq.block_table) * self.block_size
        last = self.blocks[seq.block_table[-1]] if seq.block_table else None
        if last is not None and last.ref_count > 1 and seq.num_computed_tokens < covered:
            last.ref_count -= 1  # shared with a fork, and about to be written: copy it
            new = self._take_block()
            seq.block_table[-1] = new.id
            copies.append((last.id, new.id))
        while len(seq.block_table) < self.blocks_for(len(seq)):
            seq.block_table.append(self._take_block().id)
        return copies

    def mark_computed(self, seq: PagedSequence, num_tokens: int) -> None:
        """The K/V of the sequence's first `num_tokens` tokens are now written: publish the
        full blocks among them to the prefix cache (if an equal block is cached already,
        the first one stays the cached one)."""
        seq.num_computed_tokens = num_tokens
        bs = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // bs):
            chunk = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            prev = seq.block_hashes[-1] if index else None
            seq.block_hashes.append(self.hash_fn(prev, chunk))
            block = self.blocks[seq.block_table[index]]
            h = seq.block_hashes[-1]
            if self.prefix_cache and block.hash is None and h not in self.cached:
                self.cached[h] = block.id
                block.hash, block.token_ids = h, chunk

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """Give `child` (with the parent's tokens) the parent's blocks, shared (ref + 1)."""
        if child.block_table:
            raise ValueError("the child already has blocks: free() it first")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: PagedSequence) -> None:
        """Drop the sequence's references (tail blocks first in LRU order: they are the
        least shareable) and forget where its K/V were: nothing of it is computed now."""
        if seq.swapped:
            self.free_swap_ids.extend(seq.block_table)
        else:
            for block_id in reversed(seq.block_table):
                self._release(block_id)
        seq.block_table, seq.block_hashes, seq.swapped = [], [], False
        seq.num_computed_tokens = 0  # (num_cached_tokens stays: what its admission found)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq: PagedSequence) -> bool:
        return len(seq.block_table) <= len(self.free_swap_ids)

    def swap_out(self, seq: PagedSequence) -> list[tuple[int, int]]:
        """Move the sequence to the CPU pool: returns (device block, swap block) copies to
        make, after which its device blocks are released (shared ones stay with their
        other holders). Raises OutOfBlocks when the swap space is full."""
        if not self.can_swap_out(seq):
            raise OutOfBlocks(f"swap space full: {len(self.free_swap_ids)} CPU blocks free")
        pairs = [(b, self.free_swap_ids.popleft()) for b in seq.block_table]
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table, seq.swapped = [dst for _, dst in pairs], True
        return pairs

    def can_swap_in(self, seq: PagedSequence) -> bool:
        """Room for its swapped blocks and for the tokens appended since (append_slots)."""
        return max(self.blocks_for(len(seq)), len(seq.block_table)) <= self.num_free_blocks

    def swap_in(self, seq: PagedSequence) -> list[tuple[int, int]]:
        """Back into fresh device blocks: returns (swap block, device block) copies to
        make; the swap blocks are free again. Raises OutOfBlocks, changing nothing."""
        if not self.can_swap_in(seq):
            raise OutOfBlocks(f"{len(seq.block_table)} blocks needed to swap in")
        pairs = [(b, self._take_block().id) for b in seq.block_table]
        self.free_swap_ids.extend(seq.block_table)
        seq.block_table, seq.swapped = [dst for _, dst in pairs], False
        computed, seq.block_hashes = seq.num_computed_tokens, []
        self.mark_computed(seq, computed)  # the fresh blocks may rejoin the prefix cache
        return pairs
