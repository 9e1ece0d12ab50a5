"""Chapter 07 answers: the reference for `exercises/ch07_paged_attention.py`.

Written from scratch in plain Python and torch (no minillm import): the tests compare
these functions with `minillm.cache`.
"""

from __future__ import annotations

import os
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


# --- the paged decode kernel (Triton) -----------------------------------------------------
# Triton compiles for a GPU; without CUDA it runs kernels in its CPU interpreter, which it
# reads from TRITON_INTERPRET when a kernel is defined, so set it before importing triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, H, D] one query per sequence and head
    k_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, D] the pool
    v_ptr,
    tables_ptr,  # [B, max_blocks]
    lens_ptr,  # [B]
    out_ptr,  # [B, H, D]
    max_blocks,
    scale,
    H: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // (H // KV_HEADS)  # grouped-query attention: heads share a kv head
    d, t = tl.arange(0, D), tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (seq * H + head) * D + d).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    m = tl.zeros([], dtype=tl.float32) - float("inf")  # running max of the scores
    denom = tl.zeros([], dtype=tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([D], dtype=tl.float32)  # running sum of exp(score - m) * v
    for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * max_blocks + i)  # logical block i -> physical
        valid = i * BLOCK_SIZE + t < length  # the last block may be partly filled
        offsets = ((block * BLOCK_SIZE + t[:, None]) * KV_HEADS + kv_head) * D + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(scores - m_new)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + (seq * H + head) * D + d, (acc / denom).to(out_ptr.dtype.element_ty))


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Decode attention read in place through block tables: one program per (sequence,
    head) walks the sequence's blocks with an online softmax."""
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, H)](
        q.contiguous(),
        k_pool.contiguous(),
        v_pool.contiguous(),
        block_tables.contiguous(),
        context_lens.contiguous(),
        out,
        block_tables.shape[1],
        D**-0.5,
        H=H,
        KV_HEADS=kv_heads,
        BLOCK_SIZE=block_size,
        D=D,
    )
    return out
