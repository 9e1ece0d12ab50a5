"""Chapter 08 benchmark: continuous batching vs static batching vs HF `generate`, offline
and online, with vLLM `bench serve`'s metrics.

    python -m benchmarks.serving [--quick] [--requests N] [--no-online] [--json out.json]

Workload (the same requests for every system): `--requests` prompts (default 128) cut
from the bundled model's held-out text, prompt lengths uniform in [8, 64] tokens, output
lengths log-normal with median 32 tokens and sigma 0.8, clipped to [4, 160], EOS
ignored, greedy. Seeded: the same draw every run.

(a) Offline throughput, one process: minillm continuous batching (`Engine`, up to
    `--batch` sequences), the static-batching baseline (same engine, fixed batches of
    `--batch` that wait for their longest request) and transformers `generate` with
    left padding in batches of `--batch` (each batch runs to its longest output). The
    three are timed interleaved, round-robin, and the result is the median paired time
    ratio. Also per-mode slot utilisation (mean running sequences per decode step /
    batch) and the latency metrics of the continuous run (all requests arrive at t=0).
(b) Online: `minillm` served over HTTP in a subprocess; an asyncio client streams each
    request (prompt token ids, `/v1/completions`) with Poisson arrivals at a few rates
    (fractions of the offline request throughput, plus all-at-once) and measures, as
    vLLM's `bench serve` defines them: TTFT (send -> first token), TPOT ((E2E - TTFT) /
    (output tokens - 1)), ITL (gaps between streamed chunks), E2E latency, request and
    output-token throughput; p50 and p99.

The last lines are `SUMMARY serving-offline:` and `SUMMARY serving-online:`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm import load_model, load_tokenizer
from minillm.bench import make_workload
from minillm.bench.openai_http import run_async
from minillm.engine import Engine, RequestOutput, SamplingParams
from minillm.engine.llm_engine import final_only
from minillm.lab import paired_ratios, time_samples
from minillm.model import BUNDLED_DIR
from minillm.model.weights import resolve_model_dir
from minillm.training import first_divergence

ROOT = Path(__file__).resolve().parents[1]

SEED = 0


# ------------------------------------------------------------------------ the workload
def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# ------------------------------------------------------------------------ (a) offline
def run_engine(model, tokenizer, work, batch: int = 32, static: bool = False, trace=False):
    """Run the workload to completion; (outputs in order, engine) for inspection."""
    engine = Engine(model, tokenizer, max_num_seqs=batch, static=static)
    engine.trace = [] if trace else None
    for prompt, n in work:
        engine.add_request(prompt, final_only(greedy(n)))  # no per-step copies of the outputs
    return engine.run_to_completion(), engine


def vllm_compare(
    work: list[tuple[list[int], int]] | None = None, model_dir: str | None = None
) -> dict[str, Any]:
    """vLLM and minillm's engine on the same GPU, the same checkpoint and prompts, both in
    bf16: output tok/s of each and how far their greedy tokens agree.

    Exact equality across bf16 kernels is not guaranteed: vLLM's attention and GEMMs add in
    another order than minillm's, bf16 keeps 8 bits of mantissa, so two logits within a
    rounding step can swap places and greedy decoding diverges from there on. So the check is
    agreement of the first k tokens of each request (k = where they first differ)."""
    import vllm

    if not torch.cuda.is_available():
        raise RuntimeError("vllm_compare needs a CUDA GPU")
    model_dir = str(model_dir or BUNDLED_DIR)
    tokenizer = load_tokenizer(model_dir)
    work = work or [(ids, 64) for ids, _ in make_workload(tokenizer, 64, SEED)]
    llm = vllm.LLM(model=model_dir, dtype="bfloat16")
    params = [vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    theirs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params)
    vllm_s = time.perf_counter() - start
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    ours, _ = run_engine(model, tokenizer, work, batch=64)
    ours_s = time.perf_counter() - start
    tokens = sum(n for _, n in work)
    first_diff = [
        first_divergence(a.outputs[0].token_ids, list(b.outputs[0].token_ids))
        for a, b in zip(ours, theirs, strict=True)
    ]
    return {
        "vllm_tok_s": tokens / vllm_s,
        "minillm_tok_s": tokens / ours_s,
        "identical_requests": sum(d == n for d, (_, n) in zip(first_diff, work, strict=True))
        / len(work),
        "mean_first_divergence": sum(first_diff) / len(first_diff),
    }


def slot_utilisation(engine: Engine, batch: int) -> float:
    """Mean running sequences per decode step over the batch size (needs engine.trace)."""
    decodes = [len(r.decode_ids) for r in engine.trace if not r.prefill_tokens]
    return sum(decodes) / (len(decodes) * batch)


def step_tokens(engine: Engine) -> list[int]:
    """Tokens each step computed: its decode rows plus its prompt tokens (needs engine.trace)."""
    return [len(r.decode_ids) + sum(r.prefill_tokens.values()) for r in engine.trace]


def batching_model(tokens: dict[str, list[int]], relative: dict[str, float]) -> dict[str, float]:
    """Why continuous batching gains what it gains here (`tokens`: mode -> tokens each step
    computed, `step_tokens`). 'flat': static steps / continuous steps, the speed-up if a
    step cost the same whatever it computes (a GPU's regime while reading the weights
    dominates a step). 'curve': the same steps costed on this machine's measured step-cost
    curve (`decode_step_cost`'s relative cost of a step with B rows, interpolated between
    its batch sizes and extended along its last segment, a prompt token counted as a row):
    a CPU step grows with what it computes, so packing more rows per step saves less
    than it saves steps."""
    sizes = sorted(int(k.removeprefix("B=")) for k in relative)
    costs = [relative[f"B={b}"] for b in sizes]

    def cost(n: int) -> float:
        if n >= sizes[-1]:  # beyond the curve: extend its last segment
            slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
            return costs[-1] + slope * (n - sizes[-1])
        return float(np.interp(n, sizes, costs))

    total = {mode: sum(cost(n) for n in t) for mode, t in tokens.items()}
    return {
        "flat": len(tokens["static"]) / len(tokens["continuous"]),
        "curve": total["static"] / total["continuous"],
    }


def hf_model(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, model: str | None = None
):
    """A checkpoint in transformers (None: the bundled one; or a name such as smollm2, or
    a directory), for the `generate` baseline."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dtype)
    return hf.to(device).eval()


