"""INT8 post-training calibration, built small: what TensorRT's implicit calibrators did.

TensorRT 10 deprecated implicit calibration (an `IInt8Calibrator` picking ranges while the
engine builds). Today the scales are chosen first, as here, and written into the ONNX
graph as explicit QuantizeLinear/DequantizeLinear pairs (NVIDIA ModelOpt's output, and
`minillm.export.qdq.export_qdq` with these scales); FP8 goes the same way.

TensorRT runs int8 GEMMs on activations x and weights W: x ~ scale_x * round(x / scale_x),
W ~ scale_w * round(W / scale_w). Weights are known ahead of time (one scale per output
channel, from their absmax). Activations are not: calibration runs the fp32 model on a few
hundred representative inputs, records the distribution of every GEMM input and picks one
clipping threshold T per tensor (scale = T / 127). Values beyond T saturate to +-127.

    max         T = the largest |x| seen. No clipping, but one outlier stretches the grid
                and every ordinary value lands on a coarse step.
    percentile  T = the 99.99th percentile of |x|: clip the rarest values.
    entropy     T minimising KL(P || Q): P is the histogram of |x| with everything beyond T
                piled into the last bin, Q the same histogram squeezed into 128 levels and
                expanded back (TensorRT's `IInt8EntropyCalibrator2`; `kl_curve` is the
                curve it minimises).

`collect_stats` gathers absmax and a histogram of every `nn.Linear`'s input with forward
hooks; `compute_scales` turns them into scales by each method; `fake_quantize_model`
returns a copy whose linears quantize-dequantize their input (per tensor) and weight (per
output channel), so an fp32 run shows int8's error; `compare_methods` scores all of them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minillm.quant.linear import replace_module
from minillm.training.evaluate import next_token_agreement, perplexity

QMAX = 127  # symmetric int8: -127..127 (TensorRT does not use -128)
METHODS = ("max", "percentile", "entropy")
DEFAULT_BINS = 2048  # TensorRT's histogram calibrator uses 2048 bins of |x|


@dataclass
class TensorStats:
    """What calibration recorded about one tensor: its absmax and a histogram of |x|
    with `len(hist)` equal bins over [0, absmax]."""

    absmax: float
    hist: torch.Tensor  # float64 counts

    @property
    def bin_width(self) -> float:
        return self.absmax / len(self.hist)


def histogram_stats(x: torch.Tensor, bins: int = DEFAULT_BINS) -> TensorStats:
    """Stats of one tensor in one go (tests and synthetic distributions)."""
    a = x.detach().abs().flatten().double()
    absmax = float(a.max()) if a.numel() else 0.0
    hist = torch.histc(a, bins=bins, min=0.0, max=absmax if absmax > 0 else 1.0)
    return TensorStats(absmax, hist)


def _linears(model: nn.Module, skip: Sequence[str]) -> dict[str, nn.Linear]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(name.endswith(s) for s in skip)
    }


@torch.inference_mode()
def collect_stats(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    bins: int = DEFAULT_BINS,
    skip: Sequence[str] = (),
) -> dict[str, TensorStats]:
    """Absmax and |x| histogram of the input of every `nn.Linear` (name -> stats).

    Two passes over `batches` (token ids [B, T]), as TensorRT's histogram calibrators do:
    the first finds each tensor's absmax, the second bins |x| over [0, absmax], so every
    batch lands in the same bins.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("collect_stats needs at least one calibration batch of token ids")
    layers = _linears(model, skip)
    absmax = dict.fromkeys(layers, 0.0)
    hists = {name: torch.zeros(bins, dtype=torch.float64) for name in layers}

    def run(hook_fn) -> None:
        handles = [
            m.register_forward_pre_hook(lambda mod, args, n=name: hook_fn(n, args[0]))
            for name, m in layers.items()
        ]
        try:
            for ids in batches:
                model(ids)
        finally:
            for h in handles:
                h.remove()

    def find_max(name: str, x: torch.Tensor) -> None:
        absmax[name] = max(absmax[name], float(x.abs().max()))

    def add_hist(name: str, x: torch.Tensor) -> None:
        top = absmax[name] if absmax[name] > 0 else 1.0
        counts = torch.histc(x.abs().double().flatten(), bins=bins, min=0.0, max=top)
        hists[name] += counts.cpu()  # the model may run on a GPU; the stats live on the CPU

    run(find_max)
    run(add_hist)
    # Linears that read the same tensor (q/k/v, gate/up) share one stats object:
    # TensorRT calibrates tensors, not layers, and `compute_scales` then works once per tensor.
    out: dict[str, TensorStats] = {}
    for name in layers:
        same = (
            s for s in out.values() if s.absmax == absmax[name] and torch.equal(s.hist, hists[name])
        )
        out[name] = next(same, None) or TensorStats(absmax[name], hists[name])
    return out


