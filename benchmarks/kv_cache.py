"""Chapter 02 benchmark: what the KV cache buys, measured on this machine.

    python -m benchmarks.kv_cache [--model smollm2] [--quick] [--threads N] [--json out.json]
                                  [--roofline [--runs N]] [--llama-cpp]

`--model` (default `smollm2`: SmolLM2-135M-Instruct, offline; `bundled` for the course's
1.3M model; or any checkpoint `load_model` takes) is the model of every part. Four parts,
each printed as a table; the last line is one `SUMMARY kv-cache:` line.

(a) Cost of one generation step at context length n, without a cache (a forward over
    all n tokens, what `generate_naive` does) and with one (one token at position n-1
    against n cached K/V), A/B interleaved; then end-to-end time of generating up to N
    total tokens both ways (same tokens asserted), measured directly (at 256 and 1024
    tokens; at 1024 on SmolLM2 the naive loop alone takes most of an hour on one thread)
    and predicted for 2048 by summing fitted per-step costs. The bundled model has only
    256 positions: for it, part (a) uses its shapes with 2048 positions and random weights
    (speed depends on shapes, not on what the weights learned).
(b) KV bytes = 2 x layers x kv_heads x head_dim x bytes x tokens, checked against a real
    `KVCache` allocation, and what grouped-query attention saves for SmolLM2-135M and
    Llama-3-8B shapes (pure arithmetic).
(c) minillm `generate` (as loaded, and with the decode weight layout of
    `minillm.model.layout`) vs transformers `generate(use_cache=True)` and `use_cache=False`
    on the model: same greedy tokens asserted, time ratios interleaved.
(d) Roofline: batch-1 cached decode of the model, bytes read per token x tokens/s vs the
    read bandwidth measured in the same run (`measure_roofline`: a sum over 512 MiB), as
    loaded, with the decode layout, and (on a CPU) compiled with frozen weights and
    max-autotune (`compile_decode_step(freeze=True)`: inductor's own GEMM kernels); where
    the eager step's time goes (`profile_split`), and the bandwidth of the matrix-vector
    products alone. `--llama-cpp` adds llama.cpp's batch-1 decode of the same weights (an
    f32 GGUF in llama-server), the peer. `--roofline` runs this part alone.

Every speed figure is a ratio of calls timed in alternation in the same run, or a
fraction of a ceiling measured in the same run: absolute times on a shared machine
are noise. The measurements are `minillm.bench.kv_cache` (with `minillm.bench.kv_costs`
and `minillm.bench.roofline`), which the chapter 02 notebook calls with smaller sizes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from minillm.bench import kv_cache as bench
from minillm.bench import llama_cpp
from minillm.export.gguf import export_gguf
from minillm.model import Transformer, load_model
from minillm.model.weights import resolve_device, resolve_dtype, resolve_model_dir


def model_name(name: str | None) -> str | None:
    """The `load_model` argument for a --model value: "bundled" (or None) is the bundled model."""
    return None if name in (None, "bundled") else name


def llama_cpp_peer(
    model: Transformer, name: str | None, roof: dict[str, Any], context: int, rounds: int
) -> dict[str, Any]:
    """llama.cpp decoding `model`'s checkpoint `name` (written as an f32 GGUF) at batch 1,
    with this process's thread count: `context` tokens after a prompt of context/2, on
    average the roofline step's context. Best of `rounds`, like the variants."""
    with tempfile.TemporaryDirectory() as tmp:
        gguf = export_gguf(resolve_model_dir(name), Path(tmp) / "model-f32.gguf")
        prompt = bench.random_ids(model, context // 2)[0].tolist()
        speeds = llama_cpp.decode_tokens_per_s(
            gguf, prompt, context, rounds, threads=torch.get_num_threads()
        )
    best = max(speeds)
    return {
        "name": "llama.cpp f32 (llama-server, 1 slot)",
        "tokens_per_s": best,
        "rounds": speeds,
        "fraction_of_bound": best / roof["bound_tokens_per_s"],
        "minillm_vs_peer": roof["tokens_per_s"] / best,
    }


def roofline_summary(r: dict[str, Any]) -> str:
    """The SUMMARY text of part (d): each variant's fraction of the bound, and the peer's."""
    v = r["variants"]
    text = (
        "decode at "
        + ", ".join(f"{v[k]['fraction_of_bound']:.0%} ({k})" for k in v)
        + f" of the read-bandwidth bound ({r['bound_tokens_per_s']:.1f} tok/s)"
    )
    if "peer" in r:
        p = r["peer"]
        text += (
            f"; {p['name']} {p['fraction_of_bound']:.0%}: minillm ({r['best']}) at "
            f"{p['minillm_vs_peer']:.2f}x its speed"
        )
    return text


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="smaller sizes (a few minutes)")
    ap.add_argument(
        "--model", default="smollm2", help="smollm2 (default), bundled, or a checkpoint"
    )
    ap.add_argument(
        "--e2e",
        default=None,
        help="total lengths for the end-to-end measurement, e.g. 256,1024 (default: 256,1024; "
        "--quick: 256). 1024 on SmolLM2 takes most of an hour (the naive loop)",
    )
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="auto (GPU: bf16, T4: fp16; CPU: fp32), ...")
    ap.add_argument(
        "--roofline",
        action="store_true",
        help="only part (d), with the compiled step on a CPU (a few minutes on SmolLM2)",
    )
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="(d) also times llama.cpp's batch-1 decode of the same weights as an f32 GGUF "
        "(needs llama-server: python -m benchmarks.llama_server)",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="with --roofline: repeat part (d) this many times, each with its own bound and "
        "llama.cpp rounds (a shared machine's speed changes between runs: report the range); "
        "the step compiles once, in the first run",
    )
    args = ap.parse_args(argv)
    if args.runs < 1 or (args.runs > 1 and not args.roofline):
        ap.error("--runs takes a count of 1 or more, and more than 1 only with --roofline")
    run = report.start(f"kv-cache ({args.model})", args)
    # Inductor caches compiled code and max-autotune's kernel choices on disk: a rerun
    # would reuse choices timed on another run's machine state, and its compile time
    # would be a cache lookup.
    torch.compiler.config.force_disable_caches = True
    name = model_name(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"model {args.model}, {str(dtype).removeprefix('torch.')} on {device.type}")
    if args.quick:
        lengths, e2e_lengths, predict_at, new_tokens, ctx = [64, 256, 512], [256], [1024], 64, 32
    else:
        lengths, e2e_lengths = [64, 128, 256, 512, 1024, 2048], [256, 1024]
        predict_at, new_tokens, ctx = [1024, 2048], 200, 64
    if args.e2e:
        e2e_lengths = [int(n) for n in args.e2e.split(",")]
    longest = max(*lengths, *predict_at, *e2e_lengths)
    model = load_model(name, dtype=dtype, device=device)
    if model.config.max_position_embeddings < longest:  # the bundled model: 256 positions
        model_a = bench.long_context_model(longest).to(device=device, dtype=dtype)
        label_a = f"{args.model} shapes, random weights, {longest} positions"
    else:
        model_a, label_a = model, args.model
    print(f"(a) and the roofline on: {label_a}")

    cpu = device.type == "cpu"
    runs = []
    for _ in range(args.runs):
        roof = bench.decode_roofline(
            model, context=ctx, repeats=5 if args.quick else 10, compiled=cpu
        )
        if args.llama_cpp:
            roof["peer"] = llama_cpp_peer(model, name, roof, ctx, rounds=3 if args.quick else 5)
        bench.print_roofline(roof, args.model)
        runs.append(roof)
    if args.roofline:
        summary = "; ".join(f"run {i + 1}: {roofline_summary(r)}" for i, r in enumerate(runs))
        return run.finish({"model": args.model, "roofline": roof, "runs": runs}, summary)

    hf = bench.compare_hf(
        name, new_tokens, repeats=3 if args.quick else 5, device=device, dtype=dtype
    )
    bench.print_hf(hf)

    costs = bench.step_costs(model_a, lengths, repeats=3 if args.quick else 5)
    bench.print_steps(costs)
    e2e = []
    for n in e2e_lengths:  # one pair each for the real model: the naive loop is the hour
        e2e.append(bench.end_to_end(model_a, n, repeats=2 if model_a is not model else 1))
        bench.print_e2e(e2e[-1:], {})
    predicted = {
        n: bench.predicted_totals(costs, 16, n) for n in sorted({*e2e_lengths, *predict_at})
    }
    bench.print_e2e(e2e, predicted)

    tokens = 8192
    gqa, alloc = bench.gqa_table(tokens), bench.kv_allocation_check()
    bench.print_gqa(gqa, alloc, tokens)

    results = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "model_a": label_a,
        "step_costs": costs,
        "end_to_end": e2e,
        "predicted": predicted,
        "gqa": gqa,
        "kv_allocation": alloc,
        "hf": hf,
        "roofline": roof,
    }
    measured = e2e[-1]
    pred = predicted[predict_at[-1]]
    ratios = hf["time_ratio"]
    summary = (
        f"speedup {measured['speedup']:.1f}x at "
        f"{measured['total']} tokens (measured), {pred['speedup']:.1f}x at {predict_at[-1]} "
        f"(predicted); step at {lengths[-1]}: {costs['ratio'][-1]:.1f}x; HF use_cache=True "
        f"takes {ratios['HF use_cache=True']:.2f}x minillm's time"
    )
    if "HF use_cache=False" in ratios:
        summary += f", use_cache=False {ratios['HF use_cache=False']:.2f}x"
    if "minillm, decode layout" in ratios:
        summary += f", minillm with the decode layout {ratios['minillm, decode layout']:.2f}x"
    summary += (
        f"; GQA saves {gqa[0]['saving']:.0f}x (SmolLM2-135M), {gqa[1]['saving']:.0f}x "
        f"(Llama-3-8B); {roofline_summary(roof)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    return run.finish(results, summary)


if __name__ == "__main__":
    main()