@torch.inference_mode()
def run_hf(model, work, batch: int = 32, pad_id: int = 0) -> list[list[int]]:
    """transformers `generate`, batches of `batch` left-padded prompts, each batch run to
    its longest output (min_new_tokens = max_new_tokens: EOS ignored); outputs cut to
    each request's length."""
    outs = []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, (p, _) in enumerate(chunk):
            ids[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), 1
        longest = max(n for _, n in chunk)
        gen = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
        outs += [gen[b, width : width + n].tolist() for b, (_, n) in enumerate(chunk)]
    return outs


def decode_step_cost(model, tokenizer, sizes=(1, 4, 16, 32), repeats: int = 20) -> dict:
    """Seconds of one engine decode step with B running sequences (32-token prompts),
    relative to B = 1, interleaved: how much a bigger batch costs per step on this
    machine. Batching pays when this grows much slower than B."""
    engines = {}
    for b in sizes:
        engine = Engine(model, tokenizer, max_num_seqs=b)
        for i in range(b):
            engine.add_request([(7 * i + j) % 4000 + 1 for j in range(32)], greedy(200))
        engine.step()  # the prefill
        engines[b] = engine
    fns = {f"B={b}": engines[b].step for b in sizes}
    samples = time_samples(fns, repeats=repeats, warmup=2)
    return {
        "seconds": {k: statistics.median(v) for k, v in samples.items()},
        "relative": paired_ratios(samples, f"B={sizes[0]}"),
    }


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    pick = lambda q: xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "mean": statistics.fmean(xs)}


