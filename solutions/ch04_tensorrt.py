"""Chapter 04 reference answers: INT8 calibration and an explicit Q/DQ graph, written from
scratch (no minillm)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    import onnx

QMAX = 127


def fake_quantize_int8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Symmetric int8 quantize-dequantize of x with `scale` (per tensor or broadcast)."""
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX) * scale


def percentile_scale(x: torch.Tensor, percentile: float = 99.99) -> float:
    """Per-tensor int8 scale whose threshold is the `percentile`-th percentile of |x|."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    a = x.detach().abs().flatten().double()
    k = max(1, math.ceil(percentile / 100 * a.numel()))  # the k-th smallest |x|
    return max(float(a.kthvalue(k).values), 1e-12) / QMAX


def kl_threshold(hist: torch.Tensor, bin_width: float, levels: int = 128) -> float:
    """Entropy calibration: the threshold (a bin edge) minimising KL(P || Q)."""
    hist = hist.double()
    n = len(hist)
    if n < levels:
        raise ValueError(f"need at least {levels} bins, got {n}")
    best_i, best_kl = n, math.inf
    for i in range(levels, n + 1):
        kept = hist[:i]
        p = kept.clone()
        p[-1] += hist[i:].sum()  # clipped values pile up in the last bin
        # level[b]: which of the `levels` int8 levels bin b falls into
        level = torch.arange(i) * levels // i
        total = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, kept)
        count = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, (kept > 0).double())
        q = torch.where(kept > 0, total[level] / count[level].clamp(min=1), 0.0)
        p, q = p / p.sum(), q / q.sum()
        mask = p > 0
        if (q[mask] == 0).any():
            continue
        kl = float((p[mask] * (p[mask] / q[mask]).log()).sum())
        if kl < best_kl:
            best_i, best_kl = i, kl
    return best_i * bin_width


@torch.inference_mode()
def calibrate_linear_inputs(
    model: nn.Module, batches: list[torch.Tensor], percentile: float = 99.99
) -> dict[str, float]:
    """Percentile scale of the input of every nn.Linear, over all calibration batches."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod, args, name=name):
                seen.setdefault(name, []).append(args[0].detach().abs().flatten().float())

            handles.append(module.register_forward_pre_hook(hook))
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return {name: percentile_scale(torch.cat(xs), percentile) for name, xs in seen.items()}


def qdq_linear_onnx(weight: torch.Tensor, input_scale: float) -> onnx.ModelProto:
    """x @ weight.T with a Q/DQ pair on the input (per tensor) and on the weight (per
    output channel): the explicitly quantized linear TensorRT 10+ builds INT8 from."""
    from onnx import TensorProto, helper, numpy_helper

    w_t = weight.detach().float().t().contiguous().numpy()  # [in, out]
    n_in, n_out = w_t.shape
    w_scale = (np.maximum(np.abs(w_t).max(axis=0), 1e-12) / 127).astype(np.float32)
    constants = {
        "w_t": w_t,
        "x_scale": np.array(input_scale, dtype=np.float32),
        "x_zero": np.array(0, dtype=np.int8),  # int8 zero point: the Q output is int8
        "w_scale": w_scale,
        "w_zero": np.zeros(n_out, dtype=np.int8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        # axis 1 of [in, out] is the output channel: one scale per column of w_t
        helper.make_node("QuantizeLinear", ["w_t", "w_scale", "w_zero"], ["w_q"], axis=1),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], axis=1),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(v, name) for name, v in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
