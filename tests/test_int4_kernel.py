"""The fused INT4 dequantize-and-matmul Triton kernel against the PyTorch dequantize-then-
matmul path. Runs on a GPU, or on the CPU in Triton's interpreter (small shapes, fp32)."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import triton_status
from minillm.quant import quantize_int4

ok, how = triton_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"Triton kernels cannot run here: {how}")
DEVICE = "cuda" if how == "cuda" else "cpu"


def case(m: int, n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    qw = quantize_int4(w, group, symmetric)
    for name in ("packed", "scale", "zero"):
        if getattr(qw, name) is not None:
            setattr(qw, name, getattr(qw, name).to(DEVICE))
    return x.to(DEVICE), qw


@pytest.mark.parametrize(
    "m, n, k, group, symmetric",
    [
        (1, 48, 128, 32, False),  # one decode row, N not a multiple of the block
        (4, 64, 256, 128, True),  # a few rows, symmetric codes (zero = 8)
        (17, 40, 128, 64, False),  # more rows than one 16-row tile
    ],
)
@pytest.mark.parametrize(
    "launch",
    [
        {},  # int4_config: the GEMV kernel up to 4 rows, tensor-core tiles above
        {"block_n": 64, "block_k": 32, "num_warps": 2},
        {"split_k": 3},  # the GEMV kernel, K cut in 3 (uneven) ranges added atomically
        {"split_k": 0, "block_m": 32},  # the tile kernel, whatever the rows
    ],
)
def test_int4_kernel_matches_dequantize_then_matmul(m, n, k, group, symmetric, launch):
    """The default launch (`int4_config`) and explicit ones compute the same product."""
    from minillm.kernels.int4_matmul import int4_matmul, int4_matmul_reference

    x, qw = case(m, n, k, group, symmetric)
    got, ref = int4_matmul(x, qw, **launch), int4_matmul_reference(x, qw)
    assert got.shape == (m, n) and got.dtype == x.dtype
    tol = 1e-4 if how == "interpreter" else 2e-2  # the GPU's fp32 dot rounds through tf32
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.skipif(how != "interpreter", reason="on a GPU bf16 is supported")
def test_int4_kernel_refuses_bf16_in_the_interpreter():
    from minillm.kernels.int4_matmul import int4_matmul

    x, qw = case(1, 16, 64, 32, False)
    with pytest.raises(ValueError, match="needs a GPU"):
        int4_matmul(x.bfloat16(), qw)


def test_int4_kernel_rejects_bad_shapes_with_the_fix():
    from minillm.kernels.int4_matmul import int4_matmul

    x, qw = case(1, 16, 64, 32, False)
    with pytest.raises(ValueError, match="expects 64"):
        int4_matmul(x[:, :32], qw)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        int4_matmul(x[None], qw)
    with pytest.raises(ValueError, match="must divide group_size"):
        int4_matmul(x, qw, block_k=48)


@pytest.mark.parametrize("m", [1, 8])  # the GEMV kernel and the tensor-core tiles
def test_int4_kernel_runs_in_fp16(m):
    """fp16 activations (a T4's dtype): fp16 out, as close to the fp32 product as fp16
    rounding of x and of the result allows."""
    from minillm.kernels.int4_matmul import int4_matmul, int4_matmul_reference

    x, qw = case(m, 48, 128, 32, False)
    got = int4_matmul(x.half(), qw)
    ref = int4_matmul_reference(x.half().float(), qw)
    assert got.dtype == torch.float16
    assert torch.allclose(got.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
