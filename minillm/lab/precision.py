"""Half precision's limits, measured on real activations: how large the inputs of chosen
modules get (chapter 01: a residual stream past 256 overflows fp16 in x**2, which is why
RMSNorm squares in fp32), and how two runs' next-token predictions agree."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

FP16_MAX = torch.finfo(torch.float16).max  # 65504: x**2 overflows once |x| > 255.9
FP16_SQUARE_LIMIT = FP16_MAX**0.5


def input_peaks(modules: Iterable[nn.Module], fn: Callable[[], Any]) -> list[float]:
    """max |x| of the first input of each module (in the order given) while `fn` runs.

    A forward pre-hook on each module sees its input before the module computes: for a
    norm layer that is the residual stream, which no layer rescales, so it is where
    a model's largest activations live. A module called several times keeps its max."""
    modules = list(modules)
    peaks = [0.0] * len(modules)

    def hook(i: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
            peaks[i] = max(peaks[i], float(args[0].detach().abs().max()))

        return record

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return peaks


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions whose arg-max token equals the reference's ([..., vocab] each)."""
    if logits.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(logits.shape)} vs {tuple(reference.shape)}")
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