def engine_latencies(outs: list[RequestOutput]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT, ITL, E2E (seconds) from the engine's own timestamps."""
    ttft, tpot, itl, e2e = [], [], [], []
    for o in outs:
        m = o.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        e2e.append(m.finished_time - m.arrival_time)
        n = len(o.outputs[0].token_ids)
        if n > 1:
            tpot.append((m.token_times[-1] - m.first_token_time) / (n - 1))
        itl += [b - a for a, b in zip(m.token_times, m.token_times[1:], strict=False)]
    return {k: percentiles(v) for k, v in dict(ttft=ttft, tpot=tpot, itl=itl, e2e=e2e).items()}


def offline(model, tokenizer, work, batch: int = 32, repeats: int = 3, hf=None) -> dict[str, Any]:
    """(a): interleaved timing of the three systems on the same requests."""
    results: dict[str, Any] = {}

    def continuous():
        results["continuous"] = run_engine(model, tokenizer, work, batch, trace=True)

    def static():
        results["static"] = run_engine(model, tokenizer, work, batch, static=True, trace=True)

    fns = {"continuous": continuous, "static": static}
    if hf is not None:
        fns["hf"] = lambda: results.__setitem__("hf", run_hf(hf, work, batch))
    samples = time_samples(fns, repeats=repeats, warmup=0)
    ratios = paired_ratios(samples, "continuous")  # time of X / time of continuous
    cont_outs, cont_engine = results["continuous"]
    static_outs, static_engine = results["static"]
    tokens = [o.outputs[0].token_ids for o in cont_outs]
    assert tokens == [o.outputs[0].token_ids for o in static_outs], "static != continuous"
    out_tokens = sum(n for _, n in work)
    seconds = statistics.median(samples["continuous"])
    report = {
        "requests": len(work),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(len(p) for p, _ in work),
        "batch": batch,
        "continuous_tok_s": out_tokens / seconds,
        "continuous_req_s": len(work) / seconds,
        "speedup_vs_static": ratios["static"],
        "steps": {"continuous": cont_engine.num_steps, "static": static_engine.num_steps},
        "prefill_steps": {
            "continuous": sum(bool(r.prefill_tokens) for r in cont_engine.trace),
            "static": sum(bool(r.prefill_tokens) for r in static_engine.trace),
        },
        "utilisation": {
            "continuous": slot_utilisation(cont_engine, batch),
            "static": slot_utilisation(static_engine, batch),
        },
        "step_tokens": {
            "continuous": step_tokens(cont_engine),
            "static": step_tokens(static_engine),
        },
        "latency_continuous": engine_latencies(cont_outs),
        "latency_static": engine_latencies(static_outs),
    }
    if hf is not None:
        report["speedup_vs_hf"] = ratios["hf"]
        same = sum(a == b for a, b in zip(results["hf"], tokens, strict=True))
        report["hf_same_tokens"] = same / len(work)  # left padding changes numerics a little
    return report


# ------------------------------------------------------------------------ (b) online
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    port: int, batch: int, model: str | None = None, **engine_kwargs: Any
) -> subprocess.Popen:
    """`minillm` serving `model` (None: the bundled one) in a subprocess with one intra-op
    thread; `engine_kwargs` go to `Engine` (e.g. `prefix_cache=False`)."""
    kwargs = {"max_num_seqs": batch, **engine_kwargs}
    code = (
        "import torch; torch.set_num_threads(1); from minillm.serving.api_server import serve; "
        f"serve({model!r}, port={port}, log_level='warning', **{kwargs!r})"
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
    client, url: str, prompt: list[int] | str, n: int, extra: dict | None = None
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
    work,
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

    async def limited(prompt, n):
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
    work, rates: list[float], batch: int = 32, model: str | None = None
) -> list[dict[str, Any]]:
    port = free_port()
    proc = start_server(port, batch, model)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        run_async(poisson_run(url, work[:4], math.inf))  # warm-up
        return [run_async(poisson_run(url, work, rate)) for rate in rates]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------ report
