"""The engine's decode steps on their fast path (chapter 08): padded to a fixed batch and
run from a recording, vs plain eager steps.

    python -m benchmarks.engine_decode [--rows 8] [--tokens 48] [--model NAME] [--json out.json]

On a GPU the recording is a CUDA graph (the engine's default there; `make gpu-check`
measures it). On a CPU there are no CUDA graphs; the closest is `decode_mode="compile"`:
the padded step compiled once by torch.compile (inductor, C++), which removes Python and
dispatch overhead per op but not the memory traffic of the weights. So it pays on a small
model, whose step is mostly overhead, and less on a larger one.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import report
from minillm import SamplingParams, load_model, load_tokenizer
from minillm.engine import Engine
from minillm.lab import time_ratios

PROMPT_LEN = 16


def engine_decode_modes(model, tokenizer, rows: int = 8, tokens: int = 48) -> dict[str, Any]:
    """The engine's decode steps eager vs compiled (`decode_mode="compile"`: the step padded
    to a fixed batch and compiled once, as a CUDA graph records it on a GPU): `rows`
    requests of equal length, so every decode step has the same batch. The first run of
    each engine (which compiles) is not timed; then runs alternate, A/B. Same tokens."""
    prompts = [[(7 * r + 3 * i) % 4000 + 10 for i in range(PROMPT_LEN)] for r in range(rows)]
    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="final_only"
    )
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--rows", type=int, default=8, help="requests decoding together")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="checkpoint or name (default: bundled)")
    args = ap.parse_args(argv)
    run = report.start("engine-decode", args)
    result = engine_decode_modes(
        load_model(args.model), load_tokenizer(args.model), args.rows, args.tokens
    )
    summary = (
        f"eager decode steps take {result['eager_vs_compiled']:.2f}x the time of compiled ones "
        f"({args.rows} rows, {args.model or 'bundled'} model); warm-up with compile "
        f"{result['warmup_s']:.0f} s; same tokens: {result['same_tokens']}"
    )
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
