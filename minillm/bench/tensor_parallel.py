"""Chapter 09's tensor-parallel measurement (`python -m benchmarks.tensor_parallel`): batch-1
decode of a TinyLlama-1.1B-shaped model (random weights: speed depends on shapes) on one
rank and on two, one thread a rank, both loaded side by side and timed in turn in every
round, with what the collectives cost a step and the read bandwidth of one core and of two,
measured in the same rounds.

Why it pays on a CPU at all: a batch-1 decode step streams every weight once, so it runs
at the speed memory feeds the cores. Two ranks each stream half the weights, each on its
own core; if two cores read (nearly) twice as fast as one, the step takes (nearly) half the
time, plus the all-reduces. The speed-up's ceiling is the ratio of the two bandwidths.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minillm.engine.parallel import TensorParallel
from minillm.engine.worker import CacheSettings, Step, Worker
from minillm.lab import measure_roofline
from minillm.lab.claims import span
from minillm.lab.ranks import free_port
from minillm.model.parallel import Collectives, CommStats, SharedMemoryCollectives
from minillm.model.shapes import write_random_checkpoint
from minillm.model.weights import load_model

SHAPE = "TinyLlama-1.1B"
BLOCK = 16


def _decode(
    worker: Worker | TensorParallel, context: int, steps: int
) -> tuple[list[float], CommStats]:
    """Seconds of each of `steps` batch-1 decode steps after a `context`-token prompt
    (written into blocks 0.. of a fresh sequence each call), and what their collectives
    cost rank 0 (all zero on one rank)."""
    table = list(range(-(-(context + steps) // BLOCK)))
    prompt = [(7 * i) % 4000 + 10 for i in range(context)]
    worker.execute(Step(prompt, list(range(context)), [context - 1], [], [(table, context)]))
    stats = worker.comm.stats if isinstance(worker, TensorParallel) else CommStats()
    before, times = dataclasses.replace(stats), []
    for pos in range(context, context + steps):
        start = time.perf_counter()
        worker.execute(Step([11], [pos], [0], [table]))
        times.append(time.perf_counter() - start)
    spent = CommStats(
        stats.calls - before.calls, stats.bytes - before.bytes, stats.seconds - before.seconds
    )
    return times, spent


def _collective_latency(rank: int, size: int, port: int, path: str, calls: int, out: Any) -> None:
    """One rank of the all-reduce latency test: `calls` all-reduces of one decode token's
    hidden state (2048 floats) back to back, through gloo and through shared memory."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    x = torch.randn(1, 1, 2048)
    latency = {}
    for name, comm in (
        ("gloo", Collectives()),
        ("shared memory", SharedMemoryCollectives(path, rank, size, 60)),
    ):
        for _ in range(calls // 10):
            comm.all_reduce(x)
        start = time.perf_counter()
        for _ in range(calls):
            comm.all_reduce(x)
        latency[name] = (time.perf_counter() - start) / calls
    out.put((rank, latency))
    dist.destroy_process_group()


def collective_latency(calls: int = 2000, size: int = 2) -> dict[str, float]:
    """Seconds per all-reduce of a decode token's hidden state on `size` ranks (their own
    processes), gloo and shared memory in turn, as rank 0 measures it."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "shm")
        SharedMemoryCollectives.create(path, size)
        out, port = ctx.Queue(), free_port()
        procs = [
            ctx.Process(target=_collective_latency, args=(r, size, port, path, calls, out))
            for r in range(size)
        ]
        for proc in procs:
            proc.start()
        got = dict(out.get(timeout=300) for _ in procs)
        for proc in procs:
            proc.join(30)
    return got[0]


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a 512 MiB sum with `threads` threads (then back to one)."""
    torch.set_num_threads(threads)
    try:
        return measure_roofline("cpu", matmul_size=256, copy_bytes=512 * 2**20).read_bytes_per_s
    finally:
        torch.set_num_threads(1)


def run(
    work: Path, layers: int | None = None, rounds: int = 5, steps: int = 16, context: int = 128
) -> dict[str, Any]:
    """The measurement; `layers` (None: TinyLlama's 22) shortens the model for a quick run."""
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model_dir = write_random_checkpoint(SHAPE, work / "model", dtype=torch.bfloat16, **overrides)
    torch.set_num_threads(1)
    settings = CacheSettings(num_blocks=-(-(context + steps) // BLOCK) + 1, block_size=BLOCK)
    whole = load_model(model_dir)
    weight_bytes = sum(p.nbytes for p in whole.parameters())
    one = Worker(whole, settings)
    two = TensorParallel(model_dir, 2, torch.float32, "cpu")
    two.attach(Worker(two.model, settings), settings)
    samples: dict[str, list[float]] = {"TP=1": [], "TP=2": []}
    comm: list[dict[str, float]] = []
    bandwidth: dict[str, list[float]] = {"1 core": [], "2 cores": []}
    try:
        _decode(one, context, 2), _decode(two, context, 2)  # warm-up
        for r in tqdm(range(rounds), desc="rounds"):
            order = ["TP=1", "TP=2"] if r % 2 == 0 else ["TP=2", "TP=1"]
            for name in order:
                step_times, spent = _decode(one if name == "TP=1" else two, context, steps)
                samples[name].append(statistics.median(step_times))
                if name == "TP=2":
                    comm.append(
                        {
                            "calls_per_step": spent.calls / steps,
                            "bytes_per_step": spent.bytes / steps,
                            "ms_per_step": 1e3 * spent.seconds / steps,
                            "share": spent.seconds / sum(step_times),
                        }
                    )
            bandwidth["1 core"].append(read_bandwidth(1))
            bandwidth["2 cores"].append(read_bandwidth(2))
    finally:
        two.close()
    latency = collective_latency()
    ratios = [a / b for a, b in zip(samples["TP=1"], samples["TP=2"], strict=True)]
    bw_ratio = [b / a for a, b in zip(bandwidth["1 core"], bandwidth["2 cores"], strict=True)]
    # TP=2 at best streams at the two cores' bandwidth; TP=1 streams at what one rank reached
    ceiling = [
        b * s / weight_bytes for b, s in zip(bandwidth["2 cores"], samples["TP=1"], strict=True)
    ]
    return {
        "model": f"{SHAPE} shape, random weights, {whole.config.num_hidden_layers} layers, fp32",
        "weight_bytes": weight_bytes,
        "context": context,
        "rounds": rounds,
        "steps_per_round": steps,
        "step_ms": {k: [1e3 * v for v in vs] for k, vs in samples.items()},
        "tok_s": {k: [1 / v for v in vs] for k, vs in samples.items()},
        "speedup": ratios,
        "collectives": comm,  # rank 0's time inside them, waiting for rank 1 included
        "all_reduce_latency_us": {k: 1e6 * v for k, v in latency.items()},
        "read_bandwidth_gb_s": {k: [v / 1e9 for v in vs] for k, vs in bandwidth.items()},
        "bandwidth_ratio": bw_ratio,
        "speedup_ceiling": ceiling,
        # the share of each bound: bytes a step streams / (its time x the bandwidth it had)
        "of_bound": {
            "TP=1": [
                weight_bytes / (s * b)
                for s, b in zip(samples["TP=1"], bandwidth["1 core"], strict=True)
            ],
            "TP=2": [
                weight_bytes / (s * b)
                for s, b in zip(samples["TP=2"], bandwidth["2 cores"], strict=True)
            ],
        },
    }


def print_result(r: dict[str, Any]) -> None:
    ms, pct, gbs = (lambda v: f"{v:.0f}"), (lambda v: f"{v:.0%}"), (lambda v: f"{v:.1f}")
    print(f"{r['model']}: {r['weight_bytes'] / 1e9:.2f} GB of weights, context {r['context']}")
    for name in ("TP=1", "TP=2"):
        print(
            f"  {name}: {span(r['tok_s'][name], gbs)} tok/s ({span(r['step_ms'][name], ms)} ms "
            f"a step), {span(r['of_bound'][name], pct)} of its read-bandwidth bound"
        )
    c, lat = r["collectives"], r["all_reduce_latency_us"]
    share = span([x["share"] for x in c], lambda v: f"{v:.1%}")
    print(
        f"  TP=2 / TP=1: {span(r['speedup'])}; collectives: {c[0]['calls_per_step']:.0f} a "
        f"step, {c[0]['bytes_per_step'] / 1e3:.0f} kB, {span([x['ms_per_step'] for x in c], gbs)}"
        f" ms = {share} of a step (waiting for the other rank included)"
    )
    print(
        f"  one all-reduce of a token's hidden state, back to back: shared memory "
        f"{lat['shared memory']:.0f} us, gloo {lat['gloo']:.0f} us"
    )
    bw = r["read_bandwidth_gb_s"]
    print(
        f"  read bandwidth: 1 core {span(bw['1 core'], gbs)} GB/s, 2 cores "
        f"{span(bw['2 cores'], gbs)} GB/s (ratio {span(r['bandwidth_ratio'])}); TP=2's ceiling, "
        f"two cores' bandwidth over TP=1's streaming rate: {span(r['speedup_ceiling'])}"
    )
