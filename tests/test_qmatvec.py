"""minillm's quantized C kernels (qmatvec.c) against the same arithmetic in PyTorch.

The kernels round each row of x to int8 per block of 32 inputs and multiply the weights'
codes as integers; `rounded` does that rounding in PyTorch, so the reference is the
dequantized weight times the rounded x, and a wrong nibble order, scale, minimum or block
sum is off by far more than the float rounding allowed here. The portable C path (what a
CPU without AVX2 runs) is compiled on its own and held to the same reference."""

import copy
import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from minillm.kernels import matvec as mv
from minillm.quant import QuantLinear, absmax_quantize, quantize_int4, quantize_model
from minillm.quant.cpu_kernels import Int4Kernel, c_skip_reason
from minillm.quant.formats import quantize_q4_1
from minillm.quant.linear import use_cpu_kernels

ok, why = mv.matvec_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C kernel here: {why}")


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per block of 32, round(x / dx) * dx with dx = absmax / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, mv.BLOCK)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(dx > 0, blocks / dx, torch.zeros_like(blocks)).round()
    return (codes * dx).reshape(x.shape)


def weights(out: int, inner: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inner, generator=g) * 0.05 + 0.02  # an offset: minima differ


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("out_in", [(1, 32), (7, 64), (192, 576), (576, 1536)])
def test_q4_kernel_is_the_q4_1_weight_times_the_rounded_x(rows, out_in):
    qw = quantize_q4_1(weights(*out_in, seed=rows))
    x = torch.randn(rows, 1, out_in[1], generator=torch.Generator().manual_seed(7))
    y = mv.Q4Product(qw.packed, qw.scale, qw.minimum)(x)
    ref = rounded(x) @ qw.dequantize().T
    torch.testing.assert_close(y, ref, atol=2e-5 * out_in[1] ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("out_in", [(5, 32), (192, 576), (576, 1536)])
def test_int8_kernel_is_the_int8_weight_times_the_rounded_x(rows, out_in):
    q, scale = absmax_quantize(weights(*out_in, seed=rows))
    x = torch.randn(rows, out_in[1], generator=torch.Generator().manual_seed(3))
    y = mv.Int8Product(q, scale.flatten())(x)
    ref = rounded(x) @ (q.float() * scale).T
    torch.testing.assert_close(y, ref, atol=2e-5 * out_in[1] ** 0.5, rtol=1e-4)


def test_a_row_gets_the_same_bits_alone_or_batched():
    qw = quantize_q4_1(weights(96, 256, seed=1))
    q, scale = absmax_quantize(weights(96, 256, seed=2))
    x = torch.randn(7, 256)
    x[2] = 0.0  # a zero block: scale 0, codes 0, no NaN
    for product in (
        mv.Q4Product(qw.packed, qw.scale, qw.minimum),
        mv.Int8Product(q, scale.flatten()),
    ):
        together = product(x)
        assert torch.isfinite(together).all()
        for r in range(7):
            assert torch.equal(product(x[r : r + 1])[0], together[r])


def test_the_portable_c_path_agrees(tmp_path: Path):
    """Compiled without -march=native (x86-64's baseline: no AVX2), the kernels take
    their plain C loops; same integer dot products, so the same results to float rounding."""
    lib_path = tmp_path / "portable.so"
    cmd = ["cc", "-O2", "-fopenmp-simd", "-shared", "-fPIC", *map(str, mv.SOURCES)]
    cmd += ["-o", str(lib_path), "-lm"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("no cc to build the portable path")
    lib = mv.declare(ctypes.CDLL(str(lib_path)))
    qw = quantize_q4_1(weights(64, 576, seed=5))
    q, scale = absmax_quantize(weights(64, 576, seed=6))
    x = torch.randn(5, 576)
    y4, y8 = torch.empty(5, 64), torch.empty(5, 64)
    ptrs4 = [t.data_ptr() for t in (qw.packed, qw.scale, qw.minimum, x, y4)]
    assert lib.matvec_q4(*ptrs4, 5, 64, 576) == 0
    s = scale.flatten().contiguous()
    ptrs8 = [t.data_ptr() for t in (q, s, x, y8)]
    assert lib.matvec_int8(*ptrs8, 5, 64, 576) == 0
    torch.testing.assert_close(y4, mv.Q4Product(qw.packed, qw.scale, qw.minimum)(x))
    torch.testing.assert_close(y8, mv.Int8Product(q, s)(x))


def test_q4_1_format_and_its_torch_kernel():
    w = weights(48, 256, seed=9)
    qw = quantize_q4_1(w)
    assert qw.zero is None and qw.minimum is not None and qw.minimum.dtype == torch.float16
    assert qw.nbytes == 48 * 128 + 2 * (48 * 8 * 2)  # 4 bits a weight, 2 fp16 a block
    step = (w.view(48, 8, 32).amax(-1) - w.view(48, 8, 32).amin(-1)) / 15
    err = (qw.dequantize() - w).abs().view(48, 8, 32).amax(-1)
    assert (err <= step * 0.52).all()  # half a step, and fp16 scale rounding
    x = torch.randn(3, 256)
    ref = x @ qw.dequantize().T
    torch.testing.assert_close(Int4Kernel(qw, torch.float32)(x), ref, atol=1e-4, rtol=1e-4)
    layer = QuantLinear(nn.Linear(256, 48, bias=False), "q4_1-g32")
    assert layer.qw.minimum is not None and layer.weight_nbytes == qw.nbytes


def test_c_kernels_refuse_what_they_cannot_run():
    w = weights(16, 64, seed=0)
    q, scale = absmax_quantize(w)
    assert "q4_1-g32" in c_skip_reason(q, scale, None, quantize_int4(w, 32))
    assert "groups of 32" in c_skip_reason(q, scale, None, quantize_q4_1(w, 64))
    assert "'int8'" in c_skip_reason(q, scale, torch.zeros(16, 1), None)  # asymmetric
    q48, scale48 = absmax_quantize(torch.randn(4, 48))
    assert "multiple of 32" in c_skip_reason(q48, scale48, None, None)
    product = mv.Int8Product(q, scale.flatten())
    with pytest.raises(ValueError, match="x.float"):
        product(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="no gradient"):
        product(torch.randn(2, 64, requires_grad=True))
    with pytest.raises(ValueError, match="contiguous torch.float16"):
        mv.Q4Product(
            quantize_q4_1(w).packed, quantize_q4_1(w).scale.float(), quantize_q4_1(w).minimum
        )
    with pytest.raises(ValueError, match="one scale per row"):
        mv.Int8Product(q, scale.flatten()[:3].contiguous())
    layer = QuantLinear(nn.Linear(64, 16), "nf4-g64")
    assert "NF4" in layer.use_cpu_kernel("c")
    with pytest.raises(ValueError, match="backend"):
        layer.use_cpu_kernel("cuda")


def test_a_model_on_the_c_kernels(model, prompts):
    q = quantize_model(quantize_model(copy.deepcopy(model), "q4_1-g32"), "int8", keep=())
    ids = torch.tensor([prompts[1]])
    with torch.inference_mode():
        slow = q(ids)
        assert use_cpu_kernels(q, "c") == {}  # every bundled linear fits
        assert all(
            type(m.kernel) is (mv.Int8Product if m.scheme.kind == "int8" else mv.Q4Product)
            for m in q.modules()
            if isinstance(m, QuantLinear)
        )
        fast = q(ids)
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.9
    assert ((fast - slow).norm() / slow.norm()).item() < 2e-2  # the int8-rounded activations
