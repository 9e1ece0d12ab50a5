"""Streaming cost per token stays flat with the output's length (chapter 08).

    python -m benchmarks.streaming [--quick] [--json out.json]

One request streams N tokens (greedy, EOS ignored, output_kind "delta", a stop string that
never matches, so the stop search runs every step) through the engine on a model with a
long context (the bundled model's shapes, random weights, 8192 positions; the forward is not
what is measured). The engine times each step's parts; the cost per token of what happens
after the forward (append, incremental detokenization, stop search, delta output) is
compared at 256 and 4096 output tokens. For contrast: decoding the whole output again for
every token (what a naive streamer does) timed at the same lengths.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks import report
from minillm.engine import Engine, SamplingParams
from minillm.model import ModelConfig, load_tokenizer, random_model

SEED = 0


def long_context_model():
    cfg = ModelConfig(max_position_embeddings=8192, eos_token_id=None)
    return random_model(cfg, seed=SEED)


def stream_cost(model, tokenizer, n: int) -> dict[str, float]:
    """Seconds per output token spent after the forward, for one streamed request."""
    engine = Engine(model, tokenizer, max_num_seqs=1, num_blocks=-(-(n + 16) // 16))
    params = SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, output_kind="delta", stop=["@@never@@"]
    )
    received = []
    engine.add_request([1, 2, 3, 4], params, on_output=lambda out: received.append(out))
    engine.run_to_completion()
    text = "".join(o.outputs[0].text for o in received)
    ids = [t for o in received for t in o.outputs[0].token_ids]
    assert len(ids) == n and text == tokenizer.decode(ids), "the deltas do not add up"
    return {
        "tokens": n,
        "postprocess_s_per_token": engine.time_in["postprocess"] / n,
        "run_s_per_token": engine.time_in["run"] / n,
        "streamed_chars": len(text),
    }


def naive_decode_cost(tokenizer, ids: list[int], at: int, repeats: int = 20) -> float:
    """Seconds to decode the first `at` ids again (what a naive streamer does per token)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokenizer.decode(ids[:at])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="1024 instead of 4096 tokens")
    args = ap.parse_args(argv)
    run = report.start("streaming", args)
    tok, model = load_tokenizer(), long_context_model()
    lengths = (256, 1024 if args.quick else 4096)
    rows = [stream_cost(model, tok, n) for n in lengths]
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(10, tok.vocab_size, (lengths[1],), generator=g).tolist()
    naive = {n: naive_decode_cost(tok, ids, n) for n in lengths}
    flat = rows[1]["postprocess_s_per_token"] / rows[0]["postprocess_s_per_token"]
    for r in rows:
        print(
            f"{r['tokens']:>5} tokens: {1e6 * r['postprocess_s_per_token']:7.1f} us/token after "
            f"the forward (forward: {1e3 * r['run_s_per_token']:.2f} ms/token)"
        )
    summary = (
        f"per-token cost at {lengths[1]} tokens = {flat:.2f}x that at {lengths[0]} (goal "
        f"0.8-1.2); re-decoding the whole output instead would cost "
        f"{naive[lengths[1]] / naive[lengths[0]]:.1f}x more per token at {lengths[1]}"
    )
    out = {"rows": rows, "naive_decode_s": naive, "ratio_long_vs_short": flat}
    return run.finish(out, summary)


if __name__ == "__main__":
    main()
