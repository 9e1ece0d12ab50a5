"""Chapter 07 answers: the reference for `exercises/ch07_paged_attention.py`.

Written from scratch in plain Python and torch (no minillm import): the tests compare
these functions with `minillm.cache`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block chained with the hash of the block before it."""
    return hash((prev_hash, tuple(token_ids)))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One chained hash per full block of `token_ids`; a partial last block gets none."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hashes[-1] if hashes else None
        hashes.append(block_hash(prev, token_ids[start : start + block_size]))
    return hashes


def cow_append(
    block_table: list[int],
    num_tokens: int,
    ref_counts: list[int],
    free_blocks: list[int],
    block_size: int,
) -> tuple[int, tuple[int, int] | None]:
    """Reserve the slot of token number `num_tokens`, copying a shared last block first."""
    offset = num_tokens % block_size
    if offset == 0:  # every block in the table is full (or there is none): open one
        if not free_blocks:
            raise RuntimeError("no free block: preempt a sequence and retry")
        new = free_blocks.pop(0)
        ref_counts[new] = 1
        block_table.append(new)
        return new * block_size, None
    last = block_table[-1]
    if ref_counts[last] == 1:  # ours alone: write in place
        return last * block_size + offset, None
    if not free_blocks:
        raise RuntimeError("no free block for copy-on-write: preempt a sequence and retry")
    new = free_blocks.pop(0)
    ref_counts[new] = 1
    ref_counts[last] -= 1
    block_table[-1] = new
    return new * block_size + offset, (last, new)


def gather_kv(pool: torch.Tensor, block_table: Sequence[int], length: int) -> torch.Tensor:
    """One sequence's first `length` cached vectors, read through its block table."""
    block_size = pool.shape[1]
    needed = -(-length // block_size)
    if needed > len(block_table):
        raise ValueError(f"{length} tokens need {needed} blocks; the table has {len(block_table)}")
    blocks = pool[torch.as_tensor(list(block_table[:needed]), dtype=torch.long)]
    return blocks.flatten(0, 1)[:length].transpose(0, 1)
