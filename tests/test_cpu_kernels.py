"""torch's CPU int8 / int4 kernels against our dequantize-then-matmul (chapter 06).

The fp32-activation path of each kernel is exact (a scalar loop), so it checks the layout
conversion to 1e-5: a wrong scale orientation, zero-point sign or nibble order would be
off by O(1). The bf16 path (the fast one the layer uses) is checked within bf16 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from minillm.quant import QuantLinear, absmax_quantize, quantize_int4, quantize_model
from minillm.quant.cpu_kernels import Int4Kernel, Int8Kernel, int4_skip_reason
from minillm.quant.linear import use_cpu_kernels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_equals_dequantize_then_matmul(group: int, symmetric: bool) -> None:
    g = torch.Generator().manual_seed(group)
    w = torch.randn(48, 256, generator=g) * 0.05 + 0.01  # an offset makes zero points differ
    x = torch.randn(2, 5, 256, generator=g)
    qw = quantize_int4(w, group, symmetric)
    ref = x @ qw.dequantize().T
    assert _rel(Int4Kernel(qw, torch.float32)(x), ref) < 1e-5  # exact layout
    assert _rel(Int4Kernel(qw)(x), ref) < 1e-2  # bf16 activations


def test_int8_kernel_equals_dequantize_then_matmul() -> None:
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 96, generator=g), torch.randn(3, 96, generator=g)
    q, scale = absmax_quantize(w)
    ref = x @ (q.float() * scale).T
    assert _rel(Int8Kernel(q, scale, torch.float32)(x), ref) < 1e-5
    assert _rel(Int8Kernel(q, scale)(x), ref) < 1e-2


def test_kernels_refuse_what_they_cannot_run() -> None:
    assert "multiple of 16" in int4_skip_reason(quantize_int4(torch.randn(24, 64), 32))
    with pytest.raises(ValueError, match="group size 16"):
        Int4Kernel(quantize_int4(torch.randn(16, 64), 16))
    q, scale = absmax_quantize(torch.randn(8, 24))
    with pytest.raises(ValueError, match="multiple of 16"):  # the bf16 path would segfault
        Int8Kernel(q, scale)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int4sym-g64"])
def test_quant_linear_fast_path_matches_its_slow_path(scheme: str) -> None:
    lin = nn.Linear(128, 64, bias=True)
    layer = QuantLinear(lin, scheme)
    x = torch.randn(4, 128)
    slow = layer(x)
    assert layer.use_cpu_kernel() is None and layer.kernel is not None
    assert _rel(layer(x), slow) < 1e-2


def test_use_cpu_kernels_on_a_model(model) -> None:
    q = quantize_model(copy.deepcopy(model), "int4-g32")
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    slow = q(ids)
    assert use_cpu_kernels(q) == {}  # every bundled linear fits the kernel
    fast = q(ids)
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.8
    assert _rel(fast, slow) < 2e-2
    nf4 = quantize_model(copy.deepcopy(model), "nf4-g64")
    assert all("NF4" in why for why in use_cpu_kernels(nf4).values())
