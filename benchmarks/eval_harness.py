"""Chapter 08: a real evaluation harness against the server. EleutherAI's lm-eval runs its
`local-completions` model (an OpenAI-compatible completions client) against `minillm serve`
on two small local tasks (`benchmarks/eval_tasks/`, King James Bible verses for the bundled
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
        --include_path benchmarks/eval_tasks \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=minillm-bundled,max_length=256

tests/test_lm_eval.py checks that the loglikelihoods lm-eval reports equal minillm's own
log-probabilities of the same continuations, and its generations minillm's own greedy text.
The last line is `SUMMARY eval-harness:`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
TASKS = ("minillm_kjv_mc", "minillm_kjv_gen")
LM_EVAL_VERSION = "0.4.13"


def task_configs(names: tuple[str, ...] = TASKS) -> list[dict[str, Any]]:
    """The tasks' YAML as lm-eval task dicts, with absolute data paths (so they run from
    any working directory)."""
    import yaml

    configs = []
    for name in names:
        config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        files["test"] = str(TASKS_DIR / Path(files["test"]).name)
        configs.append(config)
    return configs


def run_eval(
    base_url: str,
    model: str = "minillm-bundled",
    tasks: tuple[str, ...] = TASKS,
    limit: int | None = None,
    max_length: int = 256,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` with `local-completions` against the server at
    `base_url` (e.g. http://127.0.0.1:8000): its results dict, per-sample logs included
    (`results["samples"][task]`: each request's arguments and responses)."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ImportError(
            f'the evaluation harness needs lm-eval=={LM_EVAL_VERSION}: pip install -e ".[eval]"'
        ) from None
    model_args = {
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "model": model,
        "max_length": max_length,  # the model's context: lm-eval truncates prompts to fit
        "max_retries": 1,
    }
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=task_configs(tasks),
        limit=limit,
        log_samples=True,
        task_manager=TaskManager(include_defaults=False),  # ours only: no index of 10k files
    )


def summary(results: dict[str, Any]) -> dict[str, float]:
    """{"task metric": value} for every metric lm-eval reported."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if key.endswith(",none") and not key.endswith("_stderr,none"):
                out[f"{task} {key.removesuffix(',none')}"] = value
    return out


def _start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--max-num-seqs", "8"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default="minillm-bundled", help="the served model name")
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    args = parser.parse_args(argv)
    proc = None
    base_url = args.base_url
    if base_url is None:
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, base_url = _start_server(port), f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(base_url + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.3)
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
    print(
        f"SUMMARY eval-harness: lm-eval {LM_EVAL_VERSION} local-completions: {line} ({took:.0f} s)"
    )


if __name__ == "__main__":
    main()
