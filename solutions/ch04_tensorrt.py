"""Chapter 04 reference answers: INT8 calibration, written from scratch (no minillm)."""

from __future__ import annotations

import math

import torch
from torch import nn

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
