"""Fused INT4 dequantize-and-matmul for the decode shape: a few rows of activations times a
group-wise INT4 weight packed two codes per byte (`minillm.quant.formats.quantize_int4`).

At batch-1 decode a linear layer reads every weight once for one row of output: the
time is the weight bytes read. Dequantizing the whole weight to fp16 in memory first
(the PyTorch reference below) reads 0.5 byte/weight, writes 2 and reads 2 again; the
fused kernel reads the 0.5 byte/weight once and dequantizes in registers.

    y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Byte j of a packed row holds code 2j (low nibble) and 2j+1 (high nibble), so instead of
interleaving the nibbles the kernels split x into its even and odd columns:
y = x_even @ w_lo^T + x_odd @ w_hi^T. Two kernels:

- `_int4_matmul_kernel` (prefill-sized M): each program computes a BLOCK_M x BLOCK_N tile
  of y with tensor-core dots (BLOCK_M >= 16, tl.dot's minimum).
- `_int4_gemv_kernel` (decode, a few rows): a dot with one real row would waste 15/16 of
  each 16-row tile, and with N / BLOCK_N programs alone too few weight bytes are in flight
  to fill the memory system. So each program takes BLOCK_N rows of W over 1/SPLIT_K of K,
  multiplies elementwise and sums, and adds its partial result into an fp32 y with an
  atomic add: N / BLOCK_N x SPLIT_K programs read the weight once, all at the same time.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minillm.kernels import require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path still works; the kernel says what is missing
    triton = None


class PackedInt4(Protocol):
    """The packed weight the kernel reads (`minillm.quant.Int4Weight` is one): uint8 codes
    [out, in/2], a scale (and, asymmetric, a uint8 zero point) per group of `group_size`."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    def dequantize(self) -> torch.Tensor: ...


def int4_matmul_reference(x: torch.Tensor, qw: PackedInt4) -> torch.Tensor:
    """PyTorch path: dequantize the whole weight, then x @ w^T (what QuantLinear does)."""
    return x @ qw.dequantize().to(x.dtype).T


