"""Chapter 08 benchmark: `minillm serve` vs llama.cpp's Python server, same client, same work.

    pip install "llama-cpp-python[server]==0.3.36"   # compiles llama.cpp: ~20 min on 2 cores
    python -m benchmarks.llama_cpp [--quick] [--requests N] [--threads 1] [--json out.json]

The CPU peer is llama.cpp through llama-cpp-python's OpenAI-compatible server
(`python -m llama_cpp.server`), on the bundled checkpoint written as GGUF by
`minillm.export.gguf` (f32 weights and, by default, an f32 KV cache: the arithmetic minillm
does; llama.cpp's own default is an f16 KV cache: `--kv-cache f16`). The workload and the
streaming client are benchmarks/serving.py's (`make_workload`, `poisson_run`, `percentiles`,
imported by path): the same requests, sent as text to both servers (llama-cpp-python takes no token
ids), greedy (llama.cpp: also `repeat_penalty` 1.0, its server's default is 1.1), EOS
suppressed so every request runs to its length (minillm: `ignore_eos`; llama.cpp: logit
bias -1e4 on EOS).

llama-cpp-python's server runs ONE request at a time: a lock serialises requests and it
has no parallel slots (that is llama.cpp's C++ `llama-server --parallel N`, which the pip
package does not build). By default it also cancels the running stream when another
request arrives (`interrupt_requests`); we turn that off so requests queue.

(a) Correctness: non-streamed greedy completions (EOS allowed) of the first prompts on both
    servers; the texts should be equal.
(b) Speed: both servers up, each with one compute thread; for each load (all requests at
    once, then Poisson arrivals at a quarter of the slower server's capacity) the two
    systems run back to back, the order alternating, `--repeats` times; medians. Output
    tokens/s, TTFT and TPOT p50/p99 as vLLM's `bench serve` defines them.

The last line is `SUMMARY llama-cpp:`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from minillm import load_tokenizer
from minillm.export.gguf import export_gguf

ROOT = Path(__file__).resolve().parents[1]


def load_serving():
    """benchmarks/serving.py as a module (the shared workload, client and server start-up)."""
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "benchmarks" / "serving.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


serving = load_serving()


def start_llama_server(
    gguf: Path, port: int, threads: int = 1, kv_cache: str = "f32"
) -> subprocess.Popen:
    """`python -m llama_cpp.server` on 127.0.0.1:port; returns once /v1/models answers.
    kv_cache "f32" computes what minillm computes; llama.cpp's default is "f16"."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256"]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    kv = {"f32": "0", "f16": "1"}[kv_cache]  # GGML_TYPE_F32, GGML_TYPE_F16
    cmd += ["--type_k", kv, "--type_v", kv]
    cmd += ["--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return serving.wait_until_up(proc, f"http://127.0.0.1:{port}/v1/models", " ".join(cmd))


# llama-cpp-python's server applies a repetition penalty of 1.1 unless told otherwise:
# temperature 0 alone is not greedy there.
GREEDY = {"minillm": {}, "llama.cpp": {"repeat_penalty": 1.0}}


def same_greedy_text(urls: dict[str, str], prompts: list[str], n: int = 24) -> list[bool]:
    """Per prompt: do both servers return the same greedy completion (EOS allowed)?"""
    import httpx

    same = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
        texts = {
            k: httpx.post(u, json={**body, **GREEDY[k]}, timeout=60).json()["choices"][0]["text"]
            for k, u in urls.items()
        }
        same.append(len(set(texts.values())) == 1)
    return same


def compare(serving, urls, extras, work, rate: float, repeats: int) -> dict[str, list[dict]]:
    """Both systems on the same load, back to back, the order alternating each round."""
    runs: dict[str, list[dict]] = {k: [] for k in urls}
    order = list(urls)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            coro = serving.poisson_run(urls[name], work, rate, extra=extras[name])
            runs[name].append(serving.run_async(coro))
    return runs


def median_of(runs: list[dict], key: str, stat: str | None = None) -> float:
    return statistics.median(r[key][stat] if stat else r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 requests, 1 round")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32, help="minillm max running sequences")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: export the bundled)")
    parser.add_argument("--kv-cache", default="f32", choices=["f32", "f16"], help="llama.cpp's")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            'llama-cpp-python is not installed: pip install "llama-cpp-python[server]==0.3.36"'
        ) from None
    n = args.requests or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    tokenizer = load_tokenizer()
    work = [(tokenizer.decode(p), k) for p, k in serving.make_workload(tokenizer, n)]
    tmp = tempfile.TemporaryDirectory()
    gguf = Path(args.gguf) if args.gguf else export_gguf(None, Path(tmp.name) / "bundled.gguf")
    print(
        f"workload: {n} requests (serving.make_workload, sent as text), "
        f"{sum(k for _, k in work)} output tokens; llama-cpp-python {version}, "
        f"{gguf.name}, {args.kv_cache} KV cache; {args.threads} thread(s) each; {repeats} round(s)"
    )
    ports = {"minillm": serving.free_port(), "llama.cpp": serving.free_port()}
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    procs = [serving.start_server(ports["minillm"], args.batch)]
    try:
        procs.append(start_llama_server(gguf, ports["llama.cpp"], args.threads, args.kv_cache))
        urls = {k: f"http://127.0.0.1:{p}/v1/completions" for k, p in ports.items()}
        extras = {"minillm": None, "llama.cpp": {**GREEDY["llama.cpp"], "logit_bias": {"0": -1e4}}}
        same = same_greedy_text(urls, [p for p, _ in work[:8]])
        print(f"\n(a) same greedy text on {sum(same)}/{len(same)} prompts")
        for name in urls:  # warm-up
            serving.run_async(
                serving.poisson_run(urls[name], work[:4], math.inf, extra=extras[name])
            )
        results = {"burst": compare(serving, urls, extras, work, math.inf, repeats)}
        capacity = min(median_of(r, "req_s") for r in results["burst"].values())
        low = 0.25 * capacity
        results["low"] = compare(serving, urls, extras, work, low, repeats)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    ms = serving.ms
    print("\n(b) load       | system    | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms")
    for load, label in [("burst", "all at once"), ("low", f"{low:.1f} req/s")]:
        for name, runs in results[load].items():
            print(
                f"  {label:12s} | {name:9s} | {median_of(runs, 'output_tok_s'):9.0f} | "
                + " | ".join(
                    f"{ms(median_of(runs, k, 'p50'))}/{ms(median_of(runs, k, 'p99'))}"
                    for k in ("ttft", "tpot")
                )
            )
    b, lo = results["burst"], results["low"]
    tok = {k: median_of(v, "output_tok_s") for k, v in b.items()}
    ratio = tok["minillm"] / tok["llama.cpp"]
    lat = {k: {m: median_of(v, m, "p50") for m in ("ttft", "tpot")} for k, v in lo.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"same_greedy": same, **results}, default=str))
    print(
        f"\nSUMMARY llama-cpp: {n} requests at once, {args.threads} thread each: minillm serve "
        f"(continuous batching, batch {args.batch}) {tok['minillm']:.0f} out tok/s = "
        f"{ratio:.2f}x llama-cpp-python {version} server (one request at a "
        f"time) {tok['llama.cpp']:.0f}; at {low:.1f} req/s TTFT p50 "
        f"{ms(lat['minillm']['ttft'])} vs {ms(lat['llama.cpp']['ttft'])} ms, TPOT p50 "
        f"{ms(lat['minillm']['tpot'])} vs {ms(lat['llama.cpp']['tpot'])} ms; same greedy text "
        f"{sum(same)}/{len(same)}"
    )


if __name__ == "__main__":
    main()
