"""Chapter 08's scheduling measurements: chunked prefill against long prompts arriving among
decodes (`chunked_prefill`: ITL p50/p99, throughput), and preemption by recompute vs swap on
a pool too small (`preemption`). `python -m benchmarks.scheduling` runs both.

Model: the bundled model's shapes with random weights and 4096 positions (speed depends on
shapes, not on what the weights learned; the bundled model's own context is 256 tokens).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from minillm.bench.metrics import percentiles
from minillm.bench.workload import SEED
from minillm.engine import Engine
from minillm.generation import greedy_params
from minillm.model import ModelConfig, random_model


def model_with_context(positions: int = 4096) -> Any:
    """The bundled model's shapes, random weights, `positions` positions and no EOS."""
    return random_model(ModelConfig(max_position_embeddings=positions, eos_token_id=None), SEED)


def long_prompt_mix(quick: bool) -> dict[str, Any]:
    """Eight 16-token decoders and 3 (quick) or 6 prompts of 1024 tokens, seeded."""
    rng = np.random.default_rng(SEED)
    decoders = [rng.integers(10, 4000, 16).tolist() for _ in range(8)]
    n_long = 3 if quick else 6
    longs = [rng.integers(10, 4000, 1024).tolist() for _ in range(n_long)]
    return {"decoders": decoders, "decode_tokens": 96 if quick else 192, "longs": longs}


def run_mix(
    model: Any, tok: Any, work: dict[str, Any], chunked: bool, budget: int
) -> dict[str, Any]:
    """Decoders start together; a long prompt joins every `gap` engine steps."""
    engine = Engine(model, tok, max_num_seqs=16, max_num_batched_tokens=budget,
                    chunked_prefill=chunked)  # fmt: skip
    ids = [
        engine.add_request(p, greedy_params(work["decode_tokens"], output_kind="final_only"))
        for p in work["decoders"]
    ]
    gap = work["decode_tokens"] // (len(work["longs"]) + 1)
    pending, step, t0 = list(work["longs"]), 0, time.perf_counter()
    seqs = {r: engine.requests[r].seqs[0] for r in ids}
    while engine.has_unfinished() or pending:
        if pending and step % gap == gap - 1:
            engine.add_request(pending.pop(0), greedy_params(8, output_kind="final_only"))
        engine.step()
        step += 1
    wall = time.perf_counter() - t0
    itl = [1e3 * d for s in seqs.values() for d in np.diff(s.token_times)]
    out_tokens = len(work["decoders"]) * work["decode_tokens"] + 8 * len(work["longs"])
    p = percentiles(itl)
    return {"itl_p50_ms": p["p50"], "itl_p99_ms": p["p99"], "tok_s": out_tokens / wall}


def chunked_prefill(model: Any, tok: Any, quick: bool, repeats: int, budget: int) -> dict[str, Any]:
    """Both policies on the same mix, interleaved `repeats` times: medians of `run_mix`."""
    work = long_prompt_mix(quick)
    runs: dict[str, list[dict]] = {"chunked": [], "unchunked": []}
    for _ in range(repeats):  # interleaved: a slow spell hits both policies alike
        for name in runs:
            runs[name].append(run_mix(model, tok, work, name == "chunked", budget))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    med["budget"] = budget
    return med


def preemption(model: Any, tok: Any, context: int, quick: bool) -> dict[str, Any]:
    """8 requests of `context` prompt tokens + 64 new ones on a pool that fits about 4."""
    rng = np.random.default_rng(SEED + context)
    prompts = [rng.integers(10, 4000, context).tolist() for _ in range(4 if quick else 8)]
    blocks = len(prompts) // 2 * -(-context // 16) + 2  # half the prompts fit, not their growth
    out = {"context": context}
    for mode in ("recompute", "swap"):
        engine = Engine(model, tok, num_blocks=blocks, max_num_seqs=8, preemption_mode=mode,
                        num_swap_blocks=8 * blocks)  # fmt: skip
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(p, greedy_params(64, output_kind="final_only"))
        engine.run_to_completion()
        wall = time.perf_counter() - t0
        out[mode] = {
            "tok_s": len(prompts) * 64 / wall,
            "prompt_tokens_computed": engine.num_prompt_tokens,
            "preemptions": engine.scheduler.num_preemptions,
        }
    return out
