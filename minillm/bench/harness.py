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
`backends.py` (in-process backends), `openai_http.py` (servers); this file picks the
backends (`make_backend`), runs them and reports (table, JSON, plot).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minillm.bench.backends import (
    ALL,
    IN_PROCESS,
    OPENAI_PREFIXES,
    OPT_IN,
    SERVERS,
    Backend,
    EngineBackend,
    HFBackend,
    OrtBackend,
    TensorRTBackend,
    Unavailable,
)
from minillm.bench.metrics import PeakMemory, Trace, compute_metrics
from minillm.bench.openai_http import OpenAIBackend
from minillm.bench.workload import Request, load_workload
from minillm.lab.machine import machine_info


def make_backend(spec: str, model_path: str | None, device: str, threads: int) -> Backend:
    """The backend for `spec`; raises Unavailable (why, what to do) or ValueError (unknown)."""
    kinds = {"hf": HFBackend, "hf-compile": HFBackend, "ort": OrtBackend}
    kinds.update({"tensorrt": TensorRTBackend, "minillm": EngineBackend})
    if spec in kinds:
        return kinds[spec](spec, model_path, device, threads)
    if spec.startswith(OPENAI_PREFIXES):
        return OpenAIBackend(spec, model_path, device, threads)
    if spec in SERVERS:
        raise Unavailable(f"a server: start it ({SERVERS[spec]})")
    raise ValueError(
        f"unknown backend {spec!r}: use {', '.join(ALL)}, openai:URL, openai-text:URL or "
        "openai-chat:URL"
    )


def parse_backends(text: str) -> list[str]:
    """Comma-separated backend names; `all` expands to every known one."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("no backends given: e.g. --backends hf,ort,minillm or all")
    out: list[str] = []
    for name in names:
        if name != "all" and name not in ALL and not name.startswith(OPENAI_PREFIXES):
            raise ValueError(
                f"unknown backend {name!r}: use {', '.join(ALL)}, openai:URL, openai-text:URL "
                "or openai-chat:URL"
            )
        out += [b for b in (ALL if name == "all" else [name]) if b not in out]
    return out


def reference_tokens(requests: list[Request], model_path: str | None) -> list[list[int]]:
    """minillm's greedy tokens for each request (one at a time), to compare backends with."""
    from minillm.generation.cached import generate
    from minillm.generation.sampling import SamplingParams
    from minillm.model.weights import load_model

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
    from minillm.model.weights import load_tokenizer

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
        "machine": machine_info(threads)
        | {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"},
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
