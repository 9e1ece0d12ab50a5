"""AWQ from scratch (Lin et al., 2023): activation-aware weight quantization.

Not all weights matter alike: the input channels that carry large activations multiply
their weight errors by large numbers. AWQ protects them without mixed precision: scale
those weight columns up before rounding (so their relative rounding error shrinks) and
the activations down by the same factor, folded into the op before (`smoothing`):

    W x = (W diag(s)) (x / s),    quantize W diag(s) instead of W.

The scales follow the activations: s = mean|x|^alpha per input channel (normalised so
max * min = 1), alpha on a grid of `n_grid` values in [0, 1). alpha = 0 is plain
round-to-nearest, so the search can only do as well or better on the calibration tokens.

What the search minimises is the output of the module the scales feed, as in the paper's
code (`scale_search`): q/k/v's shared scales are scored on the attention output, gate/up's
on the MLP output, down's on its own output. `awq_search` is the one-linear version (the
layer's own output error), kept because it is the idea in four lines, and selectable as
`scope="linear"` to measure what the module-level loss buys. As in the paper's code,
blocks are processed in order, each calibrated on the outputs of the scaled (not yet
quantized) blocks before it; every linear is then rounded to nearest.

Duo scaling (`scales="duo"`, the default of AutoAWQ, the implementation people use):
s = mean|x|^alpha / mean|w_hat|^(1 - alpha), where w_hat is each weight divided by its
quantization group's absmax (`weight_profile`). A column whose weights sit far below
their groups' absmax uses few of the 16 levels: its relative rounding error is large
whatever its activations, and scaling it up refines it at little cost to the rest. The
activation-only family cannot see that; duo weighs both, as SmoothQuant does with max
instead of mean. Its alpha = 0 candidate (weights only) is replaced by s = 1, so both
families keep plain rounding on the grid.

Duo is `awq_smooth`'s and `awq_quantize_model`'s default because it measured better on
SmolLM2-135M int4 g64, chosen on KJV training text (`benchmarks/awq_scales.py`) and then
confirmed on held-out text (`quant_methods`): share of round-to-nearest's perplexity loss
won back, activation-only vs duo, 59% vs 62% on the 4,096 calibration tokens, 54% vs 63%
on 16 training pieces the search never saw, 56% vs 65% on the 32 held-out windows
(`benchmarks/results/awq_scales-smollm2.json`, `quant_methods-smollm2.json`). `awq_search`,
the one-linear illustration, keeps the paper's activation-only family as its default.

Then AWQ's second search (`awq_clip`): per weight group, the clipping range (a shrink of
its absmax by 0-50%) whose rounded weights give the group's partial outputs x_g w_g^T the
least error. Like the paper's code it skips q_proj and k_proj, whose errors pass through
the softmax.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minillm.model.transformer import Transformer
from minillm.quant.formats import quantize_int4
from minillm.quant.linear import Scheme, parse_scheme, quantize_model
from minillm.quant.scale_search import ModuleProbe, search_scales
from minillm.quant.sequential import (
    block_linears,
    calibration_states,
    capture_inputs,
    run_block,
)
from minillm.quant.smoothing import fold_scales, group_weight, scale_groups


def awq_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha per input channel, normalised so that max(s) * min(s) = 1 (the
    weights' overall range stays put; only the split between channels moves)."""
    s = mean_abs.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


SCALES = ("act", "duo")  # the scale families the searches know: see the module docstring


