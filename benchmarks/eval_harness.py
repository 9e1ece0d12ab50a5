"""Chapter 08: a real evaluation harness against the server. EleutherAI's lm-eval runs its
`local-completions` model (an OpenAI-compatible completions client) against `minillm serve`
on two small local tasks (`minillm/bench/eval_tasks/`, King James Bible verses for the bundled
model): a multiple-choice task scored by loglikelihood (`echo` with `logprobs`, the prompt
scored, nothing generated) and a `generate_until` task (greedy, until a newline). Requests
are lm-eval's defaults: token ids, tokenized by the server's own tokenizer (lm-eval finds
/tokenizer_info and /tokenize and uses them).

    pip install -e ".[eval]"    # lm-eval==0.4.13: about a minute, ~40 packages (datasets,
                                # pandas, pyarrow, scikit-learn, ...); torch is not touched
    python -m benchmarks.eval_harness                 # starts a server, runs both tasks
    python -m benchmarks.eval_harness --base-url http://127.0.0.1:8000   # a running one

or lm-eval's own command line, from the repository root, with `python -m minillm serve`
running:

    lm_eval --model local-completions --tasks minillm_kjv_mc,minillm_kjv_gen \\
        --include_path minillm/bench/eval_tasks \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=minillm-bundled,max_length=256

tests/test_lm_eval.py checks that the loglikelihoods lm-eval reports equal minillm's own
log-probabilities of the same continuations, and its generations minillm's own greedy text.
The last line is `SUMMARY eval-harness:`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks import report
from minillm.bench.eval_harness import LM_EVAL_VERSION, run_eval, summary
from minillm.bench.http_load import free_port, wait_until_up


def start_server(port: int) -> subprocess.Popen:
    """`python -m minillm serve` (bundled model, 8 slots) on `port`; returns once it answers."""
    cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return wait_until_up(proc, f"http://127.0.0.1:{port}/health", "minillm serve")
    except RuntimeError as err:
        raise SystemExit(f"the server did not start: {err}") from None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default="minillm-bundled", help="the served model name")
    ap.add_argument("--limit", type=int, default=None, help="documents per task")
    args = ap.parse_args(argv)
    run = report.start("eval-harness", args)
    proc, base_url = None, args.base_url
    if base_url is None:
        port = free_port()
        proc, base_url = start_server(port), f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        results = run_eval(base_url, args.model, limit=args.limit)
        took = time.perf_counter() - start
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    scores = summary(results)
    for name, value in scores.items():
        print(f"{name:32s} {value:.4f}")
    line = ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
    out = {"lm_eval": LM_EVAL_VERSION, "scores": scores, "eval_s": took}
    return run.finish(out, f"lm-eval {LM_EVAL_VERSION} local-completions: {line} ({took:.0f} s)")


if __name__ == "__main__":
    main()
