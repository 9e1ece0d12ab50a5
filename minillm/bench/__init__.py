"""One benchmark harness over every inference stack: the same workload, the same metrics.

    python -m minillm bench --backends all --workload small --json out.json

A *workload* is a list of requests (prompt token ids, output length), greedy, EOS ignored:
named (`tiny`, `small`, `serving`), a seeded length distribution given as JSON
(`{"n": 32, "seed": 1, "prompt_len": [8, 64], "output_median": 32}`), or fixed prompts
(`{"prompts": ["In the beginning"], "max_tokens": 16}`), inline or in a .json file.

A *backend* runs requests and reports when each token arrived. In-process: `hf`
(transformers eager `generate`), `hf-compile` (static cache + torch.compile; slow to compile on a
CPU, so `all` lists it as opt-in), `ort` (chapter 03's `OrtDecoder`), `tensorrt` (NVIDIA
only), `minillm` (the chapter 08 engine). Over HTTP: `openai:URL` streams
`/v1/completions` from any OpenAI-compatible server (minillm serve, vLLM, SGLang, llama.cpp
server; `openai-text:URL` sends the prompts as text) and `openai-chat:URL` streams
`/v1/chat/completions` with text prompts (TGI's
OpenAI route). `vllm`, `sglang`, `tgi` and `llama.cpp` by name are listed with how to start
them. A backend that cannot run is a row with its reason, never a missing row.

Metrics are vLLM `bench serve`'s: TTFT = first token - send; TPOT = (E2E - TTFT) / (n - 1)
for n > 1 output tokens; ITL = gaps between streamed chunks; E2E = last token - send;
percentiles by linear interpolation (numpy's); request and output-token throughput =
count / wall time of the run. `concurrency` caps requests in flight (backends that serve
one request at a time run with 1, which the row records). `rounds` repeats the workload
round-robin over the loaded backends, so load on a shared machine hits all of them alike.

Files: `workload.py` (requests), `metrics.py` (the definitions above, peak memory),
`backends.py` (in-process backends, `make_backend`), `openai_http.py` (servers); this file
runs them and reports (table, JSON, plot).
"""

from __future__ import annotations

import gc
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minillm.bench.backends import (
    ALL,
    IN_PROCESS,
    OPT_IN,
    SERVERS,
    Backend,
    Unavailable,
    make_backend,
    parse_backends,
)
from minillm.bench.metrics import PeakMemory, Trace, compute_metrics, percentiles
from minillm.bench.openai_http import run_async
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
    "label_of",
    "load_workload",
    "make_backend",
    "make_workload",
    "parse_backends",
    "percentiles",
    "plot_results",
    "run_async",
    "run_bench",
]


