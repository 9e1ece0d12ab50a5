"""The engine's decode steps eager vs on their fast path (chapter 08): padded to a fixed batch
and run from a recording (a CUDA graph on a GPU, `decode_mode="compile"` on a CPU), timed A/B
on the same requests. `python -m benchmarks.engine_decode` runs it.
"""

from __future__ import annotations

import time
from typing import Any

from minillm.engine import Engine
from minillm.generation import greedy_params
from minillm.lab import time_ratios

PROMPT_LEN = 16


def engine_decode_modes(
    model: Any, tokenizer: Any, rows: int = 8, tokens: int = 48
) -> dict[str, Any]:
    """The engine's decode steps eager vs compiled (`decode_mode="compile"`: the step padded
    to a fixed batch and compiled once, as a CUDA graph records it on a GPU): `rows`
    requests of equal length, so every decode step has the same batch. The first run of
    each engine (which compiles) is not timed; then runs alternate, A/B. Same tokens."""
    prompts = [[(7 * r + 3 * i) % 4000 + 10 for i in range(PROMPT_LEN)] for r in range(rows)]
    params = greedy_params(tokens, output_kind="final_only")
    modes = ("eager", "compile")
    engines = {m: Engine(model, tokenizer, max_num_seqs=rows, decode_mode=m) for m in modes}

    def run(engine: Engine) -> list[list[int]]:
        for p in prompts:
            engine.add_request(p, params)
        return [o.outputs[0].token_ids for o in engine.run_to_completion()]

    t0 = time.perf_counter()
    tokens_out = {m: run(e) for m, e in engines.items()}  # warm-up: the compile happens here
    warm_s = time.perf_counter() - t0
    fns = {m: (lambda e=e: run(e)) for m, e in engines.items()}
    ratio = time_ratios(fns, baseline="compile", repeats=5, warmup=1)
    return {
        "rows": rows,
        "tokens": tokens,
        "eager_vs_compiled": ratio["eager"],
        "warmup_s": warm_s,
        "same_tokens": tokens_out["eager"] == tokens_out["compile"],
    }
