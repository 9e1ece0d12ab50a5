"""FP8 weights and activations with torch's float8 dtypes: where inference on H100-class
GPUs goes (TensorRT-LLM, vLLM), measured here for quality on the CPU.

An 8-bit float keeps a sign, an exponent and a short mantissa, so unlike INT8 its steps
grow with the value: relative precision is roughly constant, and a few large values cost
the small ones less than on an evenly spaced int8 grid.

    e4m3 (float8_e4m3fn)  4 exponent bits, 3 mantissa bits, max 448: weights, activations
    e5m2 (float8_e5m2)    5 exponent bits, 2 mantissa bits, max 57344: more range, less
                          precision (gradients in training; here to show the trade)

A tensor is stored as codes = x / scale cast to fp8, with scale = absmax / fp8 max (per
tensor, or per output channel for weights; per token for activations) so the largest
value uses the top of the range. On a GPU with FP8 tensor cores `torch._scaled_mm`
multiplies two fp8 operands and applies both scales in its epilogue; `time_scaled_mm`
times it there and says what it skipped anywhere else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minillm.quant.linear import linear_names, replace_module

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def fp8_quantize(
    x: torch.Tensor, fmt: str = "e4m3", per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, fp32 scale): one scale for the tensor, or one per row (last dim reduced:
    an output channel of a weight [out, in], a token of activations [tokens, features])."""
    dtype = _dtype(fmt)
    amax = x.abs().amax(-1, keepdim=True) if per_row else x.abs().amax()
    scale = amax.float().clamp(min=1e-12) / torch.finfo(dtype).max
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 codes."""
    return codes.float() * scale


def fp8_fake_quant(x: torch.Tensor, fmt: str = "e4m3", per_row: bool = False) -> torch.Tensor:
    """x rounded through fp8 and back (rows: the last dim's tokens), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    return fp8_dequantize(*fp8_quantize(flat, fmt, per_row)).to(x.dtype).view(x.shape)


class Fp8Linear(nn.Module):
    """A linear layer with fp8 weights (`weight_fmt`, per channel or per tensor) and, if
    `act_fmt` is set, activations rounded through fp8 at each call (dynamic scale per
    tensor, or per token with `act_per_token`): what an FP8 GEMM computes."""

    def __init__(
        self,
        linear: nn.Linear,
        weight_fmt: str = "e4m3",
        per_channel: bool = True,
        act_fmt: str | None = "e4m3",
        act_per_token: bool = False,
    ) -> None:
        super().__init__()
        codes, scale = fp8_quantize(linear.weight.detach(), weight_fmt, per_channel)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        if act_fmt is not None:
            _dtype(act_fmt)
        self.act_fmt, self.act_per_token = act_fmt, act_per_token

    @property
    def weight_nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_fmt is not None:
            x = fp8_fake_quant(x, self.act_fmt, self.act_per_token)
        return F.linear(x, fp8_dequantize(self.codes, self.scale).to(x.dtype), self.bias)


def fp8_quantize_model(
    model: nn.Module,
    weight_fmt: str = "e4m3",
    per_channel: bool = True,
    act_fmt: str | None = "e4m3",
    act_per_token: bool = False,
    keep: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """Replace every nn.Linear not named in `keep` by an `Fp8Linear`, in place."""
    for name in linear_names(model):
        mod = model.get_submodule(name)
        if isinstance(mod, nn.Linear) and not name.endswith(keep):
            replace_module(
                model, name, Fp8Linear(mod, weight_fmt, per_channel, act_fmt, act_per_token)
            )
    return model


def scaled_mm(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with both operands in e4m3 and per-tensor scales through
    `torch._scaled_mm` (the call FP8 inference makes; it also runs, slowly, on CPU)."""
    xq, x_scale = fp8_quantize(x, "e4m3")
    return torch._scaled_mm(
        xq, codes.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32
    )


def time_scaled_mm(
    shapes: tuple[tuple[int, int, int], ...] = ((16, 4096, 4096), (256, 4096, 4096)),
) -> dict[str, Any]:
    """On a CUDA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper and
    later): for each (M, N, K), the time of bf16 `x @ W^T` divided by the time of the
    e4m3 `_scaled_mm` (> 1: FP8 faster), measured with `triton.testing.do_bench`.
    Elsewhere: {'skipped': why}."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: FP8 tensor cores need a GPU of compute capability 8.9+"}
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return {"skipped": f"compute capability {cc[0]}.{cc[1]} has no FP8 tensor cores (8.9+)"}
    from triton.testing import do_bench

    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for m, n, k in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        xq, xs = fp8_quantize(x, "e4m3")
        wq, ws = fp8_quantize(w, "e4m3")
        t_bf16 = do_bench(lambda x=x, w=w: x @ w.T)
        t_fp8 = do_bench(
            lambda xq=xq, wq=wq, xs=xs, ws=ws: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16
            )
        )
        ref = x.float() @ w.float().T
        got = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.float32)
        out[f"{m}x{n}x{k}"] = {
            "bf16_over_fp8": t_bf16 / t_fp8,
            "rel_error": ((got - ref).norm() / ref.norm()).item(),
        }
    return out
