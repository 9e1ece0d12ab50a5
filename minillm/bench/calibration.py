"""Chapter 04 benchmark: what TensorRT does, built small and measured on the bundled model
(the command line is `python -m benchmarks.calibration`, which says what each part shows).

(a) `calibration`: INT8 activation statistics, each method's clipping thresholds and the
    quality of each calibrated model; (d) `explicit_qdq`: the same scales as Q/DQ ONNX graphs
    on ONNX Runtime. (b) `fusion`: norm folding and QKV / gate-up fusion, checked and timed
    on the bundled model; (c) `fusion_at_width`: the same timing at SmolLM2-135M's shapes.
Speed figures are ratios measured in the same run; quality figures are deterministic for
a given calibration set.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minillm.bench.kv_costs import step_fns
from minillm.bench.workload import SEED
from minillm.generation import generate, greedy_params
from minillm.lab import ops_per_forward, time_ratios
from minillm.model import ModelConfig, Transformer, load_model, load_tokenizer
from minillm.model.shapes import SMOLLM2_135M
from minillm.quant.calibrate import (
    TensorStats,
    calibration_batches,
    collect_stats,
    compare_methods,
    compute_scales,
    entropy_threshold,
    fake_quantize_model,
    percentile_threshold,
)
from minillm.quant.fusion import fuse_model
from minillm.training import held_out_ids, next_token_agreement, perplexity

PROMPT = "And the LORD said unto Moses, Speak unto"  # the bundled model's (a KJV model)


# --------------------------------------------------------------------- (a) calibration


def calibration(
    n_batches: int = 8, batch_size: int = 4, seq_len: int = 128, max_windows: int = 64
) -> dict[str, Any]:
    """Stats on n_batches x batch_size x seq_len training tokens; quality of each method on
    the first `max_windows` 128-token windows of the held-out text."""
    model, tok = load_model(), load_tokenizer()
    batches = calibration_batches(tok, n_batches, batch_size, seq_len)
    stats = collect_stats(model, batches)
    thresholds = {
        name: {
            "max": s.absmax,
            "percentile": percentile_threshold(s),
            "entropy": entropy_threshold(s),
        }
        for name, s in stats.items()
        if name.endswith("down_proj")
    }
    quality = compare_methods(model, stats, held_out_ids(tok), window=128, max_windows=max_windows)
    return {
        "calibration_tokens": n_batches * batch_size * seq_len,
        "eval_tokens": max_windows * 128,
        "thresholds": thresholds,
        "quality": quality,
        "explicit_qdq": explicit_qdq(model, stats, held_out_ids(tok), max_windows),
    }


def explicit_qdq(
    model: Transformer, stats: dict[str, TensorStats], eval_ids: torch.Tensor, max_windows: int
) -> dict[str, Any]:
    """(d) The scales as Q/DQ ONNX graphs on ORT's CPU provider, scored like (a), and each
    int8 graph's top-1 agreement with our fake quantization of the same scales."""
    import tempfile

    import onnx

    from minillm.export.onnx_runtime import ort_logits_fn, ort_session
    from minillm.export.qdq import export_qdq, to_fp8

    kw = {"window": 128, "max_windows": max_windows}
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {}
        for method in ("percentile", "max"):
            scales = compute_scales(stats, method)
            path = export_qdq(model, scales, Path(tmp) / f"{method}.onnx")
            graphs[f"int8 {method}"] = (path, fake_quantize_model(model, scales))
        fp8_path = Path(tmp) / "fp8.onnx"
        onnx.save(to_fp8(onnx.load(graphs["int8 max"][0])), fp8_path)
        graphs["fp8 e4m3 max"] = (fp8_path, None)
        for name, (path, ours) in graphs.items():
            fn = ort_logits_fn(ort_session(path, "all"))
            rows[name] = {
                "perplexity": perplexity(fn, eval_ids, **kw),
                "agreement": next_token_agreement(model, fn, eval_ids, **kw),
            }
            if ours is not None:
                rows[name]["agreement_with_fake_quant"] = next_token_agreement(
                    ours, fn, eval_ids, **kw
                )
    return rows


# -------------------------------------------------------------------------- (b) fusion


def decode_step_fn(model: Transformer, context: int = 64) -> Callable[[], torch.Tensor]:
    """One cached decode step at position context-1 (the cache prefilled before), on the
    model's device and in its dtype: chapter 02's cached step (`step_fns`)."""
    return step_fns(model, context)["cached"]


