"""Chapter 02 benchmark, part (d): batch-1 cached decode against the memory-bandwidth
roofline, measured in the same run: bytes read per token x tokens/s vs the read bandwidth,
as loaded, with the decode weight layout, and compiled with frozen weights; where an eager
step's time goes. Re-exported by `minillm.bench.kv_cache` for the chapter 02 notebook.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from minillm.bench.kv_costs import kv_bytes_per_token, random_ids, step_fns
from minillm.cache import KVCache
from minillm.generation.static import compile_decode_step
from minillm.lab import format_bytes, measure_roofline, paired_ratios, profile_split, time_samples
from minillm.model import ModelConfig, Transformer, random_model
from minillm.model.layout import decode_layout, matvec_applies, use_matvec
from minillm.model.shapes import SMOLLM2_135M

COMPILED = "compiled (frozen weights, max-autotune)"
MATVEC = "C matvec kernel"


def matvec_fn(model: Transformer) -> Callable[[], Any]:
    """The decode step's matrix-vector products alone: one row through every linear layer
    (the LM head included), back to back, no model code around them. Through the layers
    themselves, so a `MatVecLinear` runs its kernel."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    first = linears[0].weight
    rows = {
        m.in_features: torch.randn(1, m.in_features, dtype=first.dtype, device=first.device)
        for m in linears
    }

    @torch.inference_mode()
    def run() -> None:
        for m in linears:
            m(rows[m.in_features])

    return run


def compiled_step_fn(model: Transformer, context: int) -> tuple[Callable[[], Any], float]:
    """(the step of `step_fns(model, context)["cached"]` compiled with frozen weights and
    max-autotune (`compile_decode_step(freeze=True)`), its compile seconds). A static
    cache of `context` slots, all attended (chapter 05's fixed shapes): the same work as
    the eager step's `context` filled slots."""
    ids = random_ids(model, context)
    weight = model.lm_head.weight
    cache = KVCache(model.config, 1, context, weight.dtype, weight.device)
    step = compile_decode_step("max-autotune-no-cudagraphs", freeze=True)
    last, pos = ids[:, context - 1 :], torch.tensor([[context - 1]], device=weight.device)
    with torch.inference_mode():
        cache.kv_len = context - 1
        if context > 1:
            model(ids[:, : context - 1], cache=cache)
        cache.kv_len = context
        t0 = time.perf_counter()
        step(model, cache, last, pos)
        compile_s = time.perf_counter() - t0

    @torch.inference_mode()
    def compiled() -> torch.Tensor:
        return step(model, cache, last, pos)

    return compiled, compile_s


