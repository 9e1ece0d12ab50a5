"""What the course measures, as the package's top layer (it imports every other one):

- each chapter's measurements, one module per topic, which the notebooks import and the
  scripts in the repository's benchmarks/ run at full size (`python -m benchmarks.NAME`):
  `kv_cache` (02), `onnx_runtime` and `ort_iobinding` (03), `calibration` and `tensorrt`
  (04), `compile` (05), `quant`, `quant_decode`, `quant_methods` and `kv_quant` (06),
  `paged` and `kernels` (07), `batching`, `http_load`, `llama_cpp` and `eval_harness` (08),
  `speculative` (10);
- chapter 09's harness: one workload and vLLM's serving metrics over every backend on the
  machine (`python -m minillm bench`; the details are in `harness`), re-exported here.

The chapter modules are imported by name (`from minillm.bench import kv_cache`), so that
importing the harness does not import ONNX Runtime, lm-eval or llama.cpp."""

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
