"""Chapter 06's decode speed on torch's int8 / int4 CPU kernels (`python -m
benchmarks.quant_decode`): fewer weight bytes become faster decoding when a kernel reads
the quantized weights directly. Each format is a separate model; one cached decode step of
each is timed A/B interleaved against fp32, and its time split into kernels, framework and
Python."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minillm.bench.quant import decode_step
from minillm.lab import format_bytes, kernel_shares, profile_split, time_ratios
from minillm.model import CONFIGS, Transformer, load_model, random_model
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
    """Per format: decode tok/s vs fp32, weight bytes read per step, and the shares of the
    step's time in kernels, framework and Python, with its top kernels."""
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
    """The table of `measure`'s rows for one batch size."""
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
