"""The GPU half of the course, checked in one prepared run: `make gpu-check`.

    PYTHONPATH=. python3 -m benchmarks.gpu_check [--out DIR] [--cpu]

Runs with the GPU machine's own Python and installs nothing (numpy, torch, triton and
transformers are all it needs; a part that needs a missing package reports "skipped: needs
X"). Each part is isolated: one that fails is reported with its error and the rest still
run. Writes `gpu-<device>.json` and `.md` (default folder: benchmarks/results/).

Parts, most important first (a global deadline skips what is left, saying so):
  env          versions, the device, how Triton kernels run (must be compiled, not interpreted)
  kernels      paged decode (+ split-K, block sizes), flash prefill, INT4 vs cuBLAS bf16:
               error and speed, bandwidth as a fraction of the copy bandwidth measured here
  fp8          torch._scaled_mm in e4m3 = dequantize-then-matmul; on FP8 tensor cores (8.9+)
               its speed vs the bf16 matmul and its error vs fp32
  cuda_graphs  the static decode step compiled with mode="reduce-overhead" (inductor + CUDA
               graphs) vs eager: same tokens, speed-up at batch 1 and 8
  engine       the continuous-batching engine on the GPU (Triton decode kernel): same greedy
               tokens as `generate` in the same dtype, output tok/s at 1, 32, 128 in flight
  hf           minillm vs transformers' `generate`: same tokens, speed ratio
  notebooks    the notebooks' GPU-only code paths that run without missing packages

`--cpu` is the tiny mode CI runs so that this script cannot rot: Triton's interpreter,
small shapes, the eager backend instead of inductor; its numbers mean nothing, its
checks (same tokens, kernel errors) still hold.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_parts
from benchmarks.gpu_report import GOALS, markdown

RESULTS = Path(__file__).parent / "results"


class Run:
    """What every part gets: the device, the dtype it times in, the mode, the deadline."""

    def __init__(self, cpu: bool, budget_s: float) -> None:
        self.cpu = cpu or not torch.cuda.is_available()
        self.device = torch.device("cpu" if self.cpu else "cuda")
        self.dtype = torch.float32 if self.cpu else torch.bfloat16
        self.deadline = time.perf_counter() + budget_s

    @property
    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()


def env(run: Run) -> dict[str, Any]:
    import transformers
    import triton

    from minillm.kernels import triton_status

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if not run.cpu else platform.machine(),
        "triton_mode": triton_status()[1],
    }
    if not run.cpu:
        props = torch.cuda.get_device_properties(0)
        out |= {"sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30}
    want = "interpreter" if run.cpu else "cuda"
    out["checks"] = [
        {"name": f"Triton kernels run {want}", "passed": out["triton_mode"] == want},
    ]
    return out


def _commit() -> str:
    """The checked-out commit, when git and the repository's .git are there (the GPU machine
    gets the working tree without .git: `make gpu-check COMMIT=...` passes it instead)."""
    import os
    import subprocess

    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


PARTS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "env": env,
    "kernels": gpu_parts.kernels,
    "fp8": gpu_parts.fp8,
    "cuda_graphs": gpu_parts.cuda_graphs,
    "engine": gpu_parts.engine,
    "hf": gpu_parts.hf_generate,
    "notebooks": gpu_parts.notebooks,
}


def run_all(cpu: bool = False, budget_s: float = 330.0, only: list[str] | None = None) -> dict:
    """Every part (or `only` these), each isolated; the report as a dict."""
    run = Run(cpu, budget_s)
    report: dict[str, Any] = {"mode": "cpu" if run.cpu else "gpu", "commit": _commit(), "parts": {}}
    t_start = time.perf_counter()
    for name, part in PARTS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        if run.seconds_left <= 0:
            result = {"status": "skipped", "reason": f"time budget of {budget_s:.0f} s spent"}
        else:
            try:
                result = {"status": "ok", **part(run)}
            except gpu_parts.Missing as err:
                result = {"status": "skipped", "reason": str(err)}
            except Exception as err:  # report it and go on: the other parts still run
                tb = traceback.format_exception(err)
                result = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
                result["traceback"] = "".join(tb)[-3000:]
        result["seconds"] = time.perf_counter() - t0
        report["parts"][name] = result
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}: {result['status']}", flush=True)
        if not run.cpu:
            torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - t_start
    report["goals"] = [goal(report) for goal in GOALS]
    checks = [c for p in report["parts"].values() for c in p.get("checks", [])]
    report["checks_passed"] = sum(c["passed"] for c in checks)
    report["checks_total"] = len(checks)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny mode on the CPU (what CI runs)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the reports")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds before parts are skipped")
    ap.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    report = run_all(args.cpu, args.budget, [p for p in args.only.split(",") if p])
    slug = "cpu" if report["mode"] == "cpu" else gpu_parts.device_slug()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu-{slug}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / f"gpu-{slug}.md").write_text(markdown(report))
    failed = [n for n, p in report["parts"].items() if p["status"] == "failed"]
    print(
        f"SUMMARY gpu-check ({report['mode']}): {report['checks_passed']}/"
        f"{report['checks_total']} checks passed; parts failed: {failed or 'none'}; "
        f"goals met: {sum(g['met'] is True for g in report['goals'])}/{len(report['goals'])}; "
        f"{report['seconds']:.0f} s; report in {args.out}/gpu-{slug}.md"
    )
    return report


if __name__ == "__main__":
    main()
