"""Weight-only int8 and int4 matmuls on the CPU kernels torch ships, so that fewer weight
bytes become faster decoding instead of an extra dequantize step.

`QuantLinear` rebuilds the fp32 weight from its codes on every call: it reads the small
weight, writes a full fp32 copy, then the matmul reads that copy again. Slower than fp32.
A real quantized kernel reads the codes once and dequantizes them in registers, inside
the matmul. torch 2.13 has two such CPU kernels:

    int8   torch.ops.aten._weight_int8pack_mm(x, q [N, K] int8, scale [N])
           y = x @ (q * scale[:, None]).T: our symmetric per-channel INT8 codes as they
           are (`absmax_quantize`), the scale as a vector.
    int4   torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes [N, K] int32, 1)
           torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz [K/g, N, 2])
           the codes 0..15 of `Int4Weight` (unpacked, one int32 each) re-packed into the
           kernel's own layout; sz[g, n] = (scale, offset) with w = (q - 8) * scale + offset
           ("tinygemm" layout, a float offset instead of an integer zero point). Our
           asymmetric w = (q - zero) * scale is the same number with offset = (8 - zero) *
           scale, so the conversion is exact; symmetric codes have zero = 8, offset 0.

What the kernels need, measured on torch 2.13 (checked by `kernel_skip_reason`):

- activations in bfloat16. With fp32 or fp16 activations both kernels take a scalar
  path 3-25x slower than fp32 `F.linear` (measured on SmolLM2-135M shapes); with bf16
  they run vectorised, about 2x faster than fp32 at batch 1. The layer
  casts x to bf16 and the result back, so its output differs from dequantize-then-matmul
  by bf16 rounding of x (tests/test_cpu_kernels.py bounds it).
- int8: K a multiple of 16 (the bf16 path crashes with a segfault otherwise, not an error).
- int4: N a multiple of 16, group size 32, 64, 128 or 256.

minillm's own C kernels (`minillm.kernels.matvec`'s `Int8Product` and `Q4Product`, backend
"c") read int8 codes with a scale per row (scheme 'int8') and Q4_1 codes (scheme 'q4_1-g32')
and keep fp32 activations at their interface: inside, each row of x is rounded to int8 per
block of 32 (llama.cpp's way), so that every block's dot product is an integer one. On one
core they decode faster than torch's kernels above (chapter 06's peers benchmark measures
both beside llama.cpp).
"""

from __future__ import annotations

import torch

from minillm.kernels.matvec import BLOCK, matvec_status
from minillm.quant.formats import Int4Weight, unpack_int4

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
COMPUTE_DTYPE = torch.bfloat16  # the only activation dtype with a fast path


def int8_skip_reason(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> str | None:
    """Why the int8 kernel cannot run these codes (None: it can)."""
    if zero is not None:
        return "asymmetric int8 (the kernel has no zero point): use scheme 'int8'"
    if scale.numel() != q.shape[0]:
        return "per-tensor int8 scale: use per-channel scheme 'int8'"
    if q.shape[1] % 16:
        return f"in_features={q.shape[1]} is not a multiple of 16"
    return None


def int4_skip_reason(qw: Int4Weight) -> str | None:
    """Why the int4 kernel cannot run this weight (None: it can)."""
    n = qw.packed.shape[0]
    if qw.group_size not in KERNEL_GROUP_SIZES:
        return f"group size {qw.group_size} is not one of {KERNEL_GROUP_SIZES}"
    if n % 16:
        return f"out_features={n} is not a multiple of 16"
    return None


def int4_scales_and_offsets(qw: Int4Weight, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
    """[in / group, out, 2]: (scale, offset) per group in the kernel's layout, where
    w = (q - 8) * scale + offset; ours is w = (q - zero) * scale, so offset = (8 - zero) *
    scale (zero = 8 for symmetric codes), or Q4_1's w = q * scale + minimum, so offset =
    minimum + 8 * scale."""
    scale = qw.scale.float()
    if qw.minimum is not None:  # Q4_1: w = q * scale + minimum
        offset = qw.minimum.float() + 8.0 * scale
    else:
        zero = torch.full_like(scale, 8.0) if qw.zero is None else qw.zero.float()
        offset = (8.0 - zero) * scale
    pairs = torch.stack([scale, offset], dim=-1)  # [out, groups, 2]
    return pairs.transpose(0, 1).contiguous().to(dtype)


# Looked up once: `torch.ops.aten.<name>` resolves through two namespace objects per call.
_INT8_MM = torch.ops.aten._weight_int8pack_mm
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu


class Int8Kernel:
    """y = x @ (q * scale).T with `_weight_int8pack_mm`, activations cast to `dtype`
    (bf16: the fast path; fp32: the slow exact one, which tests use to check layouts).

    A plain callable, not an `nn.Module`: at batch 1 a decode step calls one kernel per
    linear layer (210 in SmolLM2-135M) and each takes 10-20 us, so the 5-8 us a nested
    module call and its buffer lookups added were a real share of the step (Zen 4 EPYC,
    benchmarks/quant_decode.py, 3 runs each: int4 1.90-1.95x fp32 as a module, 2.00-2.07x
    as a plain callable). It holds CPU tensors only, which is all the kernel runs on."""

    __slots__ = ("q", "scale", "dtype")

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = COMPUTE_DTYPE
    ) -> None:
        reason = int8_skip_reason(q, scale, None)
        if reason is not None:
            raise ValueError(f"the int8 CPU kernel cannot run this weight: {reason}")
        self.q = q  # the layer's own codes: no second copy
        self.scale = scale.reshape(-1).to(dtype)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype)
        y = _INT8_MM(flat, self.q, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class Int4Kernel:
    """y = x @ W.T with `_weight_int4pack_mm_for_cpu`; W an `Int4Weight` re-packed once
    into the kernel's layout (the same 4 bits per weight, in another order); activations
    cast to `dtype`; a plain callable as `Int8Kernel` is."""

    __slots__ = ("packed", "scales_and_offsets", "group_size", "dtype")

    def __init__(self, qw: Int4Weight, dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        reason = int4_skip_reason(qw)
        if reason is not None:
            raise ValueError(f"the int4 CPU kernel cannot run this weight: {reason}")
        codes = unpack_int4(qw.packed).to(torch.int32)  # [N, K] values 0..15
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_and_offsets = int4_scales_and_offsets(qw, dtype)
        self.group_size, self.dtype = qw.group_size, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype)
        y = _INT4_MM(flat, self.packed, self.group_size, self.scales_and_offsets)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def c_skip_reason(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, qw: Int4Weight | None
) -> str | None:
    """Why minillm's C kernels cannot run this layer (None: they can): int8 codes `q` with
    `scale` and `zero`, or the 4-bit weight `qw`."""
    ok, why = matvec_status()
    if not ok:
        return why
    if qw is not None:
        if qw.minimum is None:
            return "the C int4 kernel takes Q4_1 codes (a float minimum): use scheme 'q4_1-g32'"
        if qw.group_size != BLOCK:
            return f"the C int4 kernel takes groups of {BLOCK}, not {qw.group_size}"
        inner = qw.packed.shape[1] * 2
    else:
        if zero is not None or scale.numel() != q.shape[0]:
            return "the C int8 kernel takes symmetric per-channel codes: use scheme 'int8'"
        inner = q.shape[1]
    return None if inner % BLOCK == 0 else f"in_features={inner} is not a multiple of {BLOCK}"
