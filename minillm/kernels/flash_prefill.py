"""Flash-attention-style prefill: causal attention over a whole prompt without the T x T
score matrix.

Plain attention writes the scores S = QK^T (T x T per head) to memory, softmaxes them, and
reads them back to multiply by V. Flash attention never materialises S: a program owns
BLOCK_M query rows, walks the keys BLOCK_N at a time, and keeps for each row a running max
m, a running denominator l and a running weighted sum acc (the online softmax). When a new
tile raises the max, what was summed so far is rescaled by exp(m_old - m_new). Causality
lets a program stop at its diagonal tile: keys after the last query row are never read.

Layouts: q [B, heads, T, D], k/v [B, kv_heads, T, D] (grouped-query attention: query head
h reads kv head h // (heads / kv_heads)); out like q. On a machine without a GPU the kernel
runs in Triton's interpreter (`minillm.kernels` decides).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minillm.kernels import require_triton


@triton.jit
def _flash_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    scale,
    T,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 dot products in full precision (no TF32 on GPU)
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions of this program
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D_P2)
    row_ok, dim_ok = rows < T, dims < D
    q_base = q_ptr + b * stride_qb + h * stride_qh
    kv_off = b * stride_kb + (h // GROUP) * stride_kh
    q = tl.load(
        q_base + rows[:, None] * stride_qt + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    # Causal: keys past this tile's last row are masked for every row, so skip them.
    end = tl.minimum((tile + 1) * BLOCK_M, T)
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        kv_mask = (keys < T)[:, None] & dim_ok[None, :]
        offs = kv_off + keys[:, None] * stride_kt + dims[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_P2]
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # scale includes log2(e): exp2 below is exp
        visible = (keys[None, :] <= rows[:, None]) & (keys[None, :] < T)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        out_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def prefill_tiles(head_dim: int, device: torch.device) -> dict[str, int]:
    """Tile sizes by device: 16 x 16 in the interpreter (each program runs in Python); on a
    GPU 64 query rows by 64 keys, 4 warps, 3 pipeline stages: the fastest of the five
    configurations `make gpu-check` swept on an H200 for head_dim 128 (0.72x the time of
    SDPA's flash backend at 2k tokens, where 64 x 64 with 8 warps took 1.24x) and for
    head_dim 64 (0.93x; benchmarks/results/gpu-h200.md)."""
    if device.type != "cuda":
        return dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention out [B, heads, T, D], equal to SDPA(q, k, v, is_causal=True,
    enable_gqa=True). Tiles (powers of two, >= 16) and launch parameters left as None come
    from `prefill_tiles`."""
    require_triton()
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if H % k.shape[1]:
        raise ValueError(f"{H} query heads is not a multiple of {k.shape[1]} kv heads")
    cfg = prefill_tiles(D, q.device)
    given = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg.update({name: n for name, n in given.items() if n is not None})
    for name in ("block_m", "block_n"):
        n = cfg[name]
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n}: tiles must be powers of two >= 16 (tl.dot's minimum)")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    grid = (triton.cdiv(T, cfg["block_m"]), B, H)
    _flash_prefill_kernel[grid](
        q,
        k,
        v,
        out,
        (scale or 1 / math.sqrt(D)) * 1.4426950408889634,  # log2(e): the kernel uses exp2
        T,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        GROUP=H // k.shape[1],
        D=D,
        D_P2=max(16, triton.next_power_of_2(D)),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        IEEE=q.dtype == torch.float32,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
