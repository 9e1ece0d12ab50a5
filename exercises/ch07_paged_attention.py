"""Chapter 07 exercises: the bookkeeping behind PagedAttention, on plain lists and tensors.

Notebook 07 adds `minillm/cache/block_manager.py`: the KV cache cut into blocks of
`block_size` tokens drawn from one pool, a block table per sequence (logical block i ->
physical block id),
reference counts so that sequences can share blocks, copy-on-write when a shared block is
written, and a prefix cache that finds a new prompt's first blocks already in the pool.
Here you write the four pieces that make it work:

    block_hash            the name of a full block in the prefix cache
    prefix_block_hashes   the names of all of a prompt's full blocks
    cow_append            reserve the slot of a sequence's next token, copy-on-write
    gather_kv             read one sequence's K (or V) back through its block table
    paged_decode          the same read inside a Triton kernel, with an online softmax

Slots are numbered flat: the slot of offset o in physical block b is b * block_size + o.
Replace each `raise NotImplementedError(...)` with your code. Grade them with

    make grade CH=07    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch07

and one exercise with `-k "ch07 and cow_append"`. The answers are in
`solutions/ch07_paged_attention.py`: try first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block chained with the hash of the block before it.

    The prefix cache names a full block by its tokens *and everything before them*: block
    i of a prompt is only reusable if blocks 0..i-1 are equal too, because its keys and
    values depend on the whole prefix (attention mixed it in at every layer). Chaining
    does that in O(block_size) per block: hash the pair (previous block's hash, this
    block's tokens). The first block has no predecessor: `prev_hash` is None.

    Args:
        prev_hash: the previous block's hash, or None for the first block.
        token_ids: the block's token ids (a list or a tuple: both must give the same hash).

    Returns:
        An int, the same for equal inputs every time in this process.

    Pitfalls: lists are not hashable (convert to a tuple); hashing only the block's own
    tokens would make block [3, 4] after [1, 2] and after [9, 9] collide, and serve one
    prompt's K/V to another. A hash may still collide by chance: minillm compares the
    stored tokens on every hit, and so should any prefix cache.
    """
    raise NotImplementedError("ch07: implement block_hash")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One chained hash per full block of `token_ids`; a partial last block gets none.

    Block i covers tokens i*block_size .. (i+1)*block_size - 1. Its hash is
    block_hash(hash of block i-1, those tokens), with None before block 0. A block that is
    not full has no hash: more tokens will be written into it, so it cannot be shared yet.

    Example, block_size 2: [5, 6, 7, 8, 9] -> [h0, h1] with h0 = block_hash(None, [5, 6])
    and h1 = block_hash(h0, [7, 8]); token 9 sits in a partial block and gets no hash.

    Two prompts that agree on their first k full blocks get the same first k hashes, and
    differ from the first differing block on: that is how allocate() finds a prefix hit.

    Pitfalls: len(token_ids) // block_size hashes, not ceil; chain from the previous
    *hash*, not from the previous tokens; use your own `block_hash`.
    """
    raise NotImplementedError("ch07: implement prefix_block_hashes")


def cow_append(
    block_table: list[int],
    num_tokens: int,
    ref_counts: list[int],
    free_blocks: list[int],
    block_size: int,
) -> tuple[int, tuple[int, int] | None]:
    """Reserve the slot of token number `num_tokens`, copying a shared last block first.

    A sequence holds `num_tokens` tokens in the blocks of `block_table`. Its next token
    (index num_tokens) goes to offset num_tokens % block_size of its last block, except:

    - offset 0: every block is full (or there is none): take the first block of
      `free_blocks` (pop index 0), set its ref count to 1, append it to the table;
    - the last block is shared (ref count > 1, after a fork for parallel sampling or
      beam search): writing into it would change the other sequences' cache. Copy on
      write: take a free block, give it ref count 1, drop one reference from the old
      block, put the new block in the table's last place, and return (old, new) so the
      caller copies the old block's K/V into the new one before writing.

    Change the three lists in place. Returns (slot, copy): slot = block * block_size +
    offset of the new token, copy = (src, dst) block ids or None.

    Raises RuntimeError when a block is needed and `free_blocks` is empty, *before*
    changing anything (a scheduler catches it and preempts a sequence).

    Pitfalls: a full shared block needs no copy (nobody writes into it again, the next
    token opens a new block); the offset stays the same after a copy; decrement the old
    block's count, do not zero it: the other sequences still hold it.
    """
    raise NotImplementedError("ch07: implement cow_append")


def gather_kv(pool: torch.Tensor, block_table: Sequence[int], length: int) -> torch.Tensor:
    """One sequence's first `length` cached vectors, read through its block table.

    `pool` is one layer's K (or V) pool [num_blocks, block_size, kv_heads, head_dim]: slot o
    of physical block b holds the vector of some sequence's token. Token t of this
    sequence sits in block block_table[t // block_size] at offset t % block_size.

    Returns a contiguous [kv_heads, length, head_dim] tensor, token t at index t: what a
    dense attention (torch SDPA) needs. This is the PyTorch reference path of PagedAttention;
    the Triton kernel in notebook 07 reads the same slots without building this copy.

    Raises ValueError (naming the numbers) when the table has fewer blocks than `length`
    tokens need; extra blocks in the table are ignored.

    Pitfalls: the blocks of a table are not consecutive in the pool (that is the point);
    the last block may be partly filled: cut at `length`; index with a long tensor.
    """
    raise NotImplementedError("ch07: implement gather_kv")


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
        # Your code: the body of the loop over the sequence's blocks (about 12 lines).
        # 1. the physical block of logical block i: tables_ptr + seq * max_blocks + i
        # 2. which of its BLOCK_SIZE slots hold tokens (the last block may be partial)
        # 3. load the block's keys and values of `kv_head` ([BLOCK_SIZE, D], masked)
        # 4. scores = k . q * scale, -inf where the slot is empty
        # 5. the online softmax: a new max, rescale l and acc by exp(m - m_new), add
        #    this block's exp(scores - m_new) and its weighted values
        pass
    tl.store(out_ptr + (seq * H + head) * D + d, (acc / denom).to(out_ptr.dtype.element_ty))


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Decode attention read in place through block tables, as a Triton kernel.

    q [B, H, D] holds one new query per sequence and head; `k_pool`, `v_pool` are a layer's
    pools [num_blocks, block_size, kv_heads, D]; `block_tables` [B, max_blocks] maps each
    sequence's logical block to a physical one (-1 past its end); `context_lens` [B] counts
    each sequence's cached tokens. Returns softmax(q . K^T / sqrt(D)) . V over each
    sequence's tokens: [B, H, D], in q's dtype.

    The launcher below is written: one program per (sequence, head). Write the loop body of
    `_paged_decode_kernel` above: it walks the sequence's blocks one at a time, never
    holding all the scores at once. The online softmax keeps a running max m, a running
    sum `denom` of exp(score - m) and an accumulator of exp(score - m) * v; when a block raises
    the max to m_new, what was summed so far is rescaled by exp(m - m_new). At the end,
    acc / denom is the attention output.

    Pitfalls: a partial last block (mask the loads, and give empty slots a score of -inf,
    not 0); query head h reads kv head h // (H // kv_heads); the pool's layout puts the
    token's slot before its kv head: offset ((block * BLOCK_SIZE + t) * KV_HEADS + kv_head)
    * D + d. On a CPU the kernel runs in Triton's interpreter (slow, but the same code).
    Then delete the `raise` line below.
    """
    raise NotImplementedError("ch07: implement paged_decode")
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
