"""Where minillm's serving time goes at batch C, measured in process with a server's settings
(one thread, no prefix cache, `ctx_per_slot` KV tokens a sequence): chapter 08's answer to
"why is llama.cpp faster here?". `python -m benchmarks.engine_profile` prints it, and so does
`python -m benchmarks.llama_cpp --server llama-server --profile` as its part (c).

Three numbers per batch size C: `minillm.lab.profile_split` of one decode `Engine.step`
(compute kernels / framework / Python, aten ops per step: the per-step overhead a C++
engine with a prebuilt graph does not pay); the share of that step the lm_head alone takes
(the largest matmul, timed interleaved with the step); and the share of an offline run of
the workload spent in prefill steps, during which minillm's running requests do not decode
(llama.cpp's server appends a new prompt's tokens to the running requests' batch instead).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

import torch

from minillm.engine import Engine
from minillm.generation import greedy_params
from minillm.lab import profile_split, time_samples
from minillm.model import load_model, load_tokenizer


def profile(
    model_dir: str | None,
    work: list[tuple[list[int], int]],
    sizes: list[int],
    threads: int = 1,
    ctx_per_slot: int = 256,
) -> dict[str, dict[str, float]]:
    """(c) Where minillm's time goes at batch C, in this process with the server's settings
    (threads, no prefix cache): `minillm.lab.profile_split` of a decode `Engine.step`
    (compute kernels / framework / Python, aten ops per step), the share of the step that the
    lm_head alone takes (timed interleaved with the step), the largest single matmul, and
    `prefill_share` of the workload."""
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    out = {}
    for c in sizes:
        blocks = c * -(-ctx_per_slot // 16)
        engine = Engine(model, tokenizer, max_num_seqs=c, num_blocks=blocks, prefix_cache=False)
        for prompt, _ in (work * c)[:c]:
            engine.add_request(prompt[:32], greedy_params(96))
        engine.step()  # the prefill
        split = profile_split(engine.step, repeats=8, warmup=2)
        hidden = torch.randn(c, model.config.hidden_size)
        with torch.inference_mode():
            head = functools.partial(model.lm_head, hidden)
            t = time_samples({"step": engine.step, "lm_head": head}, 8)
        lm_head = statistics.median(t["lm_head"]) / statistics.median(t["step"])
        prefill = prefill_share(model, tokenizer, work, c, ctx_per_slot)
        out[str(c)] = {**dataclasses.asdict(split), "lm_head_share": lm_head, **prefill}
        f = split.fractions()
        print(
            f"  C={c}: decode step {split.wall_s * 1e3:.1f} ms ({split.wall_s * 1e3 / c:.2f} ms "
            f"per token): compute kernels {f['compute kernels']:.0%}, framework "
            f"{f['framework (dispatch, views, alloc)']:.0%}, Python {f['Python']:.0%}; "
            f"{split.ops:.0f} aten ops; lm_head alone {lm_head:.0%} of a step. The workload "
            f"offline at batch {c}: {prefill['prefill_share']:.0%} of the time in prefill steps "
            f"({prefill['prefill_steps']} of {prefill['steps']} steps), "
            f"{prefill['output_tok_s']:.1f} out tok/s",
            flush=True,
        )
    return out


def prefill_share(
    model: Any,
    tokenizer: Any,
    work: list[tuple[list[int], int]],
    batch: int,
    ctx_per_slot: int = 256,
) -> dict[str, float]:
    """The whole workload through one `Engine` (all requests queued at once, no server): the
    share of the time spent in prefill steps (steps that compute prompt tokens)."""
    blocks = batch * -(-ctx_per_slot // 16)
    engine = Engine(model, tokenizer, max_num_seqs=batch, num_blocks=blocks, prefix_cache=False)
    engine.trace = []  # a StepRecord per step
    for prompt, n in work:
        engine.add_request(prompt, greedy_params(n))
    seconds = {True: 0.0, False: 0.0}
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        seconds[bool(engine.trace[-1].prefill_tokens)] += time.perf_counter() - start
    wall = sum(seconds.values())
    return {
        "prefill_share": seconds[True] / wall,
        "prefill_steps": sum(bool(r.prefill_tokens) for r in engine.trace),
        "steps": len(engine.trace),
        "output_tok_s": sum(n for _, n in work) / wall,
    }
