"""Paged decode attention: one new query token per sequence, K/V read through block tables.

In a decode step every running sequence adds one token, and that token attends to all of
its sequence's cached keys and values, which live scattered over the block pool. Two ways:

- `paged_attention_ref` (PyTorch): gather each sequence's blocks into a contiguous tensor
  (`gather_kv`), then ordinary attention. Simple, but it copies the whole
  cache every step: extra memory traffic on a step that is all memory traffic.
- `paged_attention` (Triton): one program per (sequence, kv head) walks the sequence's
  block table and reads each K/V block in place, keeping a running (online) softmax, so
  nothing is gathered. With grouped-query attention the program serves all the query heads
  of its kv head at once, so each K/V block is read once, not once per query head.

Layouts (as `minillm.cache.paged.PagedKVCache` stores one layer):
  q             [B, heads, head_dim]            the new token of each sequence
  k_pool/v_pool [num_blocks, block_size, kv_heads, head_dim]
  block_tables  [B, max_blocks] int             physical block of each logical block
  context_lens  [B] int                         tokens cached per sequence (new one included)

Importing this module imports triton: set TRITON_INTERPRET=1 first on a machine without a
GPU (see `minillm.kernels`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minillm.kernels import require_triton


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """PyTorch reference read: pool [num_blocks, block_size, kv_heads, d] and tables
    [B, max_blocks] (-1 = none) to contiguous [B, kv_heads, max_blocks*block_size, d]."""
    g = pool[block_tables.clamp(min=0)]  # [B, max_blocks, block_size, kv_heads, d]
    return g.flatten(1, 2).transpose(1, 2)


def paged_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference: gather K/V through the tables, mask past each length, softmax in fp32."""
    B, H, D = q.shape
    k = gather_kv(k_pool, block_tables).float()  # [B, kv_heads, S, D]
    v = gather_kv(v_pool, block_tables).float()
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H, S, D]
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * (scale or 1 / math.sqrt(D))
    valid = torch.arange(k.shape[2], device=q.device) < context_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v).to(q.dtype)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, D]
    v_ptr,
    tables_ptr,  # [B, max_blocks]
    lens_ptr,  # [B]
    out_ptr,  # [B, H, D]
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_tb,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two (tl.arange needs one)
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block: one tile of the loop
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_P2)  # the query heads this program serves
    dims = tl.arange(0, D_P2)
    head_ok = tl.arange(0, GROUP_P2) < GROUP
    dim_ok = dims < D
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [GROUP_P2, D_P2]
    ctx_len = tl.load(lens_ptr + seq)
    # Running softmax state per query head: max score m, denominator l, weighted sum acc.
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P2], tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    tokens = tl.arange(0, BLOCK_SIZE)
    for i in range(0, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + i)  # logical block i -> physical
        tok_ok = i * BLOCK_SIZE + tokens < ctx_len
        offs = block * stride_kn + tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, D_P2]
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P2, BLOCK_SIZE]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        out_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; same arguments and result as `paged_attention_ref`."""
    require_triton()
    B, H, D = q.shape
    num_blocks, block_size, kv_heads, d_pool = k_pool.shape
    if d_pool != D or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"q head_dim {D}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)} disagree"
        )
    if H % kv_heads:
        raise ValueError(f"{H} query heads is not a multiple of {kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two for this kernel")
    if int(context_lens.min()) < 1:
        raise ValueError("every sequence needs context_lens >= 1 (its new token at least)")
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    group = H // kv_heads
    _paged_decode_kernel[(B, kv_heads)](
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        out,
        scale or 1 / math.sqrt(D),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        tables.stride(0),
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        D=D,
        D_P2=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size,
    )
    return out
