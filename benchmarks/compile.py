"""torch.compile (inductor, default mode) vs eager for the fixed-shape decode step.

    python -m benchmarks.compile [--model smollm2|bundled] [--threads N] [--tokens 32]
                                 [--repeats N] [--batches 1,8] [--warm-cache] [--json out.json]

Models (`--model`): `smollm2` (the default: SmolLM2-135M-Instruct, 30 layers, 513 MiB of
fp32 weights) and `bundled` (the course's 4-layer, d128 model). On the bundled model one
decode step is ~100 small ops, each a few microseconds of arithmetic, so its time is
mostly per-op overhead (Python, dispatch, allocation): the regime where a compiler that
fuses ops and drops the Python layer pays off on a CPU. SmolLM2's step is dominated by
reading its weights: memory traffic that no fusion removes, so compiling gains far less,
and its cold compile takes minutes on one CPU thread (it scales with the layers traced).
The script measures the split (profile_split) so the ratio can be read against it.

Per batch size (1 and 8): compile time (wall time of the first compiled call, cold
inductor cache unless --warm-cache), then the step's speed ratio eager/compiled, timed
A/B interleaved (`minillm.lab.timing.time_ratios`), then end to end: `generate` (chapter 02,
kv_len shrinking) vs `generate_static` eager and compiled, same prompts and max_tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from minillm import SamplingParams, generate, load_model
from minillm.generation import generate_static
from minillm.generation.cached import prefill
from minillm.generation.static import CompileCounter, compile_decode_step, decode_step
from minillm.lab import profile_split, time_ratios

PROMPT_LEN = 16


def bench_batch(model, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    prompts = [[(7 * b + 3 * i) % 4000 + 10 for i in range(PROMPT_LEN)] for b in range(batch)]
    torch._dynamo.reset()
    counter = CompileCounter("inductor")
    compiled = compile_decode_step("default", backend=counter)
    with torch.inference_mode():
        cache, logits, pos = prefill(model, prompts, tokens)
        cache.kv_len = cache.max_len  # the static step's fixed shapes
        tok, at = logits.argmax(-1)[:, None], pos[:, None]
        t0 = time.perf_counter()
        compiled(model, cache, tok, at)
        compile_s = time.perf_counter() - t0
        # The same step (same slot, same inputs) over and over: a fixed amount of work.
        step = {
            "eager": lambda: decode_step(model, cache, tok, at),
            "compiled": lambda: compiled(model, cache, tok, at),
        }
        step_ratio = time_ratios(step, baseline="compiled", repeats=repeats, warmup=3)["eager"]
        split = profile_split(step["eager"], repeats=10)
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        e2e = {
            "generate": lambda: generate(model, prompts, params),
            "static_eager": lambda: generate_static(model, prompts, params, compiled=False),
            "static_compiled": lambda: generate_static(model, prompts, params, compiled=compiled),
        }
        same = e2e["static_compiled"]() == e2e["generate"]()
        e2e_ratio = time_ratios(e2e, baseline="static_compiled", repeats=max(repeats // 20, 5))
    print(
        f"batch {batch}: compile {compile_s:.1f} s ({counter.graphs} graph), "
        f"step eager/compiled {step_ratio:.2f}x; eager step {split.wall_s * 1e3:.2f} ms, "
        f"{split.kernel_fraction:.0%} in compute kernels, {split.ops:.0f} aten ops"
    )
    print(
        f"batch {batch}: {tokens} tokens end to end, time / compiled static: "
        f"generate {e2e_ratio['generate']:.2f}x, static eager {e2e_ratio['static_eager']:.2f}x"
        f"; compiled tokens == generate: {same}"
    )
    assert counter.graphs == 1, "the static step recompiled"
    return {
        "compile_s": compile_s,
        "graphs": counter.graphs,
        "step": step_ratio,
        "e2e": e2e_ratio["generate"],
        "e2e_static_eager": e2e_ratio["static_eager"],
        "kernel": split.kernel_fraction,
        "split": split.fractions(),
        "eager_step_ms": split.wall_s * 1e3,
        "ops": split.ops,
        "same": same,
    }


def step_modes(
    model, prompts: list[list[int]], tokens: int, modes: dict[str, dict], repeats: int = 30
) -> dict[str, dict[str, float]]:
    """The fixed-shape decode step compiled with each of `modes` (name -> compile_decode_step
    keyword arguments, e.g. {"reduce-overhead": {"mode": "reduce-overhead"}}) against
    eager: per mode, compile + warm-up seconds and eager step time / compiled step time
    (A/B interleaved). On a GPU, "reduce-overhead" is inductor + CUDA graphs (notebook 05's
    GPU cell and `make gpu-check` call this)."""
    out = {}
    with torch.inference_mode():
        cache, logits, pos = prefill(model, prompts, tokens)
        cache.kv_len = cache.max_len  # the static step's fixed shapes
        args = (model, cache, logits.argmax(-1)[:, None], pos[:, None])
        for name, kwargs in modes.items():
            torch._dynamo.reset()
            step = compile_decode_step(**kwargs)
            t0 = time.perf_counter()
            for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
                step(*args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            ratios = time_ratios(
                {"eager": lambda: decode_step(*args), name: lambda s=step: s(*args)},
                baseline=name,
                repeats=repeats,
                warmup=2,
            )
            out[name] = {"compile_s": warm_s, "eager_vs_compiled": ratios["eager"]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), bundled, a checkpoint")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per generation")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per step pair")
    ap.add_argument("--batches", default="1,8", help="batch sizes, e.g. 1,8")
    ap.add_argument("--warm-cache", action="store_true", help="let inductor reuse its disk cache")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    # Inductor keeps compiled kernels on disk; without this a rerun's "compile time"
    # would be a cache lookup.
    torch.compiler.config.force_disable_caches = not args.warm_cache
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(None if args.model == "bundled" else args.model).eval()
    small = model.num_parameters() < 10**7
    repeats = args.repeats or (200 if small else 30)  # a SmolLM2 step is ~100x longer
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.model} "
        f"{model.num_parameters() / 1e6:.1f}M params, prompt {PROMPT_LEN}, {args.tokens} tokens"
    )
    r = {b: bench_batch(model, b, args.tokens, repeats) for b in batches}
    result = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "batches": r}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    b0, parts = batches[0], []
    for b in batches:
        parts.append(
            f"batch {b}: step eager/compiled {r[b]['step']:.2f}x, generate/compiled end to end "
            f"{r[b]['e2e']:.2f}x, compile {r[b]['compile_s']:.0f} s"
        )
    print(
        f"SUMMARY compile ({args.model}): "
        + "; ".join(parts)
        + f"; eager step {r[b0]['kernel']:.0%} compute at batch {b0}; {args.threads} thread(s); "
        f"tokens equal: {all(x['same'] for x in r.values())}"
    )
    return result


if __name__ == "__main__":
    main()
