"""Where an ONNX Runtime decode step's time goes (chapter 03), from ORT's own profiler
(`SessionOptions.enable_profiling`): every kernel's duration, its op type, its input and
output shapes and whether it reads weights.

`step_split` sorts a step's kernels into four kinds:

- weights: kernels that read a weight initializer (the linear layers, the embedding);
  their time does not depend on the context;
- cache copies: kernels other than a MatMul that write a tensor as large as one layer's K
  at that context: the plain loop's past ++ new Concat, the exporter's K/V repeat
  for grouped-query attention (Expand, Reshape), K's Transpose. They move the
  cache without doing attention's arithmetic, which is what a loop with a cache written in
  place and attention per kv head (`minillm.export.onnx_static`) removes;
- attention: the rest of the kernels with a sequence-long axis (Q.K and P.V MatMuls,
  softmax, the mask), and the fused attention nodes (ORT's GroupQueryAttention: RoPE, the
  in-place cache write and attention in one kernel): work every loop does over the cache;
- other: small per-token kernels (norms, RoPE, activations, shapes) and views
  (Reshape, Unsqueeze: ORT reuses their input's buffer).

If the cache copies are a fraction f of the plain loop's kernel time, a loop that drops
them and changes nothing else decodes at most 1 / (1 - f) times faster (Amdahl,
`amdahl_bound`). A loop without them usually also reads less in attention (no repeated
K/V): with c the share of copies and attention together, no loop that keeps the other
kernels as they are beats 1 / (1 - c), however it holds the cache; beating that takes
other kernels (ORT GenAI's fused norms) or less time outside them.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

KINDS = ("weights", "cache copies", "attention", "other")
WEIGHT_BYTES = 64 * 1024  # an initializer at least this large is a weight, not a constant
MATMULS = ("MatMul", "FusedMatMul", "Gemm")
# Shape-only ops: ORT's allocation planner lets them reuse their input's buffer (a
# Reshape of a cache-sized tensor runs in microseconds, measured), so they copy nothing.
VIEWS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity")
# One kernel for attention over the cache: it reads initializers (GroupQueryAttention's
# cos/sin tables) and lists the whole present buffer as an output, written in place.
ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention")


def profiled_session(path: str | Path, threads: int = 1, prefix: str | Path = "ort_profile") -> Any:
    """A CPU session at optimisation level 'all' that records every kernel (ORT's profiler:
    `session.end_profiling()` writes the trace file `prefix`_<time>.json)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    opts.log_severity_level = 3
    opts.enable_profiling = True
    opts.profile_file_prefix = str(prefix)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _numel(shape: dict[str, list[int]]) -> tuple[int, int]:
    """(elements, bytes per element) of one `input_type_shape` entry {dtype: dims}."""
    ((dtype, dims),) = shape.items()
    n = 1
    for d in dims:
        n *= int(d)
    return n, 8 if dtype in ("int64", "double") else 2 if dtype == "float16" else 4


def kernel_kind(event: dict[str, Any], layer_cache_bytes: int, slots: range) -> str:
    """One of `KINDS` for a profiler node event. `layer_cache_bytes`: one layer's K at the
    shortest context timed; `slots`: the lengths the sequence axis takes in those steps.

    ORT prepacks constant MatMul weights: the profiler then lists only the activation as
    the kernel's input, so a MatMul with one listed input is a weight MatMul. The profile
    names no axes, so a sequence axis is told by its length: profile at contexts where no
    model dimension (hidden, intermediate, vocabulary, head sizes) falls in `slots`."""
    args, op = event["args"], event["args"]["op_name"]
    inputs, outputs = args.get("input_type_shape", []), args.get("output_type_shape", [])
    if op in ATTENTION_OPS:
        return "attention"
    prepacked = op in MATMULS and len(inputs) == 1
    if prepacked or int(args.get("parameter_size", 0)) >= WEIGHT_BYTES:
        return "weights"
    if op in VIEWS:
        return "other"
    if not any(int(d) in slots for s in [*inputs, *outputs] for dims in s.values() for d in dims):
        return "other"
    written = max((n * size for n, size in map(_numel, outputs)), default=0)
    if written >= layer_cache_bytes and op not in MATMULS:
        return "cache copies"
    return "attention"


@dataclass(frozen=True)
class StepSplit:
    """Milliseconds per decode step, the median over the profiled steps: kernels by kind
    (`KINDS`) and, within each kind, by op type; `step_ms`, the step's time measured
    without the profiler; `outside`, what of it no kernel accounts for (ORT's executor,
    the Python binding; 0 when the profiled kernels add up to more).

    The profiler's own bookkeeping sits between kernels (a profiled step runs longer than
    an unprofiled one) more than inside them; on a tiny model, where a step is mostly
    kernels of a few microseconds, it inflates them too and the split is not reliable."""

    kinds: dict[str, float]
    by_op: dict[str, dict[str, float]]
    step_ms: float
    outside: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outside", max(self.step_ms - sum(self.kinds.values()), 0.0))

    @property
    def copy_fraction(self) -> float:
        """The cache copies' share of the step's kernel time. What runs outside the kernels
        is left out: measured as a difference of two timings, it is mostly noise on a
        loaded machine (0 to 4 ms per step on SmolLM2 at 512 tokens, the same run)."""
        return self.kinds["cache copies"] / sum(self.kinds.values())

    @property
    def cache_fraction(self) -> float:
        """The share of the kernel time that reads or writes the cache (copies and
        attention): a loop that keeps the other kernels as they are, however it holds the
        cache, gains at most 1 / (1 - this)."""
        return (self.kinds["cache copies"] + self.kinds["attention"]) / sum(self.kinds.values())


def amdahl_bound(fraction: float) -> float:
    """The most a change that removes `fraction` of the time (and nothing else) can gain."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction={fraction}: a share of the time, in [0, 1)")
    return 1 / (1 - fraction)


def step_split(
    session: Any, steps: int, layer_cache_bytes: int, slots: range, step_ms: float | None = None
) -> StepSplit:
    """End `session`'s profiling and split each of its last `steps` runs (the decode steps;
    earlier runs, such as the prefill and warm-up, are left out) by kind and op type; the
    median run of each. `step_ms`: the step time measured without the profiler (default:
    the median profiled run, which the profiler's own bookkeeping inflates)."""
    path = Path(session.end_profiling())
    try:
        events = json.loads(path.read_text())
    finally:
        os.remove(path)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(runs) < steps:
        raise ValueError(f"the profile holds {len(runs)} runs: run the {steps} steps first")
    runs = runs[-steps:]
    starts = [r["ts"] for r in runs]
    kinds = [Counter(dict.fromkeys(KINDS, 0.0)) for _ in runs]
    ops: list[Counter[tuple[str, str]]] = [Counter() for _ in runs]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > runs[i]["ts"] + runs[i]["dur"]:
            continue
        kind = kernel_kind(e, layer_cache_bytes, slots)
        kinds[i][kind] += e["dur"] / 1e3
        ops[i][kind, e["args"]["op_name"]] += e["dur"] / 1e3
    keys = sorted({key for run in ops for key in run}, key=lambda key: -sum(r[key] for r in ops))
    by_op: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    for kind, op in keys:
        by_op[kind][op] = median(r[kind, op] for r in ops)
    if step_ms is None:
        step_ms = median(r["dur"] / 1e3 for r in runs)
    return StepSplit(
        {kind: median(k[kind] for k in kinds) for kind in KINDS},
        by_op,
        step_ms,
    )
