"""Paged decode attention: one new query token per sequence, K/V read through block tables.

In a decode step every running sequence adds one token, and that token attends to all of
its sequence's cached keys and values, which live scattered over the block pool. Two ways:

- `paged_attention_ref` (PyTorch): gather each sequence's blocks into a contiguous tensor
  (`gather_kv`), then ordinary attention. Simple, but it copies the whole cache every
  step: extra memory traffic on a step that is all memory traffic.
- `paged_attention` (Triton): one program per (sequence, kv head) walks the sequence's
  tokens a tile at a time (a tile spans several blocks: each token's physical block comes
  from the table), reads K/V in place and keeps a running (online) softmax, so nothing is
  gathered. With grouped-query attention the program serves all the query heads of its kv
  head at once, as the rows of one matrix product, so each K/V tile is read once, not once
  per query head.

**Split-K (FlashDecoding).** At batch 1 that is only `kv_heads` programs (3 for SmolLM2),
a handful of a GPU's 132 SMs, each walking thousands of tokens alone. So long contexts are
cut into `num_splits` ranges of blocks: each (sequence, kv head, split) program runs the
online softmax over its range and writes a partial result (its max m, denominator l and
unnormalised sum acc); a second kernel merges the splits of each head:

    M = max_s m_s,  out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

which is exactly the softmax over all the keys. The split count is chosen from the block
tables' width (a shape, known without reading the device) and the number of programs the
batch already gives, so choosing it never waits for the GPU.

Layouts (as `minillm.cache.paged.PagedKVCache` stores one layer):
  q             [B, heads, head_dim]            the new token of each sequence
  k_pool/v_pool [num_blocks, block_size, kv_heads, head_dim]
  block_tables  [B, max_blocks] int             physical block of each logical block
  context_lens  [B] int                         tokens cached per sequence (new one included)
"""

from __future__ import annotations

import math

import torch

from minillm.kernels import require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work; the kernel says what is missing
    triton = None


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


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,  # [B, H, D]
        k_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, D]
        v_ptr,
        tables_ptr,  # [B, max_blocks]
        lens_ptr,  # [B]
        out_ptr,  # [B, H, D], or the partial sums [B, H, SPLITS, D] when SPLIT
        m_ptr,  # [B, H, SPLITS] running max of each split (SPLIT only)
        l_ptr,  # [B, H, SPLITS] softmax denominator of each split (SPLIT only)
        scale,  # 1/sqrt(D) * log2(e): the softmax below uses exp2
        tokens_per_split,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_os,
        stride_mb,
        stride_mh,
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_P2: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
        D: tl.constexpr,
        D_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per KV block of the pool
        TILE: tl.constexpr,  # tokens per loop iteration: several blocks read at once
        SPLIT: tl.constexpr,  # write partial (m, l, acc) for the merge kernel
        IEEE: tl.constexpr,  # fp32 dot products in full precision (no TF32)
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, GROUP_P2)
        heads = kv_head * GROUP + rows  # the query heads this program serves
        dims = tl.arange(0, D_P2)
        head_ok = rows < GROUP
        dim_ok = dims < D
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [GROUP_P2, D_P2]: padding rows are zeros, their results are never stored
        ctx_len = tl.load(lens_ptr + seq)
        first = split * tokens_per_split
        last = tl.minimum(first + tokens_per_split, ctx_len)
        # Running softmax state per query head: max score m, denominator l, weighted sum acc.
        m = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P2], tl.float32)  # noqa: E741
        acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
        for start in range(first, last, TILE):
            toks = start + tl.arange(0, TILE)
            tok_ok = toks < last
            # Each token's physical block, through the table: a tile spans several blocks.
            block = tl.load(tables_ptr + seq * stride_tb + toks // BLOCK_SIZE, mask=tok_ok, other=0)
            offs = (
                block[:, None] * stride_kn
                + (toks % BLOCK_SIZE)[:, None] * stride_kt
                + kv_head * stride_kh
                + dims[None, :]
            )
            kv_mask = tok_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)  # [TILE, D_P2]
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(tok_ok[None, :], s * scale, float("-inf"))  # [GROUP_P2, TILE]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        io_mask = head_ok[:, None] & dim_ok[None, :]
        if SPLIT:  # a split past the sequence's end leaves m = -inf, l = 0: it weighs nothing
            base = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os
            tl.store(out_ptr + base + dims[None, :], acc, mask=io_mask)
            stat = seq * stride_mb + heads * stride_mh + split
            tl.store(m_ptr + stat, m, mask=head_ok)
            tl.store(l_ptr + stat, l, mask=head_ok)
        else:
            out = acc / l[:, None]
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=io_mask,
            )

    @triton.jit
    def _merge_splits_kernel(
        acc_ptr,  # [B, H, SPLITS, D] fp32
        m_ptr,  # [B, H, SPLITS]
        l_ptr,
        out_ptr,  # [B, H, D]
        num_splits,
        stride_ab,
        stride_ah,
        stride_as,
        stride_mb,
        stride_mh,
        stride_qb,
        stride_qh,
        D: tl.constexpr,
        D_P2: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):
        seq, head = tl.program_id(0), tl.program_id(1)
        splits = tl.arange(0, SPLITS_P2)
        dims = tl.arange(0, D_P2)
        split_ok, dim_ok = splits < num_splits, dims < D
        stat = seq * stride_mb + head * stride_mh + splits
        m = tl.load(m_ptr + stat, mask=split_ok, other=float("-inf"))
        l = tl.load(l_ptr + stat, mask=split_ok, other=0.0)  # noqa: E741
        weight = tl.exp2(m - tl.max(m, axis=0))  # m in log2 units; empty splits: 2^-inf = 0
        acc = tl.load(
            acc_ptr
            + seq * stride_ab
            + head * stride_ah
            + splits[:, None] * stride_as
            + dims[None, :],
            mask=split_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * l, axis=0)
        tl.store(
            out_ptr + seq * stride_qb + head * stride_qh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_ok,
        )


