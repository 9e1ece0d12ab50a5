"""Streaming cost per token stays flat with the output's length (chapter 08).

    python -m benchmarks.streaming [--quick] [--json out.json]

One request streams N tokens (greedy, EOS ignored, output_kind "delta", a stop string that
never matches, so the stop search runs every step) through the engine on a model with a
long context (the bundled model's shapes, random weights, 8192 positions). The engine times
each step's parts; the cost per token of what happens after the forward (append,
incremental detokenization, stop search, delta output) is compared at 256 and 4096 output
tokens, twice: with the real forward between steps, and with the same token ids replayed
by a scripted runner, so that only the streaming machinery runs (the long context's
attention evicts the CPU caches the Python after it reads, which slows every line alike).
For contrast: decoding the whole output again for every token (what a naive streamer does)
timed at the same lengths.
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm.bench.streaming import long_context_model, naive_decode_cost, stream_cost
from minillm.model import load_tokenizer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="1024 instead of 4096 tokens")
    args = ap.parse_args(argv)
    run = report.start("streaming", args)
    tok, model = load_tokenizer(), long_context_model()
    lengths = (256, 1024 if args.quick else 4096)
    rows = [stream_cost(model, tok, n) for n in lengths]
    ids = rows[1].pop("ids")
    rows[0].pop("ids")
    alone = [stream_cost(model, tok, n, replay=ids[:n]) for n in lengths]  # no forward
    for r in alone:
        r.pop("ids")
    naive = {n: naive_decode_cost(tok, ids, n) for n in lengths}
    key = "postprocess_s_median_last_256"
    flat = alone[1][key] / alone[0][key]
    with_forward = rows[1][key] / rows[0][key]
    for label, table in (("with the forward", rows), ("streaming alone (replayed ids)", alone)):
        print(label)
        for r in table:
            print(
                f"  {r['tokens']:>5} tokens: {1e6 * r[key]:7.1f} us/token after the forward "
                f"(median of the last 256; mean {1e6 * r['postprocess_s_per_token']:.1f})"
            )
    summary = (
        f"streaming's cost per token (median of the last 256, replayed ids) at {lengths[1]} "
        f"tokens = {flat:.2f}x that at {lengths[0]} (goal 0.8-1.2; {with_forward:.2f}x with "
        f"the real forward between steps); re-decoding the whole output instead would cost "
        f"{naive[lengths[1]] / naive[lengths[0]]:.1f}x more per token at {lengths[1]}"
    )
    out = {
        "rows": rows,
        "alone": alone,
        "naive_decode_s": naive,
        "ratio_long_vs_short": flat,
        "ratio_with_forward": with_forward,
    }
    return run.finish(out, summary)


if __name__ == "__main__":
    main()
