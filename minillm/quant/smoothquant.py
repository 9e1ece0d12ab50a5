"""SmoothQuant W8A8 from scratch (Xiao et al., 2022), and the activation outliers that
motivate it.

INT8 weights are easy (per-channel absmax loses little). INT8 activations are not: in
trained LLMs a few hidden channels carry values 10-100x larger than the rest, in every
token (LLM.int8(), Dettmers et al. 2022). One scale per token (or per tensor) must cover
that outlier, so the ordinary channels land on a handful of int8 levels. Per-channel
activation scales would fix it, but an int8 GEMM cannot apply a scale per *input*
channel (it sums over them). SmoothQuant moves the difficulty instead: divide channel j
of x by s_j and multiply the weight's column j by it (folded into the norm before,
`minillm.quant.smoothing`), with

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

alpha = 0.5 splits the range evenly; more alpha pushes more of it into the weights.
Then weights are int8 per output channel and activations int8 per token or per tensor,
fake-quantized by `QuantLinear` (`set_activation_quant`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from minillm.model.transformer import Transformer
from minillm.quant.linear import activation_absmax, quantize_model, set_activation_quant
from minillm.quant.smoothing import fold_scales, group_weight, scale_groups


def calibration_absmax(
    model: Transformer, batches: Iterable[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |x| each linear's input reaches over all batches."""
    stats: dict[str, torch.Tensor] = {}
    for ids in batches:
        for name, amax in activation_absmax(model, ids).items():
            stats[name] = torch.maximum(stats[name], amax) if name in stats else amax
    if not stats:
        raise ValueError("calibration needs at least one batch of token ids")
    return stats


def smoothing_scales(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha) for a weight w [out, in]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w_absmax = w.abs().amax(0).clamp(min=1e-5)
    return (act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


@torch.inference_mode()
def smooth_model(model: Transformer, batches: Iterable[torch.Tensor], alpha: float = 0.5) -> None:
    """Fold SmoothQuant's scales into every scale group of every block, in place; the float
    model computes the same function afterwards, with flatter activations."""
    stats = calibration_absmax(model, batches)
    for i, block in enumerate(model.model.layers):
        for group in scale_groups(block):
            amax = stats[f"model.layers.{i}.{group.linears[0]}"]
            fold_scales(block, group, smoothing_scales(amax, group_weight(block, group), alpha))


def smoothquant_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    alpha: float = 0.5,
    act: str = "token",
) -> Transformer:
    """W8A8: smooth (alpha), then int8 per-channel weights and int8 activations per
    'token' or per 'tensor' (dynamic scales), lm_head kept. In place; returns the model."""
    smooth_model(model, batches, alpha)
    quantize_model(model, "int8")
    set_activation_quant(model, act)
    return model


@dataclass
class Outliers:
    """How much one linear's input is dominated by a few channels."""

    name: str
    absmax: float  # the largest |x| over all channels
    median_channel: float  # the median over channels of each channel's max |x|
    top_channels: list[int]  # the channels with the largest max |x|, largest first

    @property
    def ratio(self) -> float:
        """absmax / median channel: how many int8 levels an outlier costs the rest."""
        return self.absmax / max(self.median_channel, 1e-12)


def outlier_report(stats: dict[str, torch.Tensor], top: int = 3) -> list[Outliers]:
    """One `Outliers` per linear from `calibration_absmax`'s per-channel maxima."""
    rows = []
    for name, amax in stats.items():
        order = amax.argsort(descending=True)[:top].tolist()
        rows.append(Outliers(name, float(amax.max()), float(amax.median()), order))
    return rows