def decode_roofline(
    model: Transformer | ModelConfig | dict[str, Any] = SMOLLM2_135M,
    context: int = 64,
    repeats: int = 10,
    copy_bytes: int = 512 * 2**20,
    split: bool = True,
    layout: bool | None = None,
    compiled: bool = False,
) -> dict[str, Any]:
    """Batch-1 cached decode at `context` tokens: tokens/s x bytes read per token (every
    weight once, plus the K/V read by attention) vs the read bandwidth measured here on a
    `copy_bytes` buffer (default: larger than any CPU cache: main memory), the best of a
    ceiling measurement and of reads timed in turn with the steps. `model`: a
    model, or a config for a random-weight one. `layout` (default: on a CPU) also times a
    copy with `decode_layout`'s weights, and one whose linear layers run the C matvec
    kernel (`use_matvec`, where a C compiler builds it); `compiled` also the step compiled
    with frozen weights and max-autotune (`compiled_step_fn`: minutes of compile on
    SmolLM2). Where the time goes: the matrix-vector products alone (`matvec_fn`) against
    the eager steps, and `profile_split` of the fastest eager step on ATen's kernels."""
    if not isinstance(model, Transformer):
        model = random_model(model)
    weight = model.lm_head.weight
    layout = weight.device.type == "cpu" if layout is None else layout
    models = {"as loaded": model}
    if layout:
        models["decode layout"] = decode_layout(copy.deepcopy(model))
        if matvec_applies(model):  # the C kernel: fp32, and a compiler that builds it
            models[MATVEC] = use_matvec(copy.deepcopy(model))
    fns = {}
    for label, m in models.items():
        fns[label] = step_fns(m, context)["cached"]
        fns[f"{label}: matvecs"] = matvec_fn(m)
    compile_s = None
    if compiled:
        fns[COMPILED], compile_s = compiled_step_fn(model, context)
    roof = measure_roofline(weight.device, copy_bytes=copy_bytes)
    # The read bandwidth again, timed in turn with the steps: on a shared machine the bus
    # is busier at some moments than others, and the bound is the best read seen in the run.
    src = torch.empty(copy_bytes // 4, device=weight.device).uniform_()
    fns["read"] = src.sum
    samples = time_samples(fns, repeats=repeats, warmup=2)
    # Best of `repeats`, like the ceilings it is compared with (best of their runs): on a
    # shared machine a median mixes in other processes' use of the memory bus.
    best = {k: min(v) for k, v in samples.items()}
    read_Bps = max(roof.read_bytes_per_s, src.nbytes / best["read"])
    del src
    c = model.config
    weights = sum(p.nbytes for p in model.parameters())  # a tied embedding counts once
    kv = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 4) * context
    kv = kv * weight.element_size() // 4
    matvec_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_token = weights + kv
    bound_tps = read_Bps / per_token
    out: dict[str, Any] = {
        "params": model.num_parameters(),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "weight_bytes": weights,
        "kv_bytes_read": kv,
        "bytes_per_token": per_token,
        "bandwidth_Bps": roof.bytes_per_s,  # copy: (read + write) / s
        "read_Bps": read_Bps,
        "bound_tokens_per_s": bound_tps,
        "variants": {},
    }
    ratios = paired_ratios(samples, "as loaded")
    for label in [*models, *([COMPILED] if compiled else [])]:
        step_s = best[label]
        v = out["variants"][label] = {
            "tokens_per_s": 1 / step_s,
            "fraction_of_bound": (1 / step_s) / bound_tps,
            "achieved_Bps": per_token / step_s,
        }
        if label in models:
            mv_s = best[f"{label}: matvecs"]
            v["matvec_share"] = mv_s / step_s  # of a step's time: the products alone
            v["matvec_Bps"] = matvec_bytes / mv_s
        if label != "as loaded":
            v["speedup"] = 1 / ratios[label]
    if compiled:  # the same logits as the eager step (each call rewrites the same slot)
        diff = (fns[COMPILED]() - fns["as loaded"]()).abs().max().item()
        out["variants"][COMPILED] |= {"compile_s": compile_s, "max_abs_diff": diff}
    out["best"] = max(out["variants"], key=lambda k: out["variants"][k]["tokens_per_s"])
    top = out["variants"][out["best"]]
    out.update({k: top[k] for k in ("tokens_per_s", "fraction_of_bound", "achieved_Bps")})
    if split:
        # the profiler sees ATen ops only: the C kernel's calls would count as Python
        aten = [k for k in models if k != MATVEC]
        eager = max(aten, key=lambda k: out["variants"][k]["tokens_per_s"])
        out["split_of"] = eager
        s = profile_split(fns[eager], repeats=3, warmup=1)
        out["split"] = s.fractions()
        # Bandwidth inside the kernels alone: the same-run step time, less its overhead share.
        out["kernel_Bps"] = out["achieved_Bps"] / s.kernel_fraction
    return out


def print_roofline(r: dict[str, Any], name: str = "SmolLM2-135M") -> None:
    """The report of `decode_roofline`: the bound, each variant against it, the split."""
    print(f"\n(d) roofline, {name}, batch-1 cached decode, {r['dtype']}, {r['device']}")
    print(f"  bytes read per token: {format_bytes(r['bytes_per_token'])} ", end="")
    print(f"(weights {format_bytes(r['weight_bytes'])} + KV {format_bytes(r['kv_bytes_read'])})")
    print(f"  measured read bandwidth: {r['read_Bps'] / 1e9:.1f} GB/s", end="")
    print(
        f" (copy: {r['bandwidth_Bps'] / 1e9:.1f} GB/s) -> bound {r['bound_tokens_per_s']:.1f} tok/s"
    )
    for label, v in r["variants"].items():
        gain = f", {v['speedup']:.2f}x as loaded" if "speedup" in v else ""
        print(
            f"  {label + ':':<15} {v['tokens_per_s']:.1f} tok/s = "
            f"{v['achieved_Bps'] / 1e9:.1f} GB/s = {v['fraction_of_bound']:.0%} of the bound{gain}"
        )
        if "matvec_Bps" in v:
            print(
                f"    matrix-vector products alone {v['matvec_share']:.0%} of the step, at "
                f"{v['matvec_Bps'] / 1e9:.1f} GB/s "
                f"({v['matvec_Bps'] / r['read_Bps']:.0%} of the read bandwidth)"
            )
        if "compile_s" in v:
            print(
                f"    compiled in {v['compile_s']:.0f} s (a GEMM kernel timed and kept per shape);"
                f" logits within {v['max_abs_diff']:.1e} of the eager step's"
            )
    if "peer" in r:
        p = r["peer"]
        print(
            f"  {p['name']}: {p['tokens_per_s']:.1f} tok/s = {p['fraction_of_bound']:.0%} of the "
            f"bound (best of {len(p['rounds'])}); minillm's best is {p['minillm_vs_peer']:.2f}x it"
        )
    if "split" in r:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in r["split"].items())
        print(f"  where an eager step's time goes ({r['split_of']}, profiler): {parts}")
