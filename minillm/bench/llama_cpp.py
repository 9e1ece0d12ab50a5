"""Chapter 08's llama.cpp peers, measured with the client and requests `minillm serve` gets:
llama-cpp-python's server (one request at a time) and llama.cpp's C++ `llama-server
--parallel C` (continuous batching over C slots), their greedy texts compared with minillm's,
both servers loaded back to back (`run_llama_server`, `run_llama_cpp_python`), and
llama.cpp's own batch-1 decode speed (`decode_tokens_per_s`, the peer of
`python -m benchmarks.kv_cache --roofline`). `python -m benchmarks.llama_cpp` runs them.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from minillm.bench import llama_server
from minillm.bench.http_load import free_port, poisson_run, start_server, wait_until_up
from minillm.bench.openai_http import run_async

CTX_PER_SLOT = 256  # tokens of KV cache per running sequence, in both servers

# llama-cpp-python's server applies a repetition penalty of 1.1 unless told otherwise:
# temperature 0 alone is not greedy there. (llama-server's default is 1.0; said anyway.)
GREEDY = {
    "minillm": {},
    "llama.cpp": {"repeat_penalty": 1.0},
    "llama-server": {"repeat_penalty": 1.0},
}


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
    return wait_until_up(proc, f"http://127.0.0.1:{port}/v1/models", " ".join(cmd))


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

    async def one(client: httpx.AsyncClient, prompt: str | list[int]) -> str:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **(extra or {})}
        r = await client.post(url, json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            if parallel:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            return [await one(client, p) for p in prompts]

    return run_async(run())


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
            coro = poisson_run(
                urls[name],
                work,
                rate,
                extra=extras[name],
                concurrency=concurrency,
                keepalive=keepalive,
            )
            runs[name].append(run_async(coro))
    return runs


def median_of(runs: list[dict], key: str, stat: str | None = None) -> float:
    """The median over rounds of `run[key]` (or `run[key][stat]`, e.g. ttft p50)."""
    return statistics.median(r[key][stat] if stat else r[key] for r in runs)


def round_ratios(ours: list[dict], theirs: list[dict], key: str = "output_tok_s") -> list[float]:
    """`ours[r][key] / theirs[r][key]` for each round r: the two ran back to back, so the
    spread of these is what the shared machine adds to the ratio of the medians."""
    return [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the servers and wait for each to exit."""
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------ batch-1 decode speed
def decode_tokens_per_s(
    gguf: Path, prompt: list[int], tokens: int = 64, rounds: int = 5, threads: int = 1
) -> list[float]:
    """llama.cpp's own batch-1 decode speed on `gguf`: `rounds` greedy generations of
    `tokens` tokens (EOS ignored) after `prompt` (token ids), one llama-server slot with an
    f32 KV cache (`decode_once` each). The peer for minillm's batch-1 decode
    (benchmarks/kv_cache.py --roofline)."""
    port = free_port()
    proc = llama_server.start(gguf, port, 1, threads=threads, ctx_per_slot=len(prompt) + tokens)
    try:
        speeds = [decode_once(port, prompt, tokens) for _ in range(rounds + 1)]
    finally:
        stop([proc])
    return speeds[1:]  # the first round warms up


def decode_once(port: int, prompt: list[int], tokens: int) -> float:
    """One greedy generation of `tokens` tokens (EOS ignored, no prompt cache) after `prompt`
    on the llama-server at `port`: the decode tokens/s it reports itself
    (`timings.predicted_per_second`: its decode time alone, no HTTP or prefill)."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body | {"cache_prompt": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.load(resp)
    if reply["timings"]["predicted_n"] != tokens:
        raise RuntimeError(f"llama-server decoded {reply['timings']['predicted_n']} tokens")
    return reply["timings"]["predicted_per_second"]


# ------------------------------------------------------------------ llama-server --parallel N
def run_llama_server(
    work: list[tuple[list[int], int]],
    gguf: Path,
    concurrency: list[int],
    model: str | None = None,
    threads: int = 1,
    kv_cache: str = "f32",
    repeats: int = 3,
) -> dict[str, Any]:
    """For each concurrency C: fresh servers (minillm batch C, llama-server --parallel C),
    the greedy-text check, then closed-loop rounds with C requests in flight."""
    blocks = -(-CTX_PER_SLOT // 16)  # minillm's KV blocks of 16 tokens per sequence
    results: dict[str, Any] = {}
    for c in concurrency:
        ports = {"minillm": free_port(), "llama-server": free_port()}
        procs = [
            start_server(ports["minillm"], c, model, prefix_cache=False, num_blocks=c * blocks)
        ]
        try:
            procs.append(
                llama_server.start(
                    gguf, ports["llama-server"], c, threads=threads, kv_cache=kv_cache
                )
            )
            urls = {k: f"http://127.0.0.1:{p}/v1/completions" for k, p in ports.items()}
            same = same_greedy_text(urls, [p for p, _ in work[:8]], parallel=True)
            for name in urls:  # warm-up
                run_async(
                    poisson_run(urls[name], work[:4], math.inf, extra=GREEDY[name], keepalive=False)
                )
            runs = compare(urls, GREEDY, work, math.inf, repeats, c, keepalive=False)
        finally:
            stop(procs)
        results[str(c)] = {"same_greedy": same, **runs}
        print(f"  concurrency {c}: same greedy text on {sum(same)}/{len(same)} prompts", flush=True)
    return results


# ------------------------------------------------------------------ llama-cpp-python server
def run_llama_cpp_python(
    work: list[tuple[str, int]],
    gguf: Path,
    batch: int = 32,
    model: str | None = None,
    threads: int = 1,
    kv_cache: str = "f32",
    repeats: int = 3,
) -> dict[str, Any]:
    """Both servers up (minillm with `batch` slots); all requests at once, then Poisson
    arrivals at a quarter of the slower server's capacity."""
    ports = {"minillm": free_port(), "llama.cpp": free_port()}
    procs = [start_server(ports["minillm"], batch, model)]
    try:
        procs.append(start_llama_cpp_python(gguf, ports["llama.cpp"], threads, kv_cache))
        urls = {k: f"http://127.0.0.1:{p}/v1/completions" for k, p in ports.items()}
        extras = {"minillm": None, "llama.cpp": {**GREEDY["llama.cpp"], "logit_bias": {"0": -1e4}}}
        same = same_greedy_text(urls, [p for p, _ in work[:8]])
        print(f"\n(a) same greedy text on {sum(same)}/{len(same)} prompts")
        for name in urls:  # warm-up
            run_async(poisson_run(urls[name], work[:4], math.inf, extra=extras[name]))
        results = {"burst": compare(urls, extras, work, math.inf, repeats)}
        capacity = min(median_of(r, "req_s") for r in results["burst"].values())
        results["low"] = compare(urls, extras, work, 0.25 * capacity, repeats)
    finally:
        stop(procs)
    return {"same_greedy": same, "low_rate": 0.25 * capacity, **results}