if triton is not None:

    @triton.jit
    def _int4_matmul_kernel(
        x_ptr,
        packed_ptr,
        scale_ptr,
        zero_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_pn,
        stride_sn,
        stride_ym,
        GROUP: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # unpacked inputs per step; divides GROUP
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_K // 2)  # byte index inside the K step
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
        for k0 in range(0, K, BLOCK_K):
            byte = k0 // 2 + rj
            p = tl.load(packed_ptr + rn[:, None] * stride_pn + byte[None, :], mask=n_ok, other=0)
            g = k0 // GROUP
            s = tl.load(scale_ptr + rn * stride_sn + g, mask=rn < N, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(zero_ptr + rn * stride_sn + g, mask=rn < N, other=0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            w_lo = ((p & 0xF).to(tl.float32) - z[:, None]) * s[:, None]  # [BLOCK_N, BLOCK_K/2]
            w_hi = ((p >> 4).to(tl.float32) - z[:, None]) * s[:, None]
            col = k0 + 2 * rj
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=m_ok, other=0.0)
            x_odd = tl.load(
                x_ptr + rm[:, None] * stride_xm + col[None, :] + 1, mask=m_ok, other=0.0
            )
            dt = x_even.dtype
            acc += tl.dot(x_even, tl.trans(w_lo.to(dt)))
            acc += tl.dot(x_odd, tl.trans(w_hi.to(dt)))
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok & (rn[None, :] < N))

    @triton.jit
    def _int4_gemv_kernel(
        x_ptr,
        packed_ptr,
        scale_ptr,
        zero_ptr,
        y_ptr,  # fp32 [M, N], zeroed: split programs add into it
        N,
        K,
        stride_xm,
        stride_pn,
        stride_sn,
        stride_ym,
        k_per_split,
        GROUP: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # unpacked inputs per step; divides GROUP
    ):
        pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_K // 2)  # byte index inside the K step
        n_ok = rn < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_start = pid_k * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            p = tl.load(packed_ptr + rn[:, None] * stride_pn + (k0 // 2 + rj)[None, :],
                        mask=n_ok[:, None], other=0)  # fmt: skip
            g = k0 // GROUP
            s = tl.load(scale_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(zero_ptr + rn * stride_sn + g, mask=n_ok, other=0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            col = k0 + 2 * rj
            x_even = tl.load(x_ptr + row * stride_xm + col).to(tl.float32)  # [BLOCK_K/2]
            x_odd = tl.load(x_ptr + row * stride_xm + col + 1).to(tl.float32)
            lo = (p & 0xF).to(tl.float32) - z[:, None]
            hi = (p >> 4).to(tl.float32) - z[:, None]
            acc += s * tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
        tl.atomic_add(y_ptr + row * stride_ym + rn, acc, mask=n_ok)


GEMV_ROWS = 4  # up to this many rows of x, the GEMV kernel (one program row per x row)


def int4_config(m: int, n: int, group_size: int, device: torch.device) -> dict[str, int]:
    """Launch parameters picked by shape. Decode (m <= 16 rows) is a matrix-vector product:
    one 16-row tile (tl.dot's minimum), narrow column tiles so there are enough programs to
    keep every SM reading weights, and long K steps. Prefill-sized m gets square tiles. The
    GPU check sweeps alternatives and reports the fastest against these defaults."""
    on_gpu = device.type == "cuda"
    block_k = min(group_size, 128 if on_gpu else 64)
    if m <= GEMV_ROWS:  # the GEMV kernel: enough (row block, K split) programs for every SM
        return dict(block_m=1, block_n=16, block_k=block_k, split_k=8 if on_gpu else 2,
                    num_warps=4, num_stages=2)  # fmt: skip
    if m <= 16:
        return dict(
            block_m=16, block_n=32 if n <= 8192 else 64, block_k=block_k, num_warps=4, num_stages=3
        )
    return dict(block_m=64, block_n=64, block_k=min(group_size, 64), num_warps=4, num_stages=3)


def int4_matmul(
    x: torch.Tensor,
    qw: PackedInt4,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(qw)^T with the fused Triton kernel. x: [M, K] fp32/fp16 (bf16 too
    on a GPU) on the weight's device (a GPU, or the CPU in Triton's interpreter); y: [M, N]
    in x's dtype. Launch parameters left as None come from `int4_config`."""
    how = require_triton()
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] (flatten batch and time first), got {tuple(x.shape)}")
    N, K = qw.packed.shape[0], qw.packed.shape[1] * 2
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {K}")
    if x.dtype == torch.bfloat16 and how == "interpreter":
        raise ValueError("bf16 x needs a GPU: Triton's interpreter gets bf16 dots wrong")
    cfg = int4_config(x.shape[0], N, qw.group_size, x.device)
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cfg.update({k: v for k, v in given.items() if v is not None})
    if qw.group_size % cfg["block_k"]:
        raise ValueError(f"block_k={cfg['block_k']} must divide group_size={qw.group_size}")
    x = x.contiguous()
    if cfg.get("split_k"):  # the GEMV kernel
        return _int4_gemv(x, qw, cfg)
    if cfg["block_m"] < 16:
        raise ValueError(f"block_m={cfg['block_m']}: tl.dot needs tiles of at least 16 rows")
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    zero = qw.zero if qw.zero is not None else qw.scale  # unused when HAS_ZERO is False
    grid = (triton.cdiv(x.shape[0], cfg["block_m"]), triton.cdiv(N, cfg["block_n"]))
    _int4_matmul_kernel[grid](
        x,
        qw.packed,
        qw.scale,
        zero,
        y,
        x.shape[0],
        N,
        K,
        x.stride(0),
        qw.packed.stride(0),
        qw.scale.stride(0),
        y.stride(0),
        GROUP=qw.group_size,
        HAS_ZERO=qw.zero is not None,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def _int4_gemv(x: torch.Tensor, qw: PackedInt4, cfg: dict[str, int]) -> torch.Tensor:
    """Launch the GEMV kernel: grid (row blocks of W, K splits, rows of x)."""
    N, K = qw.packed.shape[0], qw.packed.shape[1] * 2
    # Each split covers whole K steps, so a step never crosses into the next split.
    k_per_split = -(-K // (cfg["split_k"] * cfg["block_k"])) * cfg["block_k"]
    y = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    zero = qw.zero if qw.zero is not None else qw.scale  # unused when HAS_ZERO is False
    grid = (triton.cdiv(N, cfg["block_n"]), triton.cdiv(K, k_per_split), x.shape[0])
    _int4_gemv_kernel[grid](
        x,
        qw.packed,
        qw.scale,
        zero,
        y,
        N,
        K,
        x.stride(0),
        qw.packed.stride(0),
        qw.scale.stride(0),
        y.stride(0),
        k_per_split,
        GROUP=qw.group_size,
        HAS_ZERO=qw.zero is not None,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y.to(x.dtype)
