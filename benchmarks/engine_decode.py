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

from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench.engine_decode import engine_decode_modes


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