def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="48 requests, batch 16, 1 round")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="default 32 (quick: 16)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="bundled (default), smollm2, or a dir")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-online", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.requests or (48 if args.quick else 128)
    args.batch = args.batch or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    work = make_workload(tokenizer, n)
    hf = None if args.no_hf else hf_model(model=args.model)
    print(
        f"workload: {n} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(k for _, k in work)} output tokens; batch {args.batch}; torch threads "
        f"{args.threads}; {repeats} interleaved round(s)"
    )
    off = offline(model, tokenizer, work, args.batch, repeats, hf)
    print("\n(a) offline")
    print(
        f"  continuous: {off['continuous_tok_s']:.0f} output tok/s, "
        f"{off['steps']['continuous']} steps ({off['prefill_steps']['continuous']} prefill), "
        "slot utilisation "
        f"{off['utilisation']['continuous']:.0%}"
    )
    print(
        f"  static:     {off['speedup_vs_static']:.2f}x the time of continuous, "
        f"{off['steps']['static']} steps ({off['prefill_steps']['static']} prefill), "
        f"slot utilisation {off['utilisation']['static']:.0%}"
    )
    cost = decode_step_cost(model, tokenizer)
    print(
        "  decode step cost vs batch 1 (interleaved): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in cost["relative"].items())
    )
    off["model"] = batching_model(off["step_tokens"], cost["relative"])
    print(
        f"  why: continuous takes {off['model']['flat']:.2f}x fewer steps (its speed-up if a "
        "step cost the same whatever it computes, a GPU's regime); costed on the step-cost "
        f"curve above (a prompt token as a row), those steps predict {off['model']['curve']:.2f}x"
    )
    if hf is not None:
        print(
            f"  HF generate (padded batches): {off['speedup_vs_hf']:.2f}x the time of "
            f"continuous; same greedy tokens on {off['hf_same_tokens']:.0%} of requests"
        )
    for mode in ("continuous", "static"):
        lat = off[f"latency_{mode}"]
        print(
            f"  {mode:10s} latency (all sent at t=0) p50/p99 ms: "
            + ", ".join(f"{k.upper()} {ms(v['p50'])}/{ms(v['p99'])}" for k, v in lat.items())
        )
    summary = (
        f"SUMMARY serving-offline: {n} requests, batch {args.batch}: continuous "
        f"{off['continuous_tok_s']:.0f} tok/s = {off['speedup_vs_static']:.2f}x static"
    )
    if hf is not None:
        summary += f", {off['speedup_vs_hf']:.2f}x HF generate (padded)"
    summary += (
        f"; decode step at B=32 costs {cost['relative']['B=32']:.1f}x B=1, so "
        f"{off['model']['flat']:.2f}x fewer steps predict {off['model']['curve']:.2f}x"
    )
    summary += (
        f"; slot utilisation {off['utilisation']['static']:.0%} static -> "
        f"{off['utilisation']['continuous']:.0%} continuous"
    )
    results: dict[str, Any] = {"offline": off, "decode_step_cost": cost}
    online_summary = None
    if not args.no_online:
        capacity = off["continuous_req_s"]
        fractions = [0.25, 1.0] if args.quick else [0.25, 0.5, 1.0]
        rates = [f * capacity for f in fractions] + [math.inf]
        print(f"\n(b) online, Poisson arrivals (offline capacity {capacity:.1f} req/s)")
        rows = online(work, rates, args.batch, args.model)
        results["online"] = rows
        print(
            "  rate req/s | done req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 | "
            "ITL p50/p99 | E2E p50/p99"
        )
        for r in rows:
            print(
                f"  {r['rate']:10.1f} | {r['req_s']:10.1f} | {r['output_tok_s']:9.0f} | "
                + " | ".join(
                    f"{ms(r[k]['p50'])}/{ms(r[k]['p99'])}" for k in ("ttft", "tpot", "itl", "e2e")
                )
            )
        best = max(rows, key=lambda r: r["output_tok_s"])
        low = rows[0]
        online_summary = (
            f"SUMMARY serving-online: at {low['rate']:.1f} req/s TTFT p50 {ms(low['ttft']['p50'])}"
            f" ms, TPOT p50 {ms(low['tpot']['p50'])} ms; peak {best['output_tok_s']:.0f} "
            f"out tok/s ({best['req_s']:.1f} req/s) with TTFT p99 {ms(best['ttft']['p99'])} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    print(summary)
    if online_summary:
        print(online_summary)


if __name__ == "__main__":
    main()
