"""Chapter 08 benchmark: `minillm serve` vs llama.cpp, same client, same requests, same model.

    python -m benchmarks.llama_cpp --server llama-server [--concurrency 1 8 32] [--quick]
    python -m benchmarks.llama_cpp [--server llama-cpp-python] [--quick]
        [--model DIR] [--gguf FILE] [--requests N] [--repeats R] [--threads 1] [--json out.json]

`--json`: the results and a "meta" entry (command, load average, date, summary line).

Two llama.cpp servers can stand in for llama.cpp, both OpenAI-compatible like `minillm serve`:

* `--server llama-server`: llama.cpp's own C++ server, built from the sources vendored in
  llama-cpp-python's sdist by `python -m benchmarks.llama_server` (opt-in, ~12 min on 2
  cores). `--parallel N` gives it N slots that it batches every step (continuous batching),
  as minillm's engine does; this is the peer for throughput.
* `--server llama-cpp-python` (the default): `python -m llama_cpp.server` from
  `pip install "llama-cpp-python[server]==0.3.36"`. It runs ONE request at a time (a lock,
  no parallel slots), and by default cancels the running stream when another request
  arrives (`interrupt_requests`); we turn that off so requests queue.

Both load the checkpoint minillm serves (`--model`, default the bundled one) written as
GGUF by `minillm.export.gguf` (f32 weights) and, by default, an f32 KV cache: the arithmetic
minillm does (llama.cpp's own default is an f16 KV cache: `--kv-cache f16`). The workload
and the streaming client are `python -m benchmarks.serving`'s
(`minillm.bench.workload.make_workload`, `minillm.bench.http_load.poisson_run`,
`minillm.bench.metrics.percentiles`): the same requests to both servers, greedy (llama.cpp: also
`repeat_penalty` 1.0, llama-cpp-python's server defaults to 1.1), EOS suppressed so every
request runs to its length (`ignore_eos`; llama-cpp-python ignores that field, so it gets a
logit bias of -1e4 on EOS). llama-server is sent token ids, llama-cpp-python text (it takes
no ids; the bundled tokenizer round-trips, see tests/test_llama_cpp.py).

llama-server mode, per concurrency C (default 1, 8, 32): both servers start fresh, minillm
with `max_num_seqs` C and llama-server with `--parallel C`, each with one compute thread,
the same KV capacity (256 tokens a slot) and no prompt caching (the rounds repeat the same
prompts). (a) the first 8 prompts sent at once, not streamed, greedy with EOS allowed: the
texts should be equal. (b) the workload as a closed loop with C requests in flight (a new one
as soon as one ends), the two servers back to back, the order alternating, `--repeats`
rounds; medians. Output tokens/s, TTFT and TPOT p50/p99 as vLLM's `bench serve` defines
them, and the ratio minillm / llama-server. The client opens a new connection per request
(for both): llama-server closes the connection after each streamed response although it
announces keep-alive, and a request sent on it meanwhile fails. (c) with `--profile`: where
one minillm decode step's time goes at batch C (`minillm.bench.engine_profile.profile`, in
process).

llama-cpp-python mode: both servers up; for each load (all requests at once, then Poisson
arrivals at a quarter of the slower server's capacity) the same back-to-back rounds.

The last line is `SUMMARY llama-server:` or `SUMMARY llama-cpp:`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm import load_tokenizer
from minillm.bench import engine_profile, llama_server
from minillm.bench.http_load import ms
from minillm.bench.llama_cpp import (
    CTX_PER_SLOT,
    median_of,
    round_ratios,
    run_llama_cpp_python,
    run_llama_server,
)
from minillm.bench.workload import make_workload
from minillm.export.gguf import export_gguf

HEADER = "  load         | system       | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms"


def row(label: str, name: str, runs: list[dict]) -> str:
    """One table row: output tok/s, TTFT and TPOT p50/p99 (ms), medians over rounds."""
    return f"  {label:12s} | {name:12s} | {median_of(runs, 'output_tok_s'):9.0f} | " + " | ".join(
        f"{ms(median_of(runs, k, 'p50'))}/{ms(median_of(runs, k, 'p99'))}" for k in ("ttft", "tpot")
    )


def report_llama_server(threads: int, results: dict[str, Any], n: int, model: str) -> str:
    """Print part (b) of llama-server mode; the summary text."""
    print("\n(b) closed loop, C requests in flight (medians of rounds)")
    print(HEADER)
    ratios = {}
    for c, res in results.items():
        for name in ("minillm", "llama-server"):
            print(row(f"C={c}", name, res[name]))
        tok = {k: median_of(res[k], "output_tok_s") for k in ("minillm", "llama-server")}
        ratios[c] = tok["minillm"] / tok["llama-server"]
        tpot = {k: median_of(res[k], "tpot", "p50") for k in ("minillm", "llama-server")}
        paired = round_ratios(res["minillm"], res["llama-server"])
        print(
            f"  {'':12s} | minillm / llama-server: {ratios[c]:.2f}x output tok/s (rounds "
            f"{min(paired):.2f}-{max(paired):.2f}x), {tpot['minillm'] / tpot['llama-server']:.2f}x"
            " TPOT p50"
        )
    same = sum(sum(r["same_greedy"]) for r in results.values())
    total = sum(len(r["same_greedy"]) for r in results.values())
    return (
        f"{model}, {n} requests, {threads} thread each, C in flight (minillm max_num_seqs C vs "
        "llama-server --parallel C): minillm output tok/s = "
        + ", ".join(f"{r:.2f}x at C={c}" for c, r in ratios.items())
        + f" llama-server's; same greedy text {same}/{total}"
    )


def report_llama_cpp_python(
    threads: int, batch: int, results: dict[str, Any], n: int, version: str
) -> str:
    """Print part (b) of llama-cpp-python mode; the summary text."""
    low = results["low_rate"]
    print("\n(b) all at once, then Poisson arrivals (medians of rounds)")
    print(HEADER)
    for load, label in [("burst", "all at once"), ("low", f"{low:.1f} req/s")]:
        for name, runs in results[load].items():
            print(row(label, name, runs))
    tok = {k: median_of(v, "output_tok_s") for k, v in results["burst"].items()}
    ratio = tok["minillm"] / tok["llama.cpp"]
    lat = {
        k: {m: median_of(v, m, "p50") for m in ("ttft", "tpot")} for k, v in results["low"].items()
    }
    same = results["same_greedy"]
    return (
        f"{n} requests at once, {threads} thread each: minillm serve "
        f"(continuous batching, batch {batch}) {tok['minillm']:.0f} out tok/s = "
        f"{ratio:.2f}x llama-cpp-python {version} server (one request at a "
        f"time) {tok['llama.cpp']:.0f}; at {low:.1f} req/s TTFT p50 "
        f"{ms(lat['minillm']['ttft'])} vs {ms(lat['llama.cpp']['ttft'])} ms, TPOT p50 "
        f"{ms(lat['minillm']['tpot'])} vs {ms(lat['llama.cpp']['tpot'])} ms; same greedy text "
        f"{sum(same)}/{len(same)}"
    )


def server_version(server: str) -> str:
    """What stands in for llama.cpp, or exit saying how to get it."""
    if server == "llama-server":
        if llama_server.find_binary() is None:
            raise SystemExit(
                f"llama-server is not built ({llama_server.binary_path()}): "
                f"run {llama_server.BUILD_COMMAND}"
            )
        return f"llama-server from llama-cpp-python {llama_server.VERSION}'s llama.cpp"
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            'llama-cpp-python is not installed: pip install "llama-cpp-python[server]==0.3.36"'
            " (or --server llama-server)"
        ) from None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="32 requests, 1 round")
    ap.add_argument(
        "--server", default="llama-cpp-python", choices=["llama-cpp-python", "llama-server"]
    )
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: bundled)")
    ap.add_argument("--gguf", default=None, help="its GGUF (default: export --model)")
    ap.add_argument("--kv-cache", default="f32", choices=["f32", "f16"], help="llama.cpp's")
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32], help="llama-server mode"
    )
    ap.add_argument(
        "--batch", type=int, default=32, help="minillm max_num_seqs (llama-cpp-python mode)"
    )
    ap.add_argument("--profile", action="store_true", help="llama-server mode: (c)")
    args = ap.parse_args(argv)
    version = server_version(args.server)
    run = report.start("llama-server" if args.server == "llama-server" else "llama-cpp", args)
    n = args.requests or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    tokenizer = load_tokenizer(args.model)
    work = make_workload(tokenizer, n)
    model = Path(args.model).name if args.model else "bundled model"
    tmp = tempfile.TemporaryDirectory()
    gguf = Path(args.gguf) if args.gguf else export_gguf(args.model, Path(tmp.name) / "m.gguf")
    print(
        f"workload: {n} requests (minillm.bench.workload.make_workload), "
        f"{sum(k for _, k in work)} output tokens; {model}; {version}, {gguf.name}, "
        f"{args.kv_cache} KV cache; {args.threads} thread(s) each; {repeats} round(s)",
        flush=True,
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    options = dict(model=args.model, threads=args.threads, kv_cache=args.kv_cache, repeats=repeats)
    if args.server == "llama-server":
        results = run_llama_server(work, gguf, args.concurrency, **options)
        summary = report_llama_server(args.threads, results, n, model)
        if args.profile:
            print("\n(c) where minillm's time goes (in process, same settings)")
            results["profile"] = engine_profile.profile(
                args.model, work, args.concurrency, args.threads, CTX_PER_SLOT
            )
    else:
        work = [(tokenizer.decode(p), k) for p, k in work]  # it takes text only
        results = run_llama_cpp_python(work, gguf, args.batch, **options)
        summary = report_llama_cpp_python(args.threads, args.batch, results, n, version)
    # the results per C, and what produced them (load: the machine is shared)
    command = sys.argv[1:] if argv is None else argv
    meta = dict(command="python -m benchmarks.llama_cpp " + " ".join(command))
    meta |= dict(server=version, model=model, requests=n, repeats=repeats)
    meta |= dict(output_tokens=sum(k for _, k in work), threads=args.threads)
    meta |= dict(kv_cache=args.kv_cache, concurrency=args.concurrency)
    meta |= dict(summary=f"SUMMARY {run.name}: {summary}")
    meta |= dict(cpus=os.cpu_count(), load_average=os.getloadavg()[0])
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print()
    return run.finish({"meta": meta, **results}, summary)


if __name__ == "__main__":
    main()
