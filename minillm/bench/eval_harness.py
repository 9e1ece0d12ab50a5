"""Chapter 08's evaluation harness against the server: EleutherAI's lm-eval with its
`local-completions` model (an OpenAI-compatible completions client) on the two local tasks
in `minillm/bench/eval_tasks/` (`run_eval`), and the metrics it reported (`summary`).
`python -m benchmarks.eval_harness` starts a server and runs them; tests/test_lm_eval.py
checks the results against minillm's own log-probabilities and greedy text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"  # package data
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
