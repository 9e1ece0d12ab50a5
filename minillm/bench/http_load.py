"""Chapter 08's online load: a server in a subprocess, requests streamed to it over HTTP with
Poisson arrivals (or a closed loop), and vLLM `bench serve`'s latency metrics of the run.

Used by `minillm.bench.batching.online` (minillm served alone) and `minillm.bench.llama_cpp`
(minillm against llama.cpp's servers, the same client and requests).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from minillm.bench.metrics import percentiles
from minillm.bench.openai_http import run_async
from minillm.bench.workload import SEED
from minillm.lab.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_server(
    port: int, batch: int, model: str | None = None, **settings: Any
) -> subprocess.Popen:
    """`minillm` serving `model` (None: the bundled one) in a subprocess with one intra-op
    thread; `settings` are the engine's (`EngineConfig`, e.g. `prefix_cache=False`)."""
    config = {"max_num_seqs": batch, **settings}
    code = (
        "import torch; torch.set_num_threads(1); from minillm.serving.api_server import serve; "
        "from minillm.engine.config import EngineConfig; "
        f"serve({model!r}, port={port}, log_level='warning', config=EngineConfig(**{config!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    return wait_until_up(proc, f"http://127.0.0.1:{port}/health", "minillm serve")


def wait_until_up(
    proc: subprocess.Popen, url: str, what: str, timeout: float = 120
) -> subprocess.Popen:
    """Poll `url` until it answers 200; stop early with an error if `proc` exits."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start within {timeout:.0f} s")


async def one_request(
    client: Any, url: str, prompt: list[int] | str, n: int, extra: dict | None = None
) -> dict[str, Any]:
    """Stream one completion; `extra` adds server-specific body fields (llama.cpp's)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, stream_options={"include_usage": True}, **(extra or {}))
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    end = time.perf_counter()
    # a server that sends no usage in streams (llama-cpp-python): one text chunk per token
    return {"start": start, "times": times, "end": end, "tokens": tokens or len(times)}


async def poisson_run(
    url: str,
    work: list[tuple[list[int] | str, int]],
    rate: float,
    seed: int = SEED,
    extra: dict | None = None,
    concurrency: int | None = None,
    keepalive: bool = True,
) -> dict[str, Any]:
    """Send the workload with exponential gaps of mean 1/rate (inf: all at once), at most
    `concurrency` requests in flight (None: no limit); a request that arrives while the
    limit is reached waits in the client, as with vLLM `bench serve --max-concurrency`.
    With rate inf and a limit this is a closed loop: a new request as soon as one ends.

    `keepalive=False` opens a new connection for every request (its set-up then counts in
    TTFT): for servers that close a connection after a streamed response while announcing
    keep-alive (llama.cpp's llama-server), where reusing it races the close."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=None if keepalive else 0)
    gate = asyncio.Semaphore(concurrency or len(work) or 1)

    async def limited(prompt: list[int] | str, n: int) -> dict[str, Any]:
        async with gate:
            return await one_request(c, url, prompt, n, extra)

    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        tasks, t0 = [], time.perf_counter()
        for prompt, n in work:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        done = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    ttft = [d["times"][0] - d["start"] for d in done if d["times"]]
    e2e = [d["end"] - d["start"] for d in done]
    tpot = [(d["end"] - d["times"][0]) / (d["tokens"] - 1) for d in done if d["tokens"] > 1]
    itl = [b - a for d in done for a, b in zip(d["times"], d["times"][1:], strict=False)]
    out_tokens = sum(d["tokens"] for d in done)
    return {
        "rate": rate,
        "requests": len(done),
        "req_s": len(done) / wall,
        "output_tok_s": out_tokens / wall,
        **{k: percentiles(v) for k, v in dict(ttft=ttft, tpot=tpot, itl=itl, e2e=e2e).items()},
    }


def online(
    work: list[tuple[list[int], int]], rates: list[float], batch: int = 32, model: str | None = None
) -> list[dict[str, Any]]:
    """`minillm` served with `batch` slots, the workload sent at each of `rates` (req/s,
    inf: all at once) after a 4-request warm-up: one `poisson_run` result per rate."""
    port = free_port()
    proc = start_server(port, batch, model)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        run_async(poisson_run(url, work[:4], math.inf))  # warm-up
        return [run_async(poisson_run(url, work, rate)) for rate in rates]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ms(seconds: float) -> str:
    """A latency in seconds as the tables print it: milliseconds, one decimal."""
    return f"{1000 * seconds:.1f}"
