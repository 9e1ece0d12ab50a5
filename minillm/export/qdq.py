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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minillm.export.onnx import export_forward
from minillm.model.transformer import Transformer
from minillm.quant.calibrate import QMAX, weight_scales
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


# ------------------------------------------------------------- reading the graph back


def _constants(proto: Any) -> dict[str, np.ndarray]:
    """Every constant of a graph by name: its initializers, its Constant nodes' values (the
    legacy exporter writes per-tensor scales so) and Identity copies of either (it shares
    equal zero points through them)."""
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
        elif node.op_type == "Identity" and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    return values


def activation_scales(proto: Any) -> list[float]:
    """The scale of every QuantizeLinear on an activation, in graph order: one scale per
    tensor. A weight's QuantizeLinear has one scale per output channel instead (the tied
    lm_head's weight arrives through an Identity, so the scale's size is what tells)."""
    values = _constants(proto)
    scales = (values[n.input[1]] for n in proto.graph.node if n.op_type == "QuantizeLinear")
    return [s.item() for s in scales if s.size == 1]


def describe_gemm_inputs(proto: Any, matmul: str) -> list[str]:
    """What feeds one MatMul of a Q/DQ graph, one line per node, walking each input back
    through DequantizeLinear, QuantizeLinear (and the weight's Transpose) to the fp32 tensor
    it started from: the pattern TensorRT turns into one int8 GEMM."""
    nodes = {n.name: n for n in proto.graph.node}
    if matmul not in nodes:
        matmuls = [name for name, n in nodes.items() if n.op_type == "MatMul"][:3]
        raise KeyError(f"no node {matmul!r} in the graph; MatMul nodes are named like {matmuls}")
    producer = {out: n for n in proto.graph.node for out in n.output}
    values = _constants(proto)
    lines = [f"MatMul {matmul}"]

    def walk(name: str, depth: int) -> None:
        node, pad = producer.get(name), "    " * depth
        if node is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear", "Transpose"):
            shape = f" {list(values[name].shape)}" if name in values else ""
            lines.append(f"{pad}<- {name}{shape} (fp32)")
            return
        detail = ""
        if node.op_type != "Transpose":
            scale, zero = values[node.input[1]], values[node.input[2]]
            axis = next((a.i for a in node.attribute if a.name == "axis"), None)
            detail = (
                f"scale {scale.item():.5g} per tensor"
                if scale.size == 1
                else f"{scale.size} scales, one per output channel (axis {axis})"
            ) + f", zero point {zero.dtype}"
        lines.append(f"{pad}<- {node.op_type} {detail}".rstrip())
        walk(node.input[0], depth + 1)

    for name in nodes[matmul].input:
        walk(name, 1)
    return lines


# ------------------------------------------------------------- rewriting the graph


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: the largest finite e4m3 value


def to_fp8(proto: Any) -> Any:
    """The same graph in FP8 (e4m3): each Q/DQ keeps its clipping threshold (an int8 scale
    T / 127 becomes T / 448) and gets a float8 zero point, which makes its output float8.

    In ONNX, FP8 is the same Q/DQ pair with another type (float8 Q/DQ need opset 19):
    explicit quantization carries INT8 and FP8 alike, and TensorRT builds FP8 GEMMs from
    such pairs on GPUs that have FP8 tensor cores."""
    from onnx import TensorProto, helper, numpy_helper, version_converter

    proto = version_converter.convert_version(proto, 19)
    values = _constants(proto)
    qdq = (n for n in proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    for i, node in enumerate(qdq):
        scale = values[node.input[1]] * np.float32(QMAX / FP8_MAX)
        names = (f"fp8_scale_{i}", f"fp8_zero_{i}")
        zero = helper.make_tensor(
            names[1], TensorProto.FLOAT8E4M3FN, scale.shape, [0.0] * scale.size
        )
        proto.graph.initializer.extend([numpy_helper.from_array(scale, names[0]), zero])
        node.input[1], node.input[2] = names
    del proto.graph.value_info[:]  # the exporter's int8 annotations no longer hold
    return proto