def forward_fn(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A forward of `model` over `ids` (a prefill without a cache), to time."""

    @torch.inference_mode()
    def call() -> torch.Tensor:
        return model(ids)

    return call


def fusion(repeats: int = 30, prefill: int = 128, new_tokens: int = 32) -> dict[str, Any]:
    """Equality, ops saved and speed of the fused bundled model."""
    model, tok = load_model(), load_tokenizer()
    fused = fuse_model(model)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(model.config.vocab_size, (1, prefill), generator=g)
    with torch.inference_mode():
        a, b = model(ids), fused(ids)
    params = greedy_params(new_tokens)
    prompt = [tok.encode(PROMPT)]
    same_tokens = generate(model, prompt, params) == generate(fused, prompt, params)
    # The counts do not depend on the number of tokens: one forward is one op sequence.
    ops = {"unfused": ops_per_forward(model, ids), "fused": ops_per_forward(fused, ids)}

    speed = {
        "prefill": time_ratios(
            {"unfused": forward_fn(model, ids), "fused": forward_fn(fused, ids)},
            "unfused",
            repeats=repeats,
        )["fused"],
        "decode": time_ratios(
            {"unfused": decode_step_fn(model), "fused": decode_step_fn(fused)},
            "unfused",
            repeats=repeats * 3,
            warmup=5,
        )["fused"],
    }
    return {
        "max_abs_diff": (a - b).abs().max().item(),
        "max_abs_logit": a.abs().max().item(),
        "same_greedy_tokens": same_tokens,
        "new_tokens": new_tokens,
        "ops": ops,
        "time_fused_over_unfused": speed,
        "prefill_tokens": prefill,
    }


def fusion_at_width(
    cfg: dict[str, Any] = SMOLLM2_135M, prefill: int = 64, repeats: int = 5
) -> dict[str, Any]:
    """Fused / unfused time on a random-weight model of real shapes (speed needs shapes only)."""
    torch.manual_seed(SEED)
    model = Transformer(ModelConfig.from_hf(cfg)).eval()
    fused = fuse_model(model)
    ids = torch.randint(model.config.vocab_size, (1, prefill), generator=torch.Generator())

    with torch.inference_mode():
        rel = (model(ids) - fused(ids)).abs().max().item() / model(ids).abs().max().item()
    steps = {"unfused": decode_step_fn(model, prefill), "fused": decode_step_fn(fused, prefill)}
    return {
        "params": model.num_parameters(),
        "max_rel_diff": rel,
        "ops": {"unfused": ops_per_forward(model, ids), "fused": ops_per_forward(fused, ids)},
        "time_fused_over_unfused": {
            "prefill": time_ratios(
                {"unfused": forward_fn(model, ids), "fused": forward_fn(fused, ids)},
                "unfused",
                repeats=repeats,
            )["fused"],
            "decode": time_ratios(steps, "unfused", repeats=repeats * 4, warmup=3)["fused"],
        },
        "prefill_tokens": prefill,
    }


# ------------------------------------------------------------------------- printing


def print_calibration(r: dict[str, Any]) -> None:
    """The tables of `calibration`: thresholds, quality per method, the Q/DQ graphs."""
    print(
        f"\n(a) INT8 calibration on {r['calibration_tokens']} training tokens; "
        f"scored on {r['eval_tokens']} held-out tokens"
    )
    print(f"{'down_proj input of':<28} {'max':>8} {'p99.99':>8} {'entropy':>8}")
    for name, t in r["thresholds"].items():
        layer = name.split(".")[2]
        print(
            f"{'layer ' + layer:<28} {t['max']:>8.2f} {t['percentile']:>8.2f} {t['entropy']:>8.2f}"
        )
    print(f"\n{'model':<22} {'perplexity':>10} {'vs fp32':>8} {'agreement':>10}")
    base = r["quality"]["fp32"]["perplexity"]
    for name, q in r["quality"].items():
        print(
            f"{name:<22} {q['perplexity']:>10.3f} {q['perplexity'] / base - 1:>+8.1%} "
            f"{q['agreement']:>10.1%}"
        )
    print("\n(d) explicit Q/DQ graphs on ONNX Runtime (CPU)")
    print(f"{'graph':<22} {'perplexity':>10} {'vs fp32':>8} {'agreement':>10} {'vs ours':>8}")
    for name, q in r["explicit_qdq"].items():
        ours = q.get("agreement_with_fake_quant")
        print(
            f"{name:<22} {q['perplexity']:>10.3f} {q['perplexity'] / base - 1:>+8.1%} "
            f"{q['agreement']:>10.1%} {'' if ours is None else f'{ours:.1%}':>8}"
        )


def print_fusion(r: dict[str, Any]) -> None:
    """The report of `fusion`: equality, ops per forward, time ratios."""
    print("\n(b) layer fusion (fold RMSNorm weights, fuse QKV, fuse gate/up)")
    print(
        f"  logits max |diff| {r['max_abs_diff']:.2g} (max |logit| {r['max_abs_logit']:.1f}); "
        f"same greedy tokens ({r['new_tokens']}): {r['same_greedy_tokens']}"
    )
    print(f"  {'aten ops per forward':<22} {'all':>10} {'compute':>10} {'GEMMs':>10}")
    for k, o in r["ops"].items():
        print(f"  {k:<22} {o['ops']:>10} {o['compute_ops']:>10} {o['gemms']:>10}")
    s = r["time_fused_over_unfused"]
    print(
        f"  time fused / unfused: prefill {r['prefill_tokens']} tokens {s['prefill']:.2f}x, "
        f"decode step {s['decode']:.2f}x"
    )


def print_width(r: dict[str, Any]) -> None:
    """The report of `fusion_at_width`."""
    s, o = r["time_fused_over_unfused"], r["ops"]
    print(f"\n(c) the same fusion on a SmolLM2-135M-shaped model, random weights ({r['params']:,})")
    print(
        f"  logits max |diff| / max |logit| {r['max_rel_diff']:.1g}; compute ops "
        f"{o['unfused']['compute_ops']} -> {o['fused']['compute_ops']}, GEMMs "
        f"{o['unfused']['gemms']} -> {o['fused']['gemms']}"
    )
    print(
        f"  time fused / unfused: prefill {r['prefill_tokens']} tokens {s['prefill']:.2f}x, "
        f"decode step {s['decode']:.2f}x"
    )
