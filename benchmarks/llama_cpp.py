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
and the streaming client are benchmarks/serving.py's (`make_workload`, `poisson_run`,
`percentiles`): the same requests to both servers, greedy (llama.cpp: also
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
one minillm decode step's time goes at batch C (`minillm.lab.profile_split`, in process).

llama-cpp-python mode: both servers up; for each load (all requests at once, then Poisson
arrivals at a quarter of the slower server's capacity) the same back-to-back rounds.

The last line is `SUMMARY llama-server:` or `SUMMARY llama-cpp:`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import engine_profile, llama_server, serving
from minillm import load_tokenizer
from minillm.export.gguf import export_gguf

CTX_PER_SLOT = 256  # tokens of KV cache per running sequence, in both servers


def start_llama_cpp_python(
    gguf: Path, port: int, threads: int = 1, kv_cache: str = "f32"
) -> subprocess.Popen:
    """`python -m llama_cpp.server` on 127.0.0.1:port; returns once /v1/models answers.
    kv_cache "f32" computes what minillm computes; llama.cpp's default is "f16"."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(CTX_PER_SLOT)]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    kv = {"f32": "0", "f16": "1"}[kv_cache]  # GGML_TYPE_F32, GGML_TYPE_F16
    cmd += ["--type_k", kv, "--type_v", kv]
    cmd += ["--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return serving.wait_until_up(proc, f"http://127.0.0.1:{port}/v1/models", " ".join(cmd))


# llama-cpp-python's server applies a repetition penalty of 1.1 unless told otherwise:
# temperature 0 alone is not greedy there. (llama-server's default is 1.0; said anyway.)
GREEDY = {
    "minillm": {},
    "llama.cpp": {"repeat_penalty": 1.0},
    "llama-server": {"repeat_penalty": 1.0},
}


def same_greedy_text(
    urls: dict[str, str], prompts: list[str] | list[list[int]], n: int = 24, parallel: bool = False
) -> list[bool]:
    """Per prompt: do both servers return the same greedy completion (EOS allowed)?
    `parallel`: each server gets all prompts at once (so a batching server batches them)."""
    texts = {k: greedy_texts(u, prompts, n, GREEDY[k], parallel) for k, u in urls.items()}
    return [len(set(t)) == 1 for t in zip(*texts.values(), strict=True)]


def greedy_texts(
    url: str, prompts: list, n: int, extra: dict | None = None, parallel: bool = False
) -> list[str]:
    """Non-streamed greedy completions of `prompts` (text or token ids), in order."""
    import asyncio

    import httpx

    async def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **(extra or {})}
        r = await client.post(url, json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            if parallel:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            return [await one(client, p) for p in prompts]

    return serving.run_async(run())


def compare(
    urls: dict[str, str],
    extras: dict[str, dict | None],
    work: list,
    rate: float,
    repeats: int,
    concurrency: int | None = None,
    keepalive: bool = True,
) -> dict[str, list[dict]]:
    """Both systems on the same load, back to back, the order alternating each round."""
    runs: dict[str, list[dict]] = {k: [] for k in urls}
    order = list(urls)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            coro = serving.poisson_run(
                urls[name],
                work,
                rate,
                extra=extras[name],
                concurrency=concurrency,
                keepalive=keepalive,
            )
            runs[name].append(serving.run_async(coro))
    return runs


def median_of(runs: list[dict], key: str, stat: str | None = None) -> float:
    return statistics.median(r[key][stat] if stat else r[key] for r in runs)


def row(label: str, name: str, runs: list[dict]) -> str:
    """One table row: output tok/s, TTFT and TPOT p50/p99 (ms), medians over rounds."""
    ms = serving.ms
    return f"  {label:12s} | {name:12s} | {median_of(runs, 'output_tok_s'):9.0f} | " + " | ".join(
        f"{ms(median_of(runs, k, 'p50'))}/{ms(median_of(runs, k, 'p99'))}" for k in ("ttft", "tpot")
    )


HEADER = "  load         | system       | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms"


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------ batch-1 decode speed
def decode_tokens_per_s(
    gguf: Path, prompt: list[int], tokens: int = 64, rounds: int = 5, threads: int = 1
) -> list[float]:
    """llama.cpp's own batch-1 decode speed on `gguf`: `rounds` greedy generations of
    `tokens` tokens (EOS ignored) after `prompt` (token ids), one llama-server slot with an
    f32 KV cache; per round, the decode tokens/s llama-server reports itself
    (`timings.predicted_per_second`: its decode time alone, no HTTP or prefill). The
    peer for minillm's batch-1 decode (benchmarks/kv_cache.py --roofline)."""
    port = serving.free_port()
    proc = llama_server.start(gguf, port, 1, threads=threads, ctx_per_slot=len(prompt) + tokens)
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body | {"cache_prompt": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    speeds = []
    try:
        for _ in range(rounds + 1):  # the first round warms up
            with urllib.request.urlopen(req, timeout=600) as resp:
                reply = json.load(resp)
            if reply["timings"]["predicted_n"] != tokens:
                raise RuntimeError(f"llama-server decoded {reply['timings']['predicted_n']} tokens")
            speeds.append(reply["timings"]["predicted_per_second"])
    finally:
        stop([proc])
    return speeds[1:]


# ------------------------------------------------------------------ llama-server --parallel N
def run_llama_server(args, work: list[tuple[list[int], int]], gguf: Path) -> dict[str, Any]:
    """For each concurrency C: fresh servers (minillm batch C, llama-server --parallel C),
    the greedy-text check, then closed-loop rounds with C requests in flight."""
    blocks = -(-CTX_PER_SLOT // 16)  # minillm's KV blocks of 16 tokens per sequence
    results: dict[str, Any] = {}
    for c in args.concurrency:
        ports = {"minillm": serving.free_port(), "llama-server": serving.free_port()}
        procs = [
            serving.start_server(
                ports["minillm"], c, args.model, prefix_cache=False, num_blocks=c * blocks
            )
        ]
        try:
            procs.append(
                llama_server.start(
                    gguf, ports["llama-server"], c, threads=args.threads, kv_cache=args.kv_cache
                )
            )
            urls = {k: f"http://127.0.0.1:{p}/v1/completions" for k, p in ports.items()}
            same = same_greedy_text(urls, [p for p, _ in work[:8]], parallel=True)
            for name in urls:  # warm-up
                serving.run_async(
                    serving.poisson_run(
                        urls[name], work[:4], math.inf, extra=GREEDY[name], keepalive=False
                    )
                )
            runs = compare(urls, GREEDY, work, math.inf, args.repeats, c, keepalive=False)
        finally:
            stop(procs)
        results[str(c)] = {"same_greedy": same, **runs}
        print(f"  concurrency {c}: same greedy text on {sum(same)}/{len(same)} prompts", flush=True)
    return results


def report_llama_server(args, results: dict[str, Any], n: int, model: str) -> str:
    print("\n(b) closed loop, C requests in flight (medians of rounds)")
    print(HEADER)
    ratios = {}
    for c, res in results.items():
        for name in ("minillm", "llama-server"):
            print(row(f"C={c}", name, res[name]))
        tok = {k: median_of(res[k], "output_tok_s") for k in ("minillm", "llama-server")}
        ratios[c] = tok["minillm"] / tok["llama-server"]
        tpot = {k: median_of(res[k], "tpot", "p50") for k in ("minillm", "llama-server")}
        paired = [  # round r of each ran back to back: the spread the shared CPU adds
            a["output_tok_s"] / b["output_tok_s"]
            for a, b in zip(res["minillm"], res["llama-server"], strict=True)
        ]
        print(
            f"  {'':12s} | minillm / llama-server: {ratios[c]:.2f}x output tok/s (rounds "
            f"{min(paired):.2f}-{max(paired):.2f}x), {tpot['minillm'] / tpot['llama-server']:.2f}x"
            " TPOT p50"
        )
    same = sum(sum(r["same_greedy"]) for r in results.values())
    total = sum(len(r["same_greedy"]) for r in results.values())
    return (
        f"SUMMARY llama-server: {model}, {n} requests, {args.threads} thread each, C in "
        "flight (minillm max_num_seqs C vs llama-server --parallel C): minillm output tok/s = "
        + ", ".join(f"{r:.2f}x at C={c}" for c, r in ratios.items())
        + f" llama-server's; same greedy text {same}/{total}"
    )


# ------------------------------------------------------------------ llama-cpp-python server
def run_llama_cpp_python(args, work: list[tuple[str, int]], gguf: Path) -> dict[str, Any]:
    """Both servers up; all requests at once, then Poisson arrivals at a quarter of the
    slower server's capacity."""
    ports = {"minillm": serving.free_port(), "llama.cpp": serving.free_port()}
    procs = [serving.start_server(ports["minillm"], args.batch, args.model)]
    try:
        procs.append(start_llama_cpp_python(gguf, ports["llama.cpp"], args.threads, args.kv_cache))
        urls = {k: f"http://127.0.0.1:{p}/v1/completions" for k, p in ports.items()}
        extras = {"minillm": None, "llama.cpp": {**GREEDY["llama.cpp"], "logit_bias": {"0": -1e4}}}
        same = same_greedy_text(urls, [p for p, _ in work[:8]])
        print(f"\n(a) same greedy text on {sum(same)}/{len(same)} prompts")
        for name in urls:  # warm-up
            serving.run_async(
                serving.poisson_run(urls[name], work[:4], math.inf, extra=extras[name])
            )
        results = {"burst": compare(urls, extras, work, math.inf, args.repeats)}
        capacity = min(median_of(r, "req_s") for r in results["burst"].values())
        results["low"] = compare(urls, extras, work, 0.25 * capacity, args.repeats)
    finally:
        stop(procs)
    return {"same_greedy": same, "low_rate": 0.25 * capacity, **results}


def report_llama_cpp_python(args, results: dict[str, Any], n: int, version: str) -> str:
    ms, low = serving.ms, results["low_rate"]
    print("\n(b)" + HEADER[3:])
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
        f"SUMMARY llama-cpp: {n} requests at once, {args.threads} thread each: minillm serve "
        f"(continuous batching, batch {args.batch}) {tok['minillm']:.0f} out tok/s = "
        f"{ratio:.2f}x llama-cpp-python {version} server (one request at a "
        f"time) {tok['llama.cpp']:.0f}; at {low:.1f} req/s TTFT p50 "
        f"{ms(lat['minillm']['ttft'])} vs {ms(lat['llama.cpp']['ttft'])} ms, TPOT p50 "
        f"{ms(lat['minillm']['tpot'])} vs {ms(lat['llama.cpp']['tpot'])} ms; same greedy text "
        f"{sum(same)}/{len(same)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--server", default="llama-cpp-python", choices=["llama-cpp-python", "llama-server"]
    )
    parser.add_argument("--quick", action="store_true", help="32 requests, 1 round")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: bundled)")
    parser.add_argument("--gguf", default=None, help="its GGUF (default: export --model)")
    parser.add_argument("--kv-cache", default="f32", choices=["f32", "f16"], help="llama.cpp's")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32], help="llama-server mode"
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="minillm max_num_seqs (llama-cpp-python mode)"
    )
    parser.add_argument("--profile", action="store_true", help="llama-server mode: (c)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.server == "llama-server":
        if llama_server.find_binary() is None:
            raise SystemExit(
                f"llama-server is not built ({llama_server.binary_path()}): "
                f"run {llama_server.BUILD_COMMAND}"
            )
        version = f"llama-server from llama-cpp-python {llama_server.VERSION}'s llama.cpp"
    else:
        try:
            version = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                'llama-cpp-python is not installed: pip install "llama-cpp-python[server]==0.3.36"'
                " (or --server llama-server)"
            ) from None
    n = args.requests or (32 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    tokenizer = load_tokenizer(args.model)
    work = serving.make_workload(tokenizer, n)
    model = Path(args.model).name if args.model else "bundled model"
    tmp = tempfile.TemporaryDirectory()
    gguf = Path(args.gguf) if args.gguf else export_gguf(args.model, Path(tmp.name) / "m.gguf")
    print(
        f"workload: {n} requests (serving.make_workload), {sum(k for _, k in work)} output "
        f"tokens; {model}; {version}, {gguf.name}, {args.kv_cache} KV cache; "
        f"{args.threads} thread(s) each; {args.repeats} round(s)",
        flush=True,
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.server == "llama-server":
        results = run_llama_server(args, work, gguf)
        summary = report_llama_server(args, results, n, model)
        if args.profile:
            print("\n(c) where minillm's time goes (in process, same settings)")
            results["profile"] = engine_profile.profile(
                args.model, work, args.concurrency, args.threads, CTX_PER_SLOT
            )
    else:
        work = [(tokenizer.decode(p), k) for p, k in work]  # it takes text only
        results = run_llama_cpp_python(args, work, gguf)
        summary = report_llama_cpp_python(args, results, n, version)
    if args.json:  # the results per C, and what produced them (load: the machine is shared)
        meta = dict(command="python -m benchmarks.llama_cpp " + " ".join(sys.argv[1:]))
        meta |= dict(server=version, model=model, requests=n, repeats=args.repeats)
        meta |= dict(output_tokens=sum(k for _, k in work), threads=args.threads)
        meta |= dict(kv_cache=args.kv_cache, concurrency=args.concurrency, summary=summary)
        meta |= dict(cpus=os.cpu_count(), load_average=os.getloadavg()[0])
        meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        Path(args.json).write_text(json.dumps({"meta": meta, **results}, indent=1, default=str))
    print("\n" + summary)


if __name__ == "__main__":
    main()
