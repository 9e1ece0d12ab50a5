"""Chapter 06's quantization methods, built from scratch and scored by one evaluator
(`python -m benchmarks.quant_methods`): RTN, GPTQ and AWQ (INT4), W8A8 with and without
SmoothQuant, FP8; the activation outliers behind W8A8's trouble; the decode speed of each
storage format on torch's CPU kernels."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minillm.bench.quant import decode_step
from minillm.lab import format_bytes, time_ratios
from minillm.quant import quantize_model, set_activation_quant, weight_bytes
from minillm.quant.awq import awq_quantize_model
from minillm.quant.fp8 import fp8_quantize_model
from minillm.quant.gptq import gptq_quantize_model
from minillm.quant.linear import use_cpu_kernels
from minillm.quant.smoothquant import (
    ALPHAS,
    calibration_absmax,
    outlier_report,
    smoothquant_model,
)
from minillm.training import factbook_ids, held_out_ids

WINDOW = 256
EVAL_TEXTS = {"kjv": held_out_ids, "factbook": factbook_ids}


def methods(
    g: int,
    alphas: list[float],
    awq: dict[str, int] | None = None,
    search: tuple[tuple[float, ...], int] = (ALPHAS, 2048),
) -> dict[str, tuple[str, Callable[..., nn.Module]]]:
    """name -> (speed format, build(model, batches)). Each build gets its own copy.
    `awq`: options for `awq_quantize_model` (n_grid, max_tokens, clip_tokens); `search`:
    SmoothQuant's searched alphas and tokens per candidate. The notebook passes lighter
    searches than these defaults."""
    awq = awq or {}

    def w8a8(act: str) -> Callable[..., nn.Module]:
        def build(m: nn.Module, b: list[torch.Tensor]) -> nn.Module:
            quantize_model(m, "int8")
            set_activation_quant(m, act)
            return m

        return build

    def smooth(alpha: float | tuple[float, ...], act: str) -> Callable[..., nn.Module]:
        return lambda m, b: smoothquant_model(m, b, alpha, act, max_tokens=search[1])

    s = f"int4-g{g}"
    sq = {
        f"SmoothQuant a={a} per-{act}": ("-", smooth(a, act))
        for act in ("tensor", "token")
        for a in alphas
    }
    searched = {
        f"SmoothQuant searched per-{act}": ("-", smooth(search[0], act))
        for act in ("tensor", "token", "token-asym")
    }
    return {
        "fp32": ("fp32", lambda m, b: m),
        f"RTN int4 g{g}": (s, lambda m, b: quantize_model(m, s)),
        f"GPTQ int4 g{g}": (s, lambda m, b: gptq_quantize_model(m, b, s)),
        f"AWQ int4 g{g}": (s, lambda m, b: awq_quantize_model(m, b, s, scales="act", **awq)),
        f"AWQ int4 g{g} (per-linear loss)": (
            s,
            lambda m, b: awq_quantize_model(m, b, s, scope="linear", scales="act", **awq),
        ),
        f"AWQ int4 g{g} (duo scaling)": (
            s,
            lambda m, b: awq_quantize_model(m, b, s, scales="duo", **awq),
        ),
        f"RTN int4 g{g} (kernel)": (s, lambda m, b: _kernel(quantize_model(m, s))),
        "RTN int8 (weights)": ("int8", lambda m, b: quantize_model(m, "int8")),
        "W8A8 per-tensor": ("-", w8a8("tensor")),
        "W8A8 per-token": ("-", w8a8("token")),
        "W8A8 per-token-asym": ("-", w8a8("token-asym")),
        **sq,
        **searched,
        "FP8 e4m3 W(ch)+A(tensor)": ("-", lambda m, b: fp8_quantize_model(m, "e4m3", True, "e4m3")),
        "FP8 e4m3 W(tensor)+A(tensor)": (
            "-",
            lambda m, b: fp8_quantize_model(m, "e4m3", False, "e4m3"),
        ),
        "FP8 e5m2 W(ch)+A(tensor)": ("-", lambda m, b: fp8_quantize_model(m, "e5m2", True, "e5m2")),
    }


def _kernel(model: nn.Module) -> nn.Module:
    """The model on torch's CPU kernels (bf16 activations): what the speed column times."""
    use_cpu_kernels(model)
    return model


def format_speed(base: nn.Module, g: int, repeats: int) -> dict[str, float]:
    """Decode tok/s of each storage format vs fp32, batch 1, kernels on."""
    cfg = base.config
    fns = {"fp32": decode_step(base, cfg)}
    for scheme in ("int8", f"int4-g{g}"):
        fns[scheme] = decode_step(_kernel(quantize_model(copy.deepcopy(base), scheme)), cfg)
    return {name: 1 / r for name, r in time_ratios(fns, "fp32", repeats=repeats).items()}


