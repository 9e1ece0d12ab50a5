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

One alpha for the whole model is the paper's recipe. Layers differ, though: a linear whose
input carries a "massive activation" (thousands of times its median channel, on a few
tokens) wants most of the range moved into its weights, its neighbours much less. Given a
tuple of alphas, `smoothquant_model` picks one per scale group: the alpha whose W8A8
rounding leaves the least error at the output of the module the group feeds, on the
calibration tokens (`search_smooth_model`, the search AWQ uses: `scale_search`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from minillm.model.transformer import Transformer
from minillm.quant.formats import absmax_quantize, dequantize
from minillm.quant.linear import (
    activation_absmax,
    fake_quant_activations,
    quantize_model,
    set_activation_quant,
)
from minillm.quant.scale_search import ModuleProbe, search_scales
from minillm.quant.sequential import calibration_states, run_block
from minillm.quant.smoothing import fold_scales, group_weight, scale_groups

ALPHAS = tuple(round(0.05 * i, 2) for i in range(4, 19))  # 0.2, 0.25, ..., 0.9


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


@torch.inference_mode()
def search_smooth_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    alphas: Sequence[float] = ALPHAS,
    act: str = "token",
    max_tokens: int = 2048,
) -> dict[str, float]:
    """Fold SmoothQuant's scales into every scale group, each with the alpha (of `alphas`)
    whose int8 weights (per channel) and int8 activations (`act`) leave the least error
    at the output of the module the group feeds. In place; the float model computes the
    same function. Returns the chosen alpha per group ('layers.11.mlp.up_proj': 0.85)."""
    if not alphas:
        raise ValueError("give at least one alpha to search, e.g. ALPHAS")
    calib = calibration_states(model, batches)
    chosen: dict[str, float] = {}
    for i, block in enumerate(model.model.layers):
        for group in scale_groups(block):
            probe = ModuleProbe(block, group, calib, max_tokens)
            w = group_weight(block, group)
            grid = {a: smoothing_scales(probe.absmax, w, a) for a in alphas}
            alpha, _ = search_scales(
                probe,
                group,
                grid,
                lambda t: dequantize(*absmax_quantize(t, 8, per_channel=True)),
                lambda x: fake_quant_activations(x, act),
            )
            fold_scales(block, group, grid[alpha])
            chosen[f"layers.{i}.{group.prev}"] = alpha
        run_block(block, calib)
    return chosen


def smoothquant_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    alpha: float | Sequence[float] = 0.5,
    act: str = "token",
    keep: Sequence[str] = ("lm_head",),
    max_tokens: int = 2048,
) -> Transformer:
    """W8A8: smooth, then int8 per-channel weights and int8 activations per 'token' or per
    'tensor' (dynamic scales). `alpha`: one value for every layer (the paper's recipe), or
    a sequence to search per scale group (`search_smooth_model`, each candidate scored on
    `max_tokens` calibration tokens). The linears named in
    `keep` stay in full precision (lm_head by default; anything else kept is a mixed-
    precision model and must be reported as one). In place; returns the model."""
    if isinstance(alpha, int | float):
        smooth_model(model, batches, float(alpha))
    else:
        search_smooth_model(model, batches, tuple(alpha), act, max_tokens)
    quantize_model(model, "int8", keep=keep)
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