_SM_COUNT: dict[int, int] = {}


def choose_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """How many ranges to cut each sequence's blocks into: enough programs to give every
    SM about two (the batch's own programs count), at least 8 blocks per range so each
    program has work worth its launch, and never more ranges than blocks."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        programs_wanted = 2 * _SM_COUNT[index]
    else:  # the interpreter: no SMs; a small split still exercises the merge path
        programs_wanted = 8
    splits = -(-programs_wanted // (batch * kv_heads))
    return max(1, min(splits, max_blocks // 8, max_blocks))


def decode_tile(head_dim: int, device: torch.device) -> dict[str, int]:
    """Tokens per loop iteration and warps: 64-token tiles (several KV blocks per load, so
    each iteration has enough memory traffic in flight) on a GPU; 16 in the interpreter. The
    GPU check sweeps others."""
    if device.type != "cuda":
        return dict(tile=16, num_warps=4)
    return dict(tile=64, num_warps=4 if head_dim <= 64 else 8)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; same arguments and result as `paged_attention_ref`.
    `num_splits`: ranges of blocks per sequence (1 = no split-K; None = `choose_splits`);
    `tile`, `num_warps`: launch parameters (None: `decode_tile`). Nothing here reads a device
    value on the host, so a step never waits for the GPU."""
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
    cfg = decode_tile(D, q.device)
    cfg.update({k: v for k, v in dict(tile=tile, num_warps=num_warps).items() if v is not None})
    if cfg["tile"] < 16 or cfg["tile"] & (cfg["tile"] - 1):
        raise ValueError(f"tile={cfg['tile']}: a power of two >= 16 (tl.dot's minimum)")
    # Checked on the device (no host sync on a GPU): an empty row would divide by zero.
    torch._assert_async((context_lens >= 1).all(), "every sequence needs context_lens >= 1")
    max_blocks = block_tables.shape[1]
    splits = num_splits or choose_splits(B, kv_heads, max_blocks, q.device)
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    group = H // kv_heads
    per_split = -(-max_blocks // splits) * block_size  # tokens, whole blocks per split
    if splits == 1:
        part, m, l = out, out, out  # noqa: E741 (m, l unused without SPLIT)
        part_strides = (out.stride(0), out.stride(1), 0)
        stat_strides = (0, 0)
    else:
        part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)  # noqa: E741
        part_strides = (part.stride(0), part.stride(1), part.stride(2))
        stat_strides = (m.stride(0), m.stride(1))
    d_p2 = max(16, triton.next_power_of_2(D))
    _paged_decode_kernel[(B, kv_heads, splits)](
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        part,
        m,
        l,
        (scale or 1 / math.sqrt(D)) * 1.4426950408889634,  # log2(e): the kernel uses exp2
        per_split,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        tables.stride(0),
        *part_strides,
        *stat_strides,
        GROUP=group,
        GROUP_P2=max(16, triton.next_power_of_2(group)),
        D=D,
        D_P2=d_p2,
        BLOCK_SIZE=block_size,
        TILE=cfg["tile"],
        SPLIT=splits > 1,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg["num_warps"],
    )
    if splits > 1:
        _merge_splits_kernel[(B, H)](
            part,
            m,
            l,
            out,
            splits,
            *part_strides,
            *stat_strides,
            out.stride(0),
            out.stride(1),
            D=D,
            D_P2=d_p2,
            SPLITS_P2=triton.next_power_of_2(splits),
        )
    return out
