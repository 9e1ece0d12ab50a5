"""Chapter 09's pipeline-parallel measurement (`python -m benchmarks.pipeline_parallel`): a
TinyLlama-1.1B-shaped model (random weights: speed depends on shapes) served by the engine
on one rank and in two stages, one thread a rank, both loaded side by side and timed in
turn in every round:

- throughput: 16 and 64 concurrent requests run to completion, output tokens per second;
- latency: one request alone, milliseconds between its tokens;
- rank 0's wait for rank 1 (to take a step, or to hand one back), one core's matmul rate
  by rows, the read bandwidth of one core and of two.

When it pays: a lone request's step runs the stages one after the other, so it takes as
long as on one rank, plus the hop. With many requests the engine keeps two steps in flight,
each with half of them, and the two cores work at once. But each stage's matmuls then have
half the rows, and a CPU matmul of few rows runs well below its peak: two cores at 8 rows
do little more than one core at 16. The speed-up's ceiling is two cores' rate at half the
rows over one core's at all of them, measured here for each concurrency.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minillm.bench.tensor_parallel import read_bandwidth
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import Engine
from minillm.engine.parallel import PipelineParallel
from minillm.generation.sampling import SamplingParams
from minillm.lab.claims import span
from minillm.model.config import ModelConfig
from minillm.model.pipeline import stage_layers
from minillm.model.shapes import write_random_checkpoint
from minillm.model.weights import load_config, load_model, load_tokenizer

SHAPE = "TinyLlama-1.1B"


def _throughput(engine: Engine, requests: int, prompt: int, tokens: int) -> tuple[float, int]:
    """Seconds to run `requests` requests of `prompt` tokens and `tokens` output tokens
    each, all submitted at once, and the output tokens they made."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for r in range(requests):
        engine.add_request([(31 * r + 7 * i) % 4000 + 10 for i in range(prompt)], params)
    start = time.perf_counter()
    outputs = engine.run_to_completion()
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def _latency(engine: Engine, prompt: int, tokens: int) -> float:
    """Median seconds between the tokens of one request alone."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request([(7 * i) % 4000 + 10 for i in range(prompt)], params)
    times = engine.run_to_completion()[0].metrics.token_times
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def matmul_rate(rows: int, cfg: ModelConfig, calls: int = 30) -> float:
    """FLOP/s of one thread multiplying `rows` hidden states by an MLP weight of `cfg`
    (its gate projection), as a decode step does."""
    weight = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    x = torch.randn(rows, cfg.hidden_size)
    for _ in range(3):
        F.linear(x, weight)
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(x, weight)
    return 2 * rows * weight.numel() * calls / (time.perf_counter() - start)


def run(
    work: Path,
    layers: int | None = None,
    rounds: int = 5,
    concurrency: tuple[int, ...] = (16, 64),
    prompt: int = 4,
    tokens: int = 8,
) -> dict[str, Any]:
    """The measurement; `layers` (None: TinyLlama's 22) shortens the model for a quick run."""
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model_dir = write_random_checkpoint(SHAPE, work / "model", dtype=torch.bfloat16, **overrides)
    torch.set_num_threads(1)
    most = max(concurrency)
    config = EngineConfig(max_num_seqs=most, num_blocks=most * 2 + 2, block_size=16)
    tokenizer, cfg = load_tokenizer(model_dir), load_config(model_dir)
    whole = load_model(model_dir)
    weight_bytes = sum(p.nbytes for p in whole.parameters())
    one = Engine(whole, tokenizer, config)
    ranks = PipelineParallel(model_dir, 2, torch.float32, "cpu")
    two = Engine(ranks.model, tokenizer, config, parallel=ranks)
    engines = {"PP=1": one, "PP=2": two}
    tok_s = {c: {"PP=1": [], "PP=2": []} for c in concurrency}
    latency: dict[str, list[float]] = {"PP=1": [], "PP=2": []}
    waited: list[float] = []
    bandwidth: dict[str, list[float]] = {"1 core": [], "2 cores": []}
    rows = sorted({r for c in concurrency for r in (c, -(-c // 2))})  # PP=1's and a stage's
    rates: dict[int, list[float]] = {r: [] for r in rows}
    try:
        for engine in engines.values():  # warm-up
            _throughput(engine, 2, prompt, 2)
        for r in tqdm(range(rounds), desc="rounds"):
            for name in ["PP=1", "PP=2"] if r % 2 == 0 else ["PP=2", "PP=1"]:
                engine, before = engines[name], ranks.waited_s
                start = time.perf_counter()
                for c in concurrency:
                    seconds, made = _throughput(engine, c, prompt, tokens)
                    tok_s[c][name].append(made / seconds)
                if name == "PP=2":
                    waited.append((ranks.waited_s - before) / (time.perf_counter() - start))
                latency[name].append(_latency(engine, prompt, tokens))
            bandwidth["1 core"].append(read_bandwidth(1))
            bandwidth["2 cores"].append(read_bandwidth(2))
            for n in rows:
                rates[n].append(matmul_rate(n, cfg))
    finally:
        two.close()
    ratio = lambda a, b: [y / x for x, y in zip(a, b, strict=True)]  # noqa: E731
    return {
        "model": f"{SHAPE} shape, random weights, {cfg.num_hidden_layers} layers, fp32",
        "weight_bytes": weight_bytes,
        "stages": stage_layers(cfg, 2),
        "prompt_tokens": prompt,
        "output_tokens": tokens,
        "rounds": rounds,
        "output_tok_s": {str(c): v for c, v in tok_s.items()},
        "speedup": {str(c): ratio(v["PP=1"], v["PP=2"]) for c, v in tok_s.items()},
        "batch1_ms_per_token": {k: [1e3 * v for v in vs] for k, vs in latency.items()},
        "batch1_latency_ratio": ratio(latency["PP=1"], latency["PP=2"]),
        "rank0_waiting_share": waited,  # of the PP=2 runs' wall time
        "read_bandwidth_gb_s": {k: [v / 1e9 for v in vs] for k, vs in bandwidth.items()},
        "bandwidth_ratio": ratio(bandwidth["1 core"], bandwidth["2 cores"]),
        "matmul_gflop_s": {str(n): [v / 1e9 for v in vs] for n, vs in rates.items()},
        # two cores each multiplying half the rows, against one core multiplying all of them
        "compute_ceiling": {
            str(c): [2 * h / f for f, h in zip(rates[c], rates[-(-c // 2)], strict=True)]
            for c in concurrency
        },
    }


def print_result(r: dict[str, Any]) -> None:
    one, pct = (lambda v: f"{v:.1f}"), (lambda v: f"{v:.0%}")
    (a, b), (c, d) = r["stages"]
    print(
        f"{r['model']}: {r['weight_bytes'] / 1e9:.2f} GB of weights; PP=2 stages: layers "
        f"{a}-{b - 1} on rank 1, {c}-{d - 1} and the LM head on rank 0; requests of "
        f"{r['prompt_tokens']} prompt and {r['output_tokens']} output tokens"
    )
    rates = r["matmul_gflop_s"]
    for n, tok_s in r["output_tok_s"].items():
        half = str(-(-int(n) // 2))
        print(
            f"  {n} concurrent: PP=1 {span(tok_s['PP=1'], one)}, PP=2 {span(tok_s['PP=2'], one)} "
            f"output tok/s, PP=2 / PP=1 {span(r['speedup'][n])}; ceiling (two cores at {half} "
            f"rows over one at {n}) {span(r['compute_ceiling'][n])}"
        )
    ms = r["batch1_ms_per_token"]
    print(
        f"  one request alone: PP=1 {span(ms['PP=1'], one)} ms a token, PP=2 "
        f"{span(ms['PP=2'], one)} ({span(r['batch1_latency_ratio'])}); rank 0 waited for "
        f"rank 1 {span(r['rank0_waiting_share'], pct)} of the PP=2 runs"
    )
    print(
        "  one core's matmul with an MLP weight, GFLOP/s by rows: "
        + ", ".join(f"{n}: {span(v, one)}" for n, v in rates.items())
    )
    bw = r["read_bandwidth_gb_s"]
    print(
        f"  read bandwidth: 1 core {span(bw['1 core'], one)} GB/s, 2 cores "
        f"{span(bw['2 cores'], one)} GB/s (ratio {span(r['bandwidth_ratio'])})"
    )
