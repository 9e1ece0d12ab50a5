"""A decode step's small ops in C (`rowops.c`): RMSNorm and rotary embedding for the model's
`Ops`, and the attention of one-token rows over a contiguous cache or a paged pool.

At one token a step, `rms_norm` and `apply_rope` (minillm.model.transformer) are seven or
eight PyTorch ops each on a few hundred floats, and a cached attention is a mask, two index
writes and an SDPA call: every op pays its dispatch and allocates a temporary, and together
they cost more than the arithmetic. Here each is one C pass with the signature of what it
replaces: a model takes `rms_norm` and `rope` as `model.ops` (`minillm.model.layout.
use_row_ops`, which `use_matvec` calls), `KVCache` and `PagedKVCache` call
`decode_attention` and `paged_attention` for their decode rows. Each takes fp32 CPU tensors
with no gradient wanted and outside a compile, and hands anything else back (to the
PyTorch op, or None: the caller keeps its path). The library is `matvec.py`'s, compiled
once per machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minillm.kernels.matvec import library

Fallback = Callable[..., torch.Tensor]


def _library() -> Any:
    """The compiled library, or None where it is not built or a compile is tracing (which
    must see the PyTorch ops, not a ctypes call)."""
    return None if torch.compiler.is_compiling() else library()[0]


def _plain(*ts: torch.Tensor) -> bool:
    """fp32 CPU tensors, no gradient wanted: what the C row ops take."""
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.is_cpu and not (grad and t.requires_grad) for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fallback: Fallback) -> torch.Tensor:
    """`fallback(x, weight, eps)`'s RMSNorm over the last dimension, in C where it applies."""
    lib = _library()
    if lib is None or not _plain(x, weight) or not weight.is_contiguous():
        return fallback(x, weight, eps)
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fallback: Fallback) -> torch.Tensor:
    """`fallback(x, cos, sin)`'s rotation of x [B, H, T, d] by tables [B, T, d], in C where
    it applies (x's channels contiguous, the tables contiguous); the result is contiguous."""
    lib = _library()
    if (
        lib is None
        or not _plain(x, cos, sin)
        or x.dim() != 4
        or x.stride(-1) != 1
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != (x.shape[0], x.shape[2], x.shape[3])
        or sin.shape != cos.shape
    ):
        return fallback(x, cos, sin)
    b, h, t, d = x.shape
    y = x.new_empty(b, h, t, d)
    sb, sh, st, _ = x.stride()
    lib.rope_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), b, h, t, d, sb, sh, st)
    return y


def decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
) -> torch.Tensor | None:
    """One decode step's attention for a layer of a contiguous cache, in C: write k, v
    [B, kv_heads, 1, d] into k_cache, v_cache [B, kv_heads, max_len, d] at `positions`
    [B, 1], then attend q [B, heads, 1, d] over each row's slots up to its position within
    the first `kv_len` (the mask `KVCache.causal_mask` draws), each kv head's K and V read
    once for its group of query heads. None (nothing written) where it does not apply:
    not one token a row, not fp32 CPU tensors, a gradient wanted, a compile tracing (it
    sees PyTorch's path)."""
    lib = _library()
    if (
        lib is None
        or q.dim() != 4
        or q.shape[2] != 1
        or k.shape[2] != 1
        or kv_len < 1
        or positions.dtype != torch.int64
        or not _plain(k_cache, v_cache, q, k, v)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    b, heads, _, d = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = positions.reshape(-1).contiguous()
    out = q.new_empty(b, heads, 1, d)
    ptrs = (k_cache, v_cache, q, k, v, pos, out)
    shape = (b, heads, kv_heads, max_len, d, kv_len)
    status = lib.decode_attention_f32(*(t.data_ptr() for t in ptrs), *shape, d**-0.5)
    if status == -2:
        raise IndexError(f"positions {pos.tolist()} go past the cache's {max_len} slots")
    if status != 0:
        raise MemoryError("the C decode attention could not allocate its scores")
    return out


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor | None:
    """Decode rows' attention read in place from a paged pool, in C: q [rows, heads, d]
    over K/V pools [blocks, block_size, kv_heads, d] (this step's K/V already written),
    row r seeing its first lens[r] tokens through its block table tables[r]; each kv head's
    K and V read once for its group of queries. [rows, heads, d], or None where it does not
    apply (not fp32 CPU tensors, a gradient wanted, a compile tracing)."""
    lib = _library()
    if (
        lib is None
        or q.dim() != 3
        or tables.dtype != torch.int64
        or lens.dtype != torch.int64
        or not _plain(q, k_pool, v_pool)
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
    ):
        return None
    rows, heads, d = q.shape
    blocks, block_size, kv_heads, _ = k_pool.shape
    q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()
    out = q.new_empty(rows, heads, d)
    ptrs = (k_pool, v_pool, q, tables, lens, out)
    shape = (rows, heads, kv_heads, blocks, block_size, tables.shape[1], d)
    status = lib.paged_attention_f32(*(t.data_ptr() for t in ptrs), *shape, d**-0.5)
    if status == -2:
        raise IndexError(
            f"lengths {lens.tolist()} need blocks their tables {tables.tolist()} do not hold"
        )
    if status != 0:
        raise MemoryError("the C paged attention could not allocate its scores")
    return out
