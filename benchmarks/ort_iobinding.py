"""Chapter 03 benchmark: ONNX Runtime decoding as production runs it. The plain loop
(`OrtDecoder`: past ++ new concatenated every step, numpy in and out) against IOBinding on
a static cache written in place (`OrtStaticDecoder`), and ORT GenAI's own generator where
onnxruntime-genai is installed.

    python -m benchmarks.ort_iobinding [--model bundled-1k] [--context 512 [2048 ...]]
                                       [--steps 16] [--quick] [--no-profile] [--threads N]
                                       [--json out.json]

(a) speed: `--steps` decode steps after a `--context`-token prompt, batch 1, the same
    work in every timed call (each variant restarts from the same prefilled cache), all
    variants A/B interleaved; ratios to the plain loop (> 1: faster), minillm's own
    PyTorch decode (`KVCache`) among them. IOBinding five times:
    with the exporter's grouped-query attention (K/V repeated per query head, a copy of
    the cache per step), with `grouped_sdpa` (no copy), with opset 23's
    RMSNormalization, RotaryEmbedding and Attention nodes (`onnx_llm_ops`: half the
    nodes: 843 instead of 1791 for SmolLM2), with ORT's GroupQueryAttention node
    (`export_gqa_step(fuse=False)`: RoPE, the cache write and attention in one node a
    layer, as ORT GenAI's graph has them), and with GenAI's two other fusions on that
    graph (`fuse_gqa_graph`: q, k, v packed into one product, residual Add and RMSNorm
    as one node). `--model`:
    'bundled-1k' (the bundled model's shapes with a 1024-token context, random weights:
    the bundled model itself stops at 256 positions), a shape name of
    `minillm.model.shapes` (SmolLM2-135M: export takes minutes and several GB), or a
    model `load_model` takes ('smollm2': the real SmolLM2-135M-Instruct, offline).
    Each `--context` in turn, on the same exports.
(b) why: ORT's profiler on the plain loop and on IOBinding (grouped, GroupQueryAttention
    traced and fused), each step split into weights / cache copies / attention / other
    kernels / outside the kernels (`minillm.export.ort_profile`). The plain loop's cache
    copies, a fraction f of its kernel time, are what a loop with an in-place cache
    removes: removing them alone gains at most 1 / (1 - f) (Amdahl); with c the share of
    copies and attention together, no loop that keeps the other kernels beats
    1 / (1 - c). Both next to the measured ratios.
(c) correctness and quality on the bundled model (trained weights): greedy tokens of the
    plain loop, IOBinding (grouped, GroupQueryAttention traced and fused), minillm (and
    ORT GenAI fp32 / int4), held-out perplexity.
One SUMMARY line.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm.bench.ort_iobinding import (
    GENAI,
    GQA,
    GQA_FUSED,
    MINILLM,
    STATIC,
    STATIC_OPS,
    STATIC_REPEAT,
    export_graphs,
    measure_context,
    print_split,
    quality,
    speed_model,
)
from minillm.export.ort_genai import genai_missing


def summary(result: dict[str, Any]) -> str:
    """Per context, each variant's speed-up over the plain loop (and the profile's bounds);
    whether the fp32 runtimes' greedy tokens equal minillm's; GenAI int4's perplexity."""
    parts = []
    for context, at in result["by_context"].items():
        s = at["speedup"]
        part = (
            f"decode@{context} IOBinding {s[STATIC]:.2f}x (K/V repeated {s[STATIC_REPEAT]:.2f}x,"
            f" opset-23 ops {s[STATIC_OPS]:.2f}x, GroupQueryAttention {s[GQA]:.2f}x,"
            f" with GenAI's fusions {s[GQA_FUSED]:.2f}x)"
        )
        if GENAI in s:
            part += f", GenAI {s[GENAI]:.2f}x"
        part += f", minillm {s[MINILLM]:.2f}x"
        if "bound" in at:
            part += f", bounds {at['bound']:.2f}x / {at['cache_bound']:.2f}x (copies / cache)"
        parts.append(part + ";")
    exact = all(same for name, same in result["tokens_equal"].items() if "int4" not in name)
    parts.append(f"fp32 runtimes' greedy tokens equal minillm's: {exact}")
    if f"{GENAI} int4" in result["ppl"]:
        delta = result["ppl"][f"{GENAI} int4"] / result["ppl"]["minillm"] - 1
        parts[-1] += f"; GenAI int4 ppl {100 * delta:+.2f}%"
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer timing rounds")
    ap.add_argument("--model", default="bundled-1k", help="bundled-1k, a shape or a model")
    ap.add_argument("--context", type=int, nargs="+", default=[512], help="one or more")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler's split")
    args = ap.parse_args(argv)
    run = report.start(f"ort_iobinding {args.model} (x the plain ORT loop)", args)
    import onnxruntime

    genai = genai_missing() or "installed"
    contexts = ", ".join(map(str, args.context))
    print(f"onnxruntime {onnxruntime.__version__}, model {args.model}, ", end="")
    print(f"{args.steps} decode steps after {contexts} tokens; GenAI: {genai}")
    result: dict[str, Any] = {"model": args.model, "context": args.context[0], "by_context": {}}
    model = speed_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        graphs = export_graphs(model, Path(tmp))
        for context in args.context:
            at = measure_context(
                model,
                graphs,
                Path(tmp),
                context,
                args.steps,
                args.threads,
                repeats=5 if args.quick else 15,
                profile=not args.no_profile,
            )
            print(f"\n(a) decode after {context} tokens, speed-up over the plain ORT loop:")
            for name, x in at["speedup"].items():
                print(f"    {name:<32}{x:>7.2f}x")
            if "split_ms" in at:
                print_split(context, at)
            result["by_context"][str(context)] = at
        result["speedup"] = result["by_context"][str(args.context[0])]["speedup"]
        result |= quality(Path(tmp))
    print("\n(c) bundled model: greedy tokens equal to minillm's:", result["tokens_equal"])
    print("    held-out perplexity:", {k: round(v, 4) for k, v in result["ppl"].items()})
    return run.finish(result, summary(result))


if __name__ == "__main__":
    main()
