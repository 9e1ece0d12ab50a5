"""Chapter 09's benchmark harness: one workload and vLLM's serving metrics over every
backend on the machine (`python -m minillm bench`; the details are in `harness`)."""

from minillm.bench.backends import ALL, IN_PROCESS, OPT_IN, SERVERS, Backend, Unavailable
from minillm.bench.command import add_arguments, main, run_from_args
from minillm.bench.harness import make_backend, parse_backends, run_bench
from minillm.bench.metrics import PeakMemory, Trace, compute_metrics, percentiles
from minillm.bench.openai_http import run_async
from minillm.bench.report import format_table, label_of, plot_results
from minillm.bench.workload import SEED, WORKLOADS, Request, load_workload, make_workload

__all__ = [
    "ALL",
    "IN_PROCESS",
    "OPT_IN",
    "SEED",
    "SERVERS",
    "WORKLOADS",
    "Backend",
    "PeakMemory",
    "Request",
    "Trace",
    "Unavailable",
    "compute_metrics",
    "format_table",
    "add_arguments",
    "label_of",
    "main",
    "load_workload",
    "make_backend",
    "make_workload",
    "parse_backends",
    "percentiles",
    "plot_results",
    "run_async",
    "run_bench",
    "run_from_args",
]
