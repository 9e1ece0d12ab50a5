"""Chapter 08's batching measurements: continuous batching vs static batching vs HF
`generate` offline (`offline`), why the gain is what it is (`decode_step_cost`,
`batching_model`), vLLM against minillm on a GPU (`vllm_compare`), and the online run over
HTTP (`online`, from `minillm.bench.http_load`). `python -m benchmarks.serving` runs them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from minillm.bench.http_load import free_port, online, poisson_run, start_server, wait_until_up
from minillm.bench.metrics import percentiles
from minillm.bench.workload import SEED, make_workload
from minillm.engine import Engine, RequestOutput
from minillm.generation import greedy_params
from minillm.lab import paired_ratios, time_samples
from minillm.model import BUNDLED_DIR, load_model, load_tokenizer
from minillm.model.weights import resolve_model_dir
from minillm.training import first_divergence

__all__ = [  # the notebooks' `bench.NAME`: this module's own and the online run's
    "batching_model",
    "decode_step_cost",
    "engine_latencies",
    "free_port",
    "hf_model",
    "make_workload",
    "offline",
    "online",
    "poisson_run",
    "run_engine",
    "run_hf",
    "slot_utilisation",
    "start_server",
    "step_tokens",
    "vllm_compare",
    "wait_until_up",
]

Work = list[tuple[list[int], int]]  # (prompt ids, output length) per request


# ------------------------------------------------------------------------ (a) offline
def run_engine(
    model: Any,
    tokenizer: Any,
    work: Work,
    batch: int = 32,
    static: bool = False,
    trace: bool = False,
) -> tuple[list[RequestOutput], Engine]:
    """Run the workload to completion; (outputs in order, engine) for inspection."""
    engine = Engine(model, tokenizer, max_num_seqs=batch, static=static)
    engine.trace = [] if trace else None
    for prompt, n in work:
        engine.add_request(prompt, greedy_params(n, output_kind="final_only"))  # no per-step copies
    return engine.run_to_completion(), engine


def vllm_compare(work: Work | None = None, model_dir: str | None = None) -> dict[str, Any]:
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
) -> Any:
    """A checkpoint in transformers (None: the bundled one; or a name such as smollm2, or
    a directory), for the `generate` baseline."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dtype)
    return hf.to(device).eval()


@torch.inference_mode()
def run_hf(model: Any, work: Work, batch: int = 32, pad_id: int = 0) -> list[list[int]]:
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


def decode_step_cost(
    model: Any, tokenizer: Any, sizes: tuple[int, ...] = (1, 4, 16, 32), repeats: int = 20
) -> dict[str, dict[str, float]]:
    """Seconds of one engine decode step with B running sequences (32-token prompts),
    relative to B = 1, interleaved: how much a bigger batch costs per step on this
    machine. Batching pays when this grows much slower than B."""
    engines = {}
    for b in sizes:
        engine = Engine(model, tokenizer, max_num_seqs=b)
        for i in range(b):
            engine.add_request([(7 * i + j) % 4000 + 1 for j in range(32)], greedy_params(200))
        engine.step()  # the prefill
        engines[b] = engine
    fns = {f"B={b}": engines[b].step for b in sizes}
    samples = time_samples(fns, repeats=repeats, warmup=2)
    return {
        "seconds": {k: statistics.median(v) for k, v in samples.items()},
        "relative": paired_ratios(samples, f"B={sizes[0]}"),
    }


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


def offline(
    model: Any, tokenizer: Any, work: Work, batch: int = 32, repeats: int = 3, hf: Any = None
) -> dict[str, Any]:
    """Continuous vs static batching (and HF `generate` given `hf`) on the same requests, timed
    interleaved: throughput, the paired time ratios, steps, slot utilisation, latencies."""
    results: dict[str, Any] = {}

    def continuous() -> None:
        results["continuous"] = run_engine(model, tokenizer, work, batch, trace=True)

    def static() -> None:
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
