"""Chapter 06 benchmark: fewer weight bytes become faster decoding, on this CPU, when a
kernel reads the quantized weights directly (torch's int8 / int4 CPU kernels).

    python -m benchmarks.quant_decode [--model SmolLM2-135M] [--batch 1 8] [--context 64]
                                      [--quick] [--threads N] [--json out.json]

`--model`: a shape name of `minillm.model.shapes` (random weights: speed depends on shapes,
not on what the weights learned; the default), 'bundled', or anything `load_model` takes
(a local HF directory, 'smollm2' once that model name exists).

For each batch size: one cached decode step (batch rows, `--context` tokens already in the
cache) timed A/B interleaved against fp32 in the same run, for

    fp32, bf16                   the model's dtype
    int8, int4-gG                QuantLinear on torch's CPU kernels (bf16 activations),
                                 lm_head kept in fp32 (it is the tied embedding)
    int8+head, int4-gG+head      the same with the lm_head quantized too (a second, small
                                 copy of the embedding: what llama.cpp's Q4 files do)
    int4-gG dequant              chapter 06's QuantLinear: rebuild fp32 W at every call

and reports decode tok/s as a ratio to fp32 (> 1: faster), the weight bytes one step
reads, and where each variant's time goes (`profile_split`, `kernel_shares`). G is the
largest of 128 / 64 / 32 that divides every layer's input size. One SUMMARY line.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.quant import decode_step
from minillm import load_model
from minillm.lab import format_bytes, kernel_shares, machine_info, profile_split, time_ratios
from minillm.model import Transformer, random_model
from minillm.model.shapes import CONFIGS
from minillm.quant import quantize_model, weight_bytes
from minillm.quant.linear import use_cpu_kernels


def load(name: str) -> Transformer:
    """A shape name (random weights), 'bundled', or a `load_model` argument."""
    if name in CONFIGS:
        return random_model(name)
    return load_model(None if name == "bundled" else name)


def group_size_for(model: Transformer) -> int:
    """The largest int4 group size of the CPU kernel's (128, 64, 32) dividing every input."""
    cfg = model.config
    sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
    for g in (128, 64, 32):
        if all(n % g == 0 for n in sizes):
            return g
    raise ValueError(f"no int4 group size of 128/64/32 divides the layer inputs {sizes}")


def variants(base: Transformer) -> dict[str, nn.Module]:
    """The formats compared, each a separate model (the base is fp32)."""
    g = group_size_for(base)
    out: dict[str, nn.Module] = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    for scheme in ("int8", f"int4-g{g}"):
        for keep, suffix in ((("lm_head",), ""), ((), "+head")):
            model = quantize_model(copy.deepcopy(base), scheme, keep=keep)
            skipped = use_cpu_kernels(model)
            if skipped:
                print(f"  {scheme}{suffix}: no kernel for {skipped}")
            out[scheme + suffix] = model
    out[f"int4-g{g} dequant"] = quantize_model(copy.deepcopy(base), f"int4-g{g}")
    return out


def step_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: all weights but the embedding table (one row
    of it is read per token), the lm_head counted even when tied to it."""
    total = weight_bytes(model)
    emb = model.model.embed_tokens.weight
    head = model.lm_head
    if getattr(head, "weight", None) is emb:  # tied and not quantized: the head reads it
        return total
    return total - emb.nbytes


def measure(models: dict[str, nn.Module], batch: int, context: int, repeats: int) -> dict[str, Any]:
    cfg = models["fp32"].config
    steps: dict[str, Callable[[], Any]] = {
        name: decode_step(m, cfg, context, batch) for name, m in models.items()
    }
    ratios = time_ratios(steps, "fp32", repeats=repeats, warmup=2)
    split = {name: profile_split(fn, repeats=3, warmup=1) for name, fn in steps.items()}
    rows = {}
    for name, fn in steps.items():
        s = split[name]
        rows[name] = {
            "speedup": 1 / ratios[name],
            "bytes": step_bytes(models[name]),
            "kernel": s.kernel_fraction,
            "framework": s.framework_s / s.wall_s,
            "python": s.python_s / s.wall_s,
            "top_kernels": kernel_shares(fn, top=3),
        }
    return rows


def print_rows(rows: dict[str, Any], batch: int) -> None:
    print(f"\nbatch {batch}: decode tok/s as a ratio to fp32 (A/B interleaved, same run)")
    head = f"{'format':<18}{'x fp32':>8}{'W read':>10}{'kernel':>8}{'fwk':>6}"
    print(head + f"{'py':>6}  top kernels (share of kernel time)")
    for name, r in rows.items():
        tops = ", ".join(f"{k.removeprefix('aten::')} {v:.0%}" for k, v in r["top_kernels"].items())
        print(
            f"{name:<18}{r['speedup']:>8.2f}"
            f"{format_bytes(r['bytes']):>10}{r['kernel']:>8.0%}{r['framework']:>6.0%}"
            f"{r['python']:>6.0%}  {tops}"
        )


def summary(results: dict[int, dict[str, Any]], model: str) -> str:
    parts = []
    for batch, rows in results.items():
        speed = ", ".join(f"{n} {r['speedup']:.2f}x" for n, r in rows.items() if n != "fp32")
        parts.append(f"batch {batch}: {speed}")
    return f"SUMMARY quant_decode {model}: decode tok/s vs fp32: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[int, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=64, help="tokens in the cache")
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # The kernels' speed depends on the CPU (AVX2 vs AVX512: the int8/int4 ratios differ
    # by 1.5x between two CPUs here), so the run records it.
    machine = machine_info(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), model {args.model}, ", end="")
    print(f"context {args.context}, CPU capability {machine['cpu_capability']}")
    models = variants(load(args.model))
    repeats = 5 if args.quick else 15
    results = {}
    for batch in args.batch:
        results[batch] = measure(models, batch, args.context, repeats)
        print_rows(results[batch], batch)
    if args.json:
        by_batch = {str(b): r for b, r in results.items()}
        args.json.write_text(json.dumps({"machine": machine, **by_batch}, indent=2))
    print(summary(results, args.model))
    return results


if __name__ == "__main__":
    main()
