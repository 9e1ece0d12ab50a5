"""Chapter 05 benchmark: torch.compile (inductor) vs eager for the fixed-shape decode step
(the command line is `python -m benchmarks.compile`).

`bench_batch`: at one batch size, the cold compile time, the step's speed ratio
eager/compiled (A/B interleaved, `minillm.lab.timing.time_ratios`), where the eager step's
time goes (`profile_split`), and end to end `generate` (chapter 02, kv_len shrinking) vs
`generate_static` eager and compiled. `step_modes`: the step compiled in several modes
(on a GPU, "reduce-overhead" adds CUDA graphs) against eager.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from minillm.generation import generate, generate_static, greedy_params
from minillm.generation.cached import prefill
from minillm.generation.static import CompileCounter, compile_decode_step, decode_step
from minillm.lab import profile_split, time_ratios
from minillm.model import Transformer

PROMPT_LEN = 16  # the prompts of `bench_batch`, tokens each


def bench_batch(model: Transformer, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    """At `batch` prompts of PROMPT_LEN tokens generating `tokens` each: compile seconds
    (cold unless inductor's disk cache is on), eager/compiled step ratio, the eager step's
    profile split and the end-to-end ratios; prints two lines, asserts one graph."""
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
        params = greedy_params(tokens)
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
    model: Transformer,
    prompts: list[list[int]],
    tokens: int,
    modes: dict[str, dict],
    repeats: int = 30,
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