def outliers(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, Any]:
    """The LLM.int8() picture: per linear, max |x| over the median channel's max |x|."""
    report = sorted(outlier_report(calibration_absmax(model, batches)), key=lambda r: -r.ratio)
    print("\nactivation outliers (inputs of each linear; calibration text):")
    print(f"  {'linear':<36}{'max|x|':>9}{'median ch':>11}{'ratio':>8}  top channels")
    for r in report[:6]:
        print(
            f"  {r.name:<36}{r.absmax:>9.2f}{r.median_channel:>11.3f}{r.ratio:>8.1f}  "
            f"{r.top_channels}"
        )
    over6 = sum(r.absmax > 6.0 for r in report)
    print(f"  {over6}/{len(report)} linears see |x| > 6 (LLM.int8()'s outlier threshold)")
    return {"max_ratio": report[0].ratio, "worst": report[0].name, "over_6": over6}


def score(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, ref_top1: torch.Tensor, batch: int = 8
) -> tuple[float, float]:
    """(perplexity, next-token agreement with the reference's top-1 `ref_top1`) over the
    windows x -> y [n, window], from one forward per batch: the same numbers as
    `minillm.training.perplexity` and `next_token_agreement`, at a third of their cost."""
    device = next(model.parameters()).device
    nll, same = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            logits = model(x[i : i + batch].to(device)).float().cpu()
            nll += F.cross_entropy(
                logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum"
            )
            same += int((logits.argmax(-1) == ref_top1[i : i + batch]).sum())
    return math.exp(float(nll) / y.numel()), same / y.numel()


def windows(ids: torch.Tensor, n: int, window: int = WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n windows of `window` tokens and their next tokens (as `perplexity`)."""
    n = min(n, (len(ids) - 1) // window)
    return ids[: n * window].view(n, window), ids[1 : n * window + 1].view(n, window)


def evaluate(
    base: nn.Module,
    batches: list[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    chosen: dict[str, tuple[str, Callable[..., nn.Module]]],
    speed: dict[str, float],
    device: torch.device | str = "cpu",
    show: bool = True,
) -> dict[str, dict[str, Any]]:
    """Build each method on a copy of `base` (on the CPU, where calibration runs), score it
    on `device`, and return one row per method: bytes of the block linears, perplexity,
    its change vs fp32, next-token agreement with fp32, the speed of its storage format
    (from `speed`, None where it has no CPU kernel) and the build time."""
    head = base.lm_head.weight.nbytes
    ref = copy.deepcopy(base).to(device)
    with torch.inference_mode():
        top1 = torch.cat(
            [ref(x[i : i + 8].to(device)).argmax(-1).cpu() for i in range(0, len(x), 8)]
        )
    base_ppl, _ = score(ref, x, y, top1)
    del ref
    rows: dict[str, dict[str, Any]] = {}
    if show:
        print(f"  {'method':<36}{'linear W':>10}{'ppl':>9}{'d ppl':>9}{'agree':>8}{'decode':>8}")
    for label, (fmt, build) in chosen.items():
        t0 = time.perf_counter()
        model = build(copy.deepcopy(base), batches)
        built_s = time.perf_counter() - t0
        if label == "fp32":
            ppl, agree = base_ppl, 1.0
        else:
            on_cpu = any(getattr(m, "kernel", None) is not None for m in model.modules())
            ppl, agree = score(model if on_cpu else model.to(device), x, y, top1)
        rows[label] = {
            "bytes": weight_bytes(model, only_linear=True) - head,
            "ppl": ppl,
            "ppl_delta": ppl / base_ppl - 1,
            "agreement": agree,
            "speed": speed.get(fmt),
            "build_s": built_s,
        }
        if show:
            r = rows[label]
            sp = f"{r['speed']:.2f}x" if r["speed"] else "-"
            print(
                f"  {label:<36}{format_bytes(r['bytes']):>10}{ppl:>9.3f}"
                f"{100 * r['ppl_delta']:>+8.2f}%{agree:>8.3f}{sp:>8}  (built in {built_s:.0f} s)",
                flush=True,
            )
    return rows


def recovered(rows: dict[str, Any], method: str, rtn: str) -> float:
    """Share of RTN's perplexity loss that `method` wins back (1 = all of it)."""
    loss = rows[rtn]["ppl"] - rows["fp32"]["ppl"]
    return (rows[rtn]["ppl"] - rows[method]["ppl"]) / loss if loss > 0 else float("nan")
