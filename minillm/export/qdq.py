"""Explicit quantization: the model as an ONNX graph with QuantizeLinear / DequantizeLinear
(Q/DQ) pairs holding chapter 04's INT8 scales. How TensorRT 10+ takes INT8 (and FP8).

TensorRT's implicit calibration (an `IInt8Calibrator` choosing each tensor's range while
the engine builds, `minillm.quant.calibrate` rebuilds it) is deprecated since TensorRT 10.
The supported path is explicit: the scales are decided beforehand (by calibration, as
chapter 04 does, or by quantization-aware training) and written into the graph as
Q -> DQ on every GEMM input and on every weight; TensorRT then fuses DQ -> MatMul -> Q
into INT8 kernels. NVIDIA's ModelOpt (`modelopt.torch.quantization`) writes graphs like
this one, FP8 included.

Here each linear becomes `QDQLinear`: its input passes through
`torch.fake_quantize_per_tensor_affine` (the calibrated per-tensor scale) and its weight
through `torch.fake_quantize_per_channel_affine` (absmax / 127 per output channel), which
the ONNX exporter writes as Q/DQ pairs. ONNX int8 saturates at [-128, 127] where the
course's fake quantization (and TensorRT's weights) use [-127, 127]: only activations
clipped below -threshold can differ, by one step.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minillm.export.onnx import export_forward
from minillm.model.transformer import Transformer
from minillm.quant.calibrate import weight_scales
from minillm.quant.linear import replace_module


class QDQLinear(nn.Module):
    """An nn.Linear whose input and weight go through int8 quantize -> dequantize, in ops
    the ONNX exporter turns into QuantizeLinear / DequantizeLinear."""

    def __init__(self, linear: nn.Linear, input_scale: float) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(w.clone(), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("weight_scale", weight_scales(w).flatten())
        self.register_buffer("weight_zero", torch.zeros(w.shape[0], dtype=torch.int32))
        self.input_scale = float(input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.fake_quantize_per_tensor_affine(x, self.input_scale, 0, -128, 127)
        w = torch.fake_quantize_per_channel_affine(
            self.weight, self.weight_scale, self.weight_zero, 0, -128, 127
        )
        return F.linear(x, w, self.bias)


def qdq_model(model: Transformer, scales: dict[str, float]) -> Transformer:
    """A copy of `model` whose linears named in `scales` (`compute_scales` output) are
    `QDQLinear`s; a tied lm_head gets its own weight, as in `fake_quantize_model`."""
    q = copy.deepcopy(model).requires_grad_(False)  # else torch picks fake-quant ops that
    # also return a gradient mask, which torch.export cannot trace
    for name, scale in scales.items():
        linear = q.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is {type(linear).__name__}, not nn.Linear: recalibrate")
        replace_module(q, name, QDQLinear(linear, scale))
    return q


def export_qdq(model: Transformer, scales: dict[str, float], path: str | Path) -> Path:
    """The forward graph (input_ids -> logits) with a Q/DQ pair on the input and on the
    weight of every calibrated linear."""
    # The legacy (TorchScript) exporter: it has translated fake-quant ops to Q/DQ since
    # pytorch-quantization used it for TensorRT; torch.export cannot trace them with
    # dynamic shapes in torch 2.13 (no symbolic-shape kernel for the op it dispatches to).
    return export_forward(qdq_model(model, scales), path, dynamo=False, opset_version=17)
