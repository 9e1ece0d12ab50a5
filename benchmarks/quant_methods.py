"""Chapter 06 benchmark: the quantization methods production uses, built from scratch and
scored by one evaluator in one table: RTN -> GPTQ -> AWQ (INT4), W8A8 with and without
SmoothQuant, FP8; plus the activation outliers of the model that motivate W8A8's trouble.

    python -m benchmarks.quant_methods [--model bundled] [--group G] [--windows N]
                                       [--eval kjv|factbook] [--only NAME ...]
                                       [--quick] [--threads N] [--json out.json]

SmoothQuant rows for each `--alphas` value (default 0.5 and 0.8), and with alpha searched
per scale group (`search_smooth_model`); W8A8 activations per tensor, per token, and per
token with a zero point ('per-token-asym', `fake_quant_activations`). AWQ scores its
scales on the output of the module they feed (the paper's way); the '(per-linear loss)'
row scores each linear's own output; the '(duo scaling)' row searches AutoAWQ's scales,
activations and weights together.
`--only`: just the rows whose name contains one of the words (fp32 and RTN always run).

`--model`: 'bundled' (default; trained, so perplexity means something), a local HF
directory, or 'smollm2'. Calibration: KJV *training* text (`calibration_batches`); scoring:
the held-out KJV text (`held_out_ids`, default) or modern English (`--eval factbook`,
`factbook_ids`), both through the model's own tokenizer. G: int4 group size (default: the
largest of 128/64/32 dividing every layer's input; SmolLM2's 576 takes 64).

Columns: bytes of the quantized linear weights (lm_head kept in fp32 everywhere), held-out
perplexity and its change vs fp32, next-token agreement with fp32 (top-1, teacher-forced),
and the decode-step speed of the row's storage format vs fp32 at batch 1 (A/B interleaved
in this run; INT8 / INT4 on torch's CPU kernels; '-' where the format has no CPU kernel
and is simulated: W8A8 and FP8 need int8 / fp8 GEMMs this CPU path does not have).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.quant import decode_step
from benchmarks.quant_decode import group_size_for
from minillm import load_model, load_tokenizer
from minillm.lab import format_bytes, time_ratios
from minillm.quant import quantize_model, set_activation_quant, weight_bytes
from minillm.quant.awq import awq_quantize_model
from minillm.quant.calibrate import calibration_batches
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--group", type=int, default=None, help="int4 group size")
    ap.add_argument(
        "--alphas", type=float, nargs="+", default=[0.5, 0.8], help="SmoothQuant's strengths"
    )
    ap.add_argument("--windows", type=int, default=None, help="held-out windows of 256 tokens")
    ap.add_argument("--eval", choices=sorted(EVAL_TEXTS), default="kjv", help="scoring text")
    ap.add_argument("--calib", type=int, default=4, help="calibration batches of 4 x 256 tokens")
    ap.add_argument("--only", nargs="+", default=None, help="rows whose name has one of these")
    ap.add_argument(
        "--awq-tokens", type=int, default=None, help="calibration tokens AWQ scores each scale on"
    )
    ap.add_argument("--quick", action="store_true", help="fewer windows and timing rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = None if args.model == "bundled" else args.model
    base, tok = load_model(name), load_tokenizer(name)
    g = args.group or group_size_for(base)
    n_windows = args.windows or (8 if args.quick else 32)
    print(f"torch {torch.__version__}, {args.threads} thread(s), model {args.model}, ", end="")
    print(
        f"{n_windows} {args.eval} windows of {WINDOW} tokens, "
        f"{args.calib} x 4 x 256 calibration tokens"
    )
    batches = calibration_batches(tok, n_batches=args.calib, batch_size=4, seq_len=256)
    x, y = windows(EVAL_TEXTS[args.eval](tok), n_windows)
    stats = outliers(base, batches)
    speed = format_speed(base, g, 3 if args.quick else 9)
    chosen = {
        label: entry
        for label, entry in methods(
            g, args.alphas, {"max_tokens": args.awq_tokens} if args.awq_tokens else None
        ).items()
        if args.only is None
        or label in ("fp32", f"RTN int4 g{g}")
        or any(word in label for word in args.only)
    }
    print()
    rows = evaluate(base, batches, x, y, chosen, speed)
    result = {
        "model": args.model,
        "group": g,
        "eval": args.eval,
        "windows": len(x),
        "calibration_tokens": sum(b.numel() for b in batches),
        "outliers": stats,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return result


def recovered(rows: dict[str, Any], method: str, rtn: str) -> float:
    """Share of RTN's perplexity loss that `method` wins back (1 = all of it)."""
    loss = rows[rtn]["ppl"] - rows["fp32"]["ppl"]
    return (rows[rtn]["ppl"] - rows[method]["ppl"]) / loss if loss > 0 else float("nan")


def summary(result: dict[str, Any]) -> str:
    """One SUMMARY line over the rows that ran."""
    rows, g = result["rows"], result["group"]
    rtn = f"RTN int4 g{g}"
    parts = [f"int4 g{g} ppl delta RTN {100 * rows[rtn]['ppl_delta']:+.2f}%"]
    awqs = [f"AWQ int4 g{g}{v}" for v in ("", " (per-linear loss)", " (duo scaling)")]
    for method in (f"GPTQ int4 g{g}", *awqs):
        if method in rows:
            parts.append(
                f"{method.split(' int4')[0]}{method.split(f'g{g}')[1]} "
                f"{100 * rows[method]['ppl_delta']:+.2f}% "
                f"(recovers {recovered(rows, method, rtn):.0%})"
            )
    for act in ("per-tensor", "per-token", "per-token-asym"):
        smooth = [k for k in rows if k.startswith("SmoothQuant") and k.endswith(act)]
        if f"W8A8 {act}" in rows and smooth:
            best = min(smooth, key=lambda k: rows[k]["ppl"])
            parts.append(
                f"W8A8 {act} {100 * rows[f'W8A8 {act}']['ppl_delta']:+.2f}% -> {best} "
                f"{100 * rows[best]['ppl_delta']:+.2f}%"
            )
    if "FP8 e4m3 W(ch)+A(tensor)" in rows:
        parts.append(f"FP8 e4m3 {100 * rows['FP8 e4m3 W(ch)+A(tensor)']['ppl_delta']:+.2f}%")
    parts.append(f"outlier ratio max {result['outliers']['max_ratio']:.0f}")
    return f"SUMMARY quant_methods {result['model']}: " + "; ".join(parts)


if __name__ == "__main__":
    main()