def reference_tokens(requests: list[Request], model_path: str | None) -> list[list[int]]:
    """minillm's greedy tokens for each request (one at a time), to compare backends with."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams
    from minillm.weights import load_model

    model = load_model(model_path)
    return [
        generate(
            model,
            [r.prompt_ids],
            SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True),
        )[0]
        for r in requests
    ]


def run_bench(
    backends: list[str] | str,
    workload: str | dict = "small",
    concurrency: int | list[int] = 1,
    model_path: str | None = None,
    device: str | None = None,
    threads: int = 1,
    warmup: int = 1,
    progress: bool = True,
    skip: list[str] | tuple[str, ...] = (),
    isolate: bool = False,
    rounds: int = 1,
) -> dict[str, Any]:
    """Run `workload` on each backend; a dict with the machine, the workload and rows
    (status ok / skipped / failed, its reason, metrics, memory, same tokens as minillm).
    Batching backends get one row per `concurrency` level, the others one row at 1.
    All backends are loaded first, then the workload runs `rounds` times, round-robin over
    backends (interleaved: a load spike on a shared machine hits all of them); metrics pool
    the rounds. `skip` lists backends to list as skipped without running them; `isolate`
    runs each in-process backend in a fresh Python process (its peak RSS is its own)."""
    from minillm.weights import load_tokenizer

    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency={concurrency}: use 1 or more requests in flight")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: run the workload at least once")
    names = backends.split(",") if isinstance(backends, str) else list(backends)
    specs = parse_backends(",".join(names))
    explicit = {n.strip() for n in names} - {"all"}  # opt-in backends run only when named
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_path)
    desc, requests = load_workload(workload, tokenizer)
    ref = reference_tokens(requests, model_path)
    ref_text = [tokenizer.decode(r) for r in ref]
    slots: list[list[dict[str, Any]] | _Loaded] = []  # rows, or a backend loaded to run
    for spec in specs:
        row: dict[str, Any] = {"backend": spec, "status": "skipped", "reason": None}
        if spec in skip:
            slots.append([{**row, "reason": "skipped on request (--skip)"}])
        elif spec in OPT_IN and spec not in explicit:
            slots.append([{**row, "reason": OPT_IN[spec]}])
        elif isolate and spec in IN_PROCESS:
            opts = dict(concurrency=",".join(map(str, levels)), threads=threads, warmup=warmup)
            opts["rounds"] = rounds
            slots.append(_run_isolated(spec, desc, model_path, device, progress, **opts))
        else:
            slots.append(_load(spec, requests[:warmup], levels, model_path, device, threads))
    loaded = [s for s in slots if isinstance(s, _Loaded)]
    for r in range(rounds):
        for item in loaded:
            if item.error is None:
                item.run(requests, r, rounds, progress)
    rows: list[dict[str, Any]] = []
    for item in slots:
        if not isinstance(item, _Loaded):
            rows += item
            continue
        for out in item.rows():
            if out["status"] == "ok":
                same = [
                    t.text == x if item.spec.startswith("openai") else t.tokens == y
                    for t, x, y in zip(out.pop("traces"), ref_text, ref, strict=True)
                ]
                out["same_as_minillm"] = sum(same) / len(same)
            rows.append(out)
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "threads": threads,
        },
        "workload": {
            **desc,
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
        },
        "concurrency": levels,
        "rounds": rounds,
        "results": rows,
    }


class _Loaded:
    """A backend loaded (and warmed up) under a memory watch, with its timed runs so far."""

    def __init__(self, spec: str, backend: Backend | None, error: dict | None) -> None:
        self.spec, self.backend, self.error = spec, backend, error
        self.load_s, self.mem = 0.0, None
        self.levels: list[int] = []
        self.traces: dict[int, list[list[Trace]]] = {}  # level -> one trace list per round
        self.durations: dict[int, list[float]] = {}

    def run(self, requests: list[Request], r: int, rounds: int, progress: bool) -> None:
        from tqdm.auto import tqdm

        try:
            for level in self.levels:
                label = f"{self.spec} x{level}" + (f" round {r + 1}/{rounds}" if rounds > 1 else "")
                with tqdm(total=len(requests), desc=label, disable=not progress) as bar:
                    t0 = time.perf_counter()
                    traces = self.backend.run_all(requests, level, bar)
                    self.durations.setdefault(level, []).append(time.perf_counter() - t0)
                self.traces.setdefault(level, []).append(traces)
        except Exception as err:  # a backend that breaks mid-run is a row that says how
            self.error = _failed(self.spec, err)
        if r == rounds - 1 or self.error is not None:
            self.backend = None  # free it
            gc.collect()

    def rows(self) -> list[dict[str, Any]]:
        if self.error is not None:
            return [self.error]
        remote = self.spec.startswith("openai")  # the server is another process
        out = []
        for level in self.levels:
            per_round = self.traces[level]
            pooled = [t for traces in per_round for t in traces]
            row = {"backend": self.spec, "status": "ok", "reason": None, "concurrency": level}
            row.update(compute_metrics(pooled, sum(self.durations[level])), load_s=self.load_s)
            n_out = sum(t.num_tokens for t in per_round[0])
            row["output_tok_s_rounds"] = [n_out / d for d in self.durations[level]]
            row["requests"] = len(per_round[0])  # per round
            row["output_tokens"] = n_out
            row["peak_rss_bytes"] = None if remote else self.mem.peak_rss
            row["rss_increase_bytes"] = None if remote else self.mem.peak_rss - self.mem.start_rss
            if self.mem.peak_cuda is not None and not remote:
                row["peak_cuda_bytes"] = self.mem.peak_cuda
            row["traces"] = per_round[-1]
            out.append(row)
        return out


def _failed(spec: str, err: Exception) -> dict[str, Any]:
    return {"backend": spec, "status": "failed", "reason": f"{type(err).__name__}: {err}"}


def _load(
    spec: str,
    warm: list[Request],
    levels: list[int],
    model_path: str | None,
    device: str,
    threads: int,
) -> _Loaded:
    """Make and load one backend and run the warm-up, measuring memory while it does."""
    try:
        backend = make_backend(spec, model_path, device, threads)
        item = _Loaded(spec, backend, None)
        item.levels = levels if backend.concurrent else [1]
        with PeakMemory() as item.mem:
            t0 = time.perf_counter()
            backend.load()
            item.load_s = time.perf_counter() - t0
            for level in item.levels:
                backend.run_all(warm, level, _NoBar())
        return item
    except Unavailable as err:
        skipped = {"backend": spec, "status": "skipped", "reason": str(err)}
        return _Loaded(spec, None, skipped)
    except Exception as err:  # a backend that breaks is a row that says how
        return _Loaded(spec, None, _failed(spec, err))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


def _run_isolated(
    spec: str, desc: dict, model_path: str | None, device: str, progress: bool, **opts: Any
) -> list[dict[str, Any]]:
    """One backend's rows, measured by `python -m minillm.bench` in a child process."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "minillm.bench", "--backends", spec, "--device", device]
        cmd += ["--workload", json.dumps(desc), "--json", str(out)]
        cmd += [f"--{k}={v}" for k, v in opts.items()] + ["--model"] * bool(model_path)
        cmd += [model_path] if model_path else []
        cmd += [] if progress else ["--no-progress"]
        err = None if progress else subprocess.PIPE  # progress bars pass through
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
            reason = f"child process exited {proc.returncode} {tail}"
            return [{"backend": spec, "status": "failed", "reason": reason}]
        return json.loads(out.read_text())["results"]


