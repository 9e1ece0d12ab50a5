"""AWQ from scratch (Lin et al., 2023): activation-aware weight quantization.

Not all weights matter alike: the input channels that carry large activations multiply
their weight errors by large numbers. AWQ protects them without mixed precision: scale
those weight columns up before rounding (so their relative rounding error shrinks) and
the activations down by the same factor, folded into the op before (`smoothing`):

    W x = (W diag(s)) (x / s),    quantize W diag(s) instead of W.

The scales follow the activations: s = mean|x|^alpha per input channel (normalised so
max * min = 1), with alpha searched on calibration data to minimise the quantized layer's
output error ||x W^T - (x / s) Q(W diag(s))^T||. alpha = 0 is plain round-to-nearest, so
the search can only do as well or better on the calibration tokens. As in the paper's
code, blocks are processed in order, each calibrated on the outputs of the scaled (not
yet quantized) blocks before it; every linear is then rounded to nearest.

Left out, and said here: AWQ's second search over a clipping range per weight group, and
the loss on a whole attention/MLP output (here: the outputs of the linears themselves).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minillm.model.transformer import Transformer
from minillm.quant.formats import quantize_int4
from minillm.quant.linear import Scheme, parse_scheme, quantize_model
from minillm.quant.sequential import calibration_states, capture_inputs, run_block
from minillm.quant.smoothing import fold_scales, group_weight, scale_groups


def awq_search(
    x: torch.Tensor,
    w: torch.Tensor,
    group_size: int,
    symmetric: bool = False,
    n_grid: int = 20,
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """(scales s [in], the best alpha, {alpha: output error}) for input rows x [n, in] and
    a weight w [out, in]; the error is ||x w^T - (x / s) Q(w s)^T||^2 / ||x w^T||^2."""
    x, w = x.float(), w.float()
    mean_abs = x.abs().mean(0)
    ref = x @ w.T
    errors: dict[float, float] = {}
    best: tuple[float, torch.Tensor] | None = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = mean_abs.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = quantize_int4(w * s, group_size, symmetric).dequantize() / s
        err = ((x @ w_hat.T - ref).pow(2).sum() / ref.pow(2).sum()).item()
        errors[alpha] = err
        if best is None or err < errors[best[0]]:
            best = (alpha, s)
    assert best is not None  # n_grid >= 1
    return best[1], best[0], errors


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
    max_tokens: int = 4096,
) -> dict[str, float]:
    """Search AWQ's scales for every scale group of every block and fold them into the
    model, in place, without quantizing (the float model computes the same function).
    Returns the chosen alpha per group ('layers.0.input_layernorm': 0.45, ...)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.kind != "int4":
        raise ValueError(f"AWQ here targets int4 group-wise weights, got scheme {scheme}")
    if n_grid < 1:
        raise ValueError(f"n_grid must be at least 1 (alpha = 0 is round-to-nearest), got {n_grid}")
    calib = calibration_states(model, batches)
    alphas: dict[str, float] = {}
    for i, block in enumerate(model.model.layers):
        groups = scale_groups(block)
        inputs = capture_inputs(block, calib, [g.linears[0] for g in groups])
        for group in groups:
            x = _rows(inputs[group.linears[0]], max_tokens)
            s, alpha, _ = awq_search(
                x, group_weight(block, group), scheme.group_size, scheme.symmetric, n_grid
            )
            fold_scales(block, group, s)
            alphas[f"layers.{i}.{group.prev}"] = alpha
        run_block(block, calib)
    return alphas


def awq_quantize_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    scheme: str | Scheme = "int4-g128",
    n_grid: int = 20,
    max_tokens: int = 4096,
) -> Transformer:
    """AWQ: fold the searched scales (`awq_smooth`), then round every block linear to
    nearest in `scheme` (lm_head kept, as `quantize_model` does). In place; returns it."""
    awq_smooth(model, batches, scheme, n_grid, max_tokens)
    return quantize_model(model, scheme)