def weight_profile(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """mean|w_hat| per input channel [in] of a weight w [out, in], w_hat = w over the absmax
    of its quantization group (1 = at the top of its grid, near 0 = a few levels used),
    averaged over the output rows: the weight side of duo scaling."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} must divide in_features {in_f}")
    wg = w.float().abs().view(out_f, in_f // group_size, group_size)
    w_hat = wg / wg.amax(-1, keepdim=True).clamp(min=1e-12)
    return w_hat.view(out_f, in_f).mean(0)


def awq_duo_scales(mean_abs: torch.Tensor, w_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha / mean|w_hat|^(1 - alpha) per input channel (`weight_profile`),
    normalised as `awq_scales`: channels with large activations or with weights low in
    their groups' grids are scaled up."""
    w_part = w_mean.float().clamp(min=1e-4).pow(1 - alpha)
    s = (mean_abs.float().pow(alpha) / w_part).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_grid(
    mean_abs: torch.Tensor, n_grid: int, w_mean: torch.Tensor | None = None
) -> dict[float, torch.Tensor]:
    """{alpha: s} for alpha = i / n_grid, i = 0 .. n_grid - 1: activation scales, or duo
    scales when given the weights' profile `w_mean`. alpha = 0 is s = 1 (round-to-nearest)
    in both, so a search over the grid never does worse than RTN on its own data."""
    grid = {0.0: torch.ones_like(mean_abs, dtype=torch.float32)}
    for i in range(1, n_grid):
        a = i / n_grid
        grid[a] = awq_scales(mean_abs, a) if w_mean is None else awq_duo_scales(mean_abs, w_mean, a)
    return grid


def awq_search(
    x: torch.Tensor,
    w: torch.Tensor,
    group_size: int,
    symmetric: bool = False,
    n_grid: int = 20,
    scales: str = "act",
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """(scales s [in], the best alpha, {alpha: output error}) for input rows x [n, in] and
    a weight w [out, in]; the error is ||x w^T - (x / s) Q(w s)^T||^2 / ||x w^T||^2.
    `scales`: 'act' (mean|x|^alpha) or 'duo' (`awq_duo_scales`)."""
    _check_scales(scales)
    x, w = x.float(), w.float()
    w_mean = weight_profile(w, group_size) if scales == "duo" else None
    grid = awq_grid(x.abs().mean(0), n_grid, w_mean)
    ref = x @ w.T
    errors: dict[float, float] = {}
    for alpha, s in grid.items():
        w_hat = quantize_int4(w * s, group_size, symmetric).dequantize() / s
        errors[alpha] = ((x @ w_hat.T - ref).pow(2).sum() / ref.pow(2).sum()).item()
    alpha = min(errors, key=errors.__getitem__)
    return grid[alpha], alpha, errors


def _check_scales(scales: str) -> None:
    if scales not in SCALES:
        raise ValueError(
            f"scales must be 'act' (mean|x|^alpha, the paper) or 'duo' (activations and "
            f"weights, AutoAWQ's default), got {scales!r}"
        )


def awq_clip(
    x: torch.Tensor,
    w: torch.Tensor,
    group_size: int,
    symmetric: bool = False,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """w [out, in] with each group clamped to +-(1 - k / n_grid) * its absmax, the k
    (shrinking by at most `max_shrink`) whose quantized group best reproduces the group's
    partial outputs on input rows x [n, in]."""
    out_f, in_f = w.shape
    n_groups = in_f // group_size
    xg = x.float().view(-1, n_groups, group_size).transpose(0, 1)  # [groups, n, g]
    wg = w.float().view(out_f, n_groups, group_size).transpose(0, 1)  # [groups, out, g]
    ref = xg @ wg.transpose(1, 2)  # [groups, n, out]: each group's partial outputs
    absmax = wg.abs().amax(-1, keepdim=True)  # [groups, out, 1]
    best_err = torch.full((n_groups, out_f), float("inf"))
    best_max = absmax.clone()
    for k in range(int(max_shrink * n_grid)):
        limit = absmax * (1 - k / n_grid)
        clipped = wg.clamp(-limit, limit).transpose(0, 1).reshape(out_f, in_f)
        q = quantize_int4(clipped, group_size, symmetric).dequantize()
        qg = q.view(out_f, n_groups, group_size).transpose(0, 1)
        err = (xg @ qg.transpose(1, 2) - ref).pow(2).mean(1)  # [groups, out]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], limit, best_max)
    return wg.clamp(-best_max, best_max).transpose(0, 1).reshape(out_f, in_f).to(w.dtype)


def _rows(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """At most `max_tokens` rows of x, evenly spread (the search's cost is linear in it)."""
    if len(x) <= max_tokens:
        return x
    return x[torch.linspace(0, len(x) - 1, max_tokens).long()]


@torch.inference_mode()
def awq_smooth(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    scheme: str | Scheme = "int4-g128",
    n_grid: int = 20,
    max_tokens: int = 1024,
    clip: bool = False,
    scope: str = "block",
    clip_tokens: int = 512,
    scales: str = "duo",
) -> dict[str, float]:
    """Search AWQ's scales for every scale group of every block and fold them into the
    model, in place, without quantizing: the float model computes the same function
    (unless `clip`, which then also clamps the weights by `awq_clip`, on `clip_tokens`).
    `scope`: 'block' scores each candidate on the output of the module the group feeds
    (the paper's way), 'linear' on the first linear's own output (cheaper, blinder).
    Each candidate costs one forward of that module over `max_tokens` calibration tokens
    (whole sequences; the channel statistics use every token): the knob that sets the
    search's time on a CPU. `scales`: the family searched, 'duo' (default: it measured
    better, see the module docstring) or 'act' (the paper's).
    Returns the chosen alpha per group ('layers.0.input_layernorm': 0.45, ...)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.kind != "int4":
        raise ValueError(f"AWQ here targets int4 group-wise weights, got scheme {scheme}")
    if n_grid < 1:
        raise ValueError(f"n_grid must be at least 1 (alpha = 0 is round-to-nearest), got {n_grid}")
    if scope not in ("block", "linear"):
        raise ValueError(f"scope must be 'block' (the paper's loss) or 'linear', got {scope!r}")
    _check_scales(scales)
    g, sym = scheme.group_size, scheme.symmetric
    calib = calibration_states(model, batches)
    alphas: dict[str, float] = {}
    for i, block in enumerate(model.model.layers):
        for group in scale_groups(block):
            if scope == "block":
                probe = ModuleProbe(block, group, calib, max_tokens)
                w_mean = weight_profile(group_weight(block, group), g) if scales == "duo" else None
                grid = awq_grid(probe.mean_abs, n_grid, w_mean)
                alpha, _ = search_scales(
                    probe, group, grid, lambda w: quantize_int4(w, g, sym).dequantize()
                )
                s = grid[alpha]
            else:
                x = capture_inputs(block, calib, [group.linears[0]])[group.linears[0]]
                s, alpha, _ = awq_search(
                    _rows(x, max_tokens), group_weight(block, group), g, sym, n_grid, scales
                )
            fold_scales(block, group, s)
            alphas[f"layers.{i}.{group.prev}"] = alpha
        if clip:
            names = [n for n in block_linears(block) if not n.endswith(("q_proj", "k_proj"))]
            scaled = capture_inputs(block, calib, names)  # the inputs after folding
            for name in names:
                lin = block.get_submodule(name)
                lin.weight.copy_(awq_clip(_rows(scaled[name], clip_tokens), lin.weight, g, sym))
        run_block(block, calib)
    return alphas


def awq_quantize_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    scheme: str | Scheme = "int4-g128",
    n_grid: int = 20,
    max_tokens: int = 1024,
    scope: str = "block",
    clip_tokens: int = 512,
    scales: str = "duo",
) -> Transformer:
    """AWQ: fold the searched scales and clip the weights (`awq_smooth(clip=True)`), then
    round every block linear to nearest in `scheme` (lm_head kept, as `quantize_model`
    does). In place; returns it."""
    awq_smooth(model, batches, scheme, n_grid, max_tokens, True, scope, clip_tokens, scales)
    return quantize_model(model, scheme)