def format_table(result: dict[str, Any]) -> str:
    """One line per backend: throughputs, p50/p99 latencies (ms), memory (peak RSS of the
    process, and what loading + warming up this backend added to it), same tokens."""
    from minillm.measure import format_bytes

    width = max([24] + [len(label_of(r)) for r in result["results"]])
    head = (
        f"{'backend':{width}s} {'status':7s} {'conc':>4s} {'req/s':>6s} {'tok/s':>7s} "
        f"{'TTFT p50/p99':>13s} "
        f"{'TPOT p50/p99':>13s} {'ITL p50/p99':>13s} {'E2E p50/p99':>15s} {'peak RSS':>9s} "
        f"{'RSS +':>9s} {'same':>5s}"
    )
    lines = [head]
    for r in result["results"]:
        if r["status"] != "ok":
            lines.append(f"{label_of(r):{width}s} {r['status']:7s} {r['reason']}")
            continue
        pair = lambda k, r=r: f"{r[k]['p50']:.1f}/{r[k]['p99']:.1f}"  # noqa: E731
        rss = format_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "n/a"
        added = format_bytes(r["rss_increase_bytes"]) if r["peak_rss_bytes"] else "n/a"
        lines.append(
            f"{label_of(r):{width}s} {'ok':7s} {r['concurrency']:4d} {r['req_s']:6.2f} "
            f"{r['output_tok_s']:7.1f} "
            f"{pair('ttft_ms'):>13s} {pair('tpot_ms'):>13s} {pair('itl_ms'):>13s} "
            f"{pair('e2e_ms'):>15s} {rss:>9s} {added:>9s} {r['same_as_minillm']:5.0%}"
        )
    return "\n".join(lines)


def label_of(row: dict[str, Any]) -> str:
    """A row's name: the backend, with its concurrency when above 1 (`minillm x8`)."""
    level = row.get("concurrency", 1)
    return row["backend"] if level == 1 else f"{row['backend']} x{level}"


def plot_results(
    result: dict[str, Any], metric: str = "tpot_ms", stat: str = "p50", ax: Any = None
) -> Any:
    """Bar chart of one metric over the backends that ran (e.g. tpot_ms p50, output_tok_s)."""
    from minillm.plots import bar_chart

    ok = [r for r in result["results"] if r["status"] == "ok"]
    if not ok:
        raise ValueError("no backend ran: nothing to plot")
    short = lambda r: label_of(r).replace("http://", "").replace("/v1", "")  # noqa: E731
    data = {short(r): r[metric][stat] if isinstance(r[metric], dict) else r[metric] for r in ok}
    label = f"{metric} ({stat})" if isinstance(ok[0][metric], dict) else metric
    ax = bar_chart(data, ylabel=label, title=f"{result['workload'].get('name', 'workload')}", ax=ax)
    ax.tick_params(axis="x", labelrotation=30)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    return ax


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m minillm.bench` (the same options as `python -m minillm bench`)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m minillm.bench", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: Any) -> None:
    """The bench command's options (shared by `python -m minillm bench`)."""
    parser.add_argument(
        "--backends",
        default="all",
        help=f"comma-separated: {', '.join(ALL)}, openai:URL, openai-text:URL, "
        "openai-chat:URL, all",
    )
    parser.add_argument(
        "--workload", default="small", help=f"{', '.join(WORKLOADS)}, a JSON object or a .json file"
    )
    parser.add_argument(
        "--concurrency", default="1", help="requests in flight, e.g. 1,8 (batching backends)"
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: the bundled model)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=1, help="torch / ORT intra-op threads")
    parser.add_argument("--warmup", type=int, default=1, help="requests run before timing")
    parser.add_argument(
        "--rounds", type=int, default=1, help="timed runs per backend, interleaved across them"
    )
    parser.add_argument("--skip", default="", help="comma-separated backends to list, not run")
    parser.add_argument(
        "--isolate", action="store_true", help="each in-process backend in its own process"
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--no-progress", action="store_true")


def run_from_args(args: Any) -> dict[str, Any]:
    """Run, print the table (and a SUMMARY line), write --json."""
    result = run_bench(
        args.backends,
        args.workload,
        concurrency=[int(c) for c in str(args.concurrency).split(",")],
        model_path=args.model,
        device=args.device,
        threads=args.threads,
        warmup=args.warmup,
        progress=not args.no_progress,
        skip=[s.strip() for s in args.skip.split(",") if s.strip()],
        isolate=args.isolate,
        rounds=args.rounds,
    )
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    ok = [r for r in result["results"] if r["status"] == "ok"]
    print(
        f"SUMMARY bench: {len(ok)}/{len(result['results'])} backends ran; "
        + ", ".join(
            f"{label_of(r)} TPOT p50 {r['tpot_ms']['p50']:.1f} ms, {r['output_tok_s']:.0f} tok/s"
            for r in ok
        )
    )
    return result