# ------------------------------------------------------------------------- thresholds


def max_threshold(stats: TensorStats) -> float:
    """No clipping: the largest |x| calibration saw."""
    return stats.absmax


def percentile_threshold(stats: TensorStats, percentile: float = 99.99) -> float:
    """The upper edge of the bin where the cumulative count reaches `percentile`% of |x|."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    cdf = stats.hist.cumsum(0) / stats.hist.sum()
    i = int(torch.searchsorted(cdf, torch.tensor(percentile / 100, dtype=cdf.dtype)))
    return min(i + 1, len(stats.hist)) * stats.bin_width


def _kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    p, q = p / p.sum(), q / q.sum()
    nz = p > 0
    if (q[nz] == 0).any():
        return math.inf
    return float((p[nz] * np.log(p[nz] / q[nz])).sum())


def kl_curve(stats: TensorStats, levels: int = QMAX + 1) -> tuple[np.ndarray, np.ndarray]:
    """KL(P || Q) of every candidate threshold: the curve the entropy calibrator minimises
    (returned whole, so it can be plotted). Thresholds are the upper edges of bins
    `levels`..n; a candidate whose Q misses mass that P has scores inf.

    For candidate i (bins kept): P = hist[:i] with the outlier counts hist[i:] added to its
    last bin (clipping moves them there); Q = hist[:i] merged into `levels` groups of
    adjacent bins, each group's count spread evenly over its non-empty bins (the int8 grid
    cannot tell them apart).
    """
    hist = stats.hist.numpy()
    n = len(hist)
    if n < levels:
        raise ValueError(f"need at least {levels} histogram bins, got {n}")
    tail = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # tail[i] = hist[i:].sum()
    kls = []
    for i in range(levels, n + 1):
        kept = hist[:i]
        p = kept.copy()
        p[-1] += tail[i]
        # Group g = bins [starts[g], starts[g+1]): the bins that share one int8 level.
        starts = np.linspace(0, i, levels + 1).round().astype(np.int64)[:-1]
        sizes = np.diff(np.append(starts, i))
        group_sum = np.add.reduceat(kept, starts)
        group_nz = np.add.reduceat((kept > 0).astype(np.float64), starts)
        per_bin = np.repeat(group_sum / np.maximum(group_nz, 1), sizes)
        kls.append(_kl_divergence(p, np.where(kept > 0, per_bin, 0.0)))
    return np.arange(levels, n + 1) * stats.bin_width, np.array(kls)


def entropy_threshold(stats: TensorStats, levels: int = QMAX + 1) -> float:
    """TensorRT's (legacy, implicit) entropy calibrator: the threshold T whose int8 version
    of the histogram loses the least information, the minimum of `kl_curve`."""
    thresholds, kl = kl_curve(stats, levels)
    if not np.isfinite(kl).any():
        return len(stats.hist) * stats.bin_width  # nothing comparable: keep everything
    return float(thresholds[int(np.argmin(kl))])


def threshold(stats: TensorStats, method: str, percentile: float = 99.99) -> float:
    """Clipping threshold of one tensor by `method` (one of METHODS)."""
    if method == "max":
        return max_threshold(stats)
    if method == "percentile":
        return percentile_threshold(stats, percentile)
    if method == "entropy":
        return entropy_threshold(stats)
    raise ValueError(f"unknown calibration method {method!r}: use one of {', '.join(METHODS)}")


def compute_scales(
    stats: dict[str, TensorStats], method: str, percentile: float = 99.99
) -> dict[str, float]:
    """Per-tensor int8 scale (threshold / 127) of every calibrated tensor."""
    done: dict[int, float] = {}  # id(stats) -> scale: shared stats are computed once
    for s in stats.values():
        if id(s) not in done:
            done[id(s)] = max(threshold(s, method, percentile), 1e-12) / QMAX
    return {name: done[id(s)] for name, s in stats.items()}


# ---------------------------------------------------------------- fake quantization


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize to symmetric int8 and back: scale * clamp(round(x / scale), -127, 127).
    `scale` is a number (per tensor) or a tensor that broadcasts (per channel)."""
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX) * scale


def weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """One scale per output channel (row of an [out, in] weight): absmax / 127."""
    return (weight.detach().abs().amax(dim=1, keepdim=True) / QMAX).clamp(min=1e-12)


class FakeQuantLinear(nn.Module):
    """An `nn.Linear` as an int8 engine computes it: input fake-quantized with the
    calibrated per-tensor scale, weight with per-output-channel scales, bias in fp32."""

    def __init__(self, linear: nn.Linear, input_scale: float | None) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(fake_quantize(w, weight_scales(w)), requires_grad=False)
        self.bias = linear.bias
        self.input_scale = input_scale  # None: leave activations in fp32 (weight-only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = fake_quantize(x, self.input_scale)
        return F.linear(x, self.weight, self.bias)


def fake_quantize_model(model: nn.Module, scales: dict[str, float] | None) -> nn.Module:
    """A copy of `model` whose calibrated linears (the names in `scales`) run as int8 would.

    `scales=None` quantizes weights only (every linear). The original is left untouched;
    a tied lm_head gets its own quantized weight (the embedding table stays fp32).
    """
    q = copy.deepcopy(model)
    names = list(scales) if scales is not None else list(_linears(q, ()))
    for name in names:
        linear = q.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is {type(linear).__name__}, not nn.Linear: recalibrate")
        replace_module(q, name, FakeQuantLinear(linear, None if scales is None else scales[name]))
    return q


# ------------------------------------------------------------------------- the data


def calibration_batches(
    tokenizer, n_batches: int = 4, batch_size: int = 4, seq_len: int = 128
) -> list[torch.Tensor]:
    """Token-id batches [batch_size, seq_len] from the bundled model's TRAINING text, spread
    evenly over the book (never the held-out text used for scoring)."""
    from minillm.training.data import load_kjv, split_corpus

    train, _ = split_corpus(load_kjv())
    n = n_batches * batch_size
    piece = seq_len * 8  # characters: ~4 per token, twice what one window needs
    step = (len(train) - piece) // n
    rows = []
    for k in range(n):
        ids = tokenizer.encode(train[k * step : k * step + piece], add_special_tokens=False)
        if len(ids) < seq_len:
            raise ValueError(f"calibration piece {k} has {len(ids)} < {seq_len} tokens")
        rows.append(torch.tensor(ids[:seq_len]))
    x = torch.stack(rows)
    return list(x.split(batch_size))


@torch.inference_mode()
def compare_methods(
    model: nn.Module,
    stats: dict[str, TensorStats],
    eval_ids: torch.Tensor,
    window: int = 128,
    max_windows: int = 16,
    methods: Sequence[str] = METHODS,
    percentile: float = 99.99,
) -> dict[str, dict[str, float]]:
    """Held-out perplexity and next-token agreement with fp32 for fp32, int8 weights only,
    and int8 weights + activations calibrated by each method."""
    model.eval()
    rows: dict[str, dict[str, float]] = {}
    candidates = {"fp32": model, "int8 weights only": fake_quantize_model(model, None)}
    for m in methods:
        candidates[f"int8 {m}"] = fake_quantize_model(model, compute_scales(stats, m, percentile))
    for name, cand in candidates.items():
        rows[name] = {
            "perplexity": perplexity(cand, eval_ids, window, max_windows=max_windows),
            "agreement": next_token_agreement(
                model, cand, eval_ids, window, max_windows=max_windows
            ),
        }
    return rows
