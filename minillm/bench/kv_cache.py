"""Chapter 02 benchmark: what the KV cache buys, measured on this machine (the command line
is `python -m benchmarks.kv_cache`). Four parts, in three modules, all importable from here:

(a) one generation step with and without the cache, and whole generations, measured and
    predicted from fitted per-step costs; (b) the cache's bytes per token and what
    grouped-query attention saves: `minillm.bench.kv_costs`.
(c) minillm `generate` vs transformers `generate(use_cache=True / False)`: here.
(d) batch-1 cached decode against the read-bandwidth roofline: `minillm.bench.roofline`.

Every speed figure is a ratio of calls timed in alternation in the same run, or a fraction
of a ceiling measured in the same run: absolute times on a shared machine are noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from minillm.bench.kv_costs import (
    KV_SHAPES,
    cached_step_sweep,
    end_to_end,
    fit_poly,
    gqa_table,
    kv_allocation_check,
    kv_bytes_per_token,
    long_context_model,
    poly,
    predicted_totals,
    print_e2e,
    print_gqa,
    print_steps,
    random_ids,
    step_costs,
    step_fns,
)
from minillm.bench.roofline import (
    COMPILED,
    compiled_step_fn,
    decode_roofline,
    matvec_fn,
    print_roofline,
)
from minillm.generation import generate, greedy_params
from minillm.lab import paired_ratios, time_samples
from minillm.model import Tokenizer, Transformer, load_model, load_tokenizer
from minillm.model.layout import decode_layout
from minillm.model.weights import resolve_model_dir

__all__ = [
    "CHAT",
    "COMPILED",
    "KV_SHAPES",
    "PROMPT",
    "cached_step_sweep",
    "compare_hf",
    "compiled_step_fn",
    "decode_roofline",
    "end_to_end",
    "fit_poly",
    "gqa_table",
    "kv_allocation_check",
    "kv_bytes_per_token",
    "long_context_model",
    "matvec_fn",
    "poly",
    "predicted_totals",
    "print_e2e",
    "print_gqa",
    "print_hf",
    "print_roofline",
    "print_steps",
    "prompt_ids",
    "random_ids",
    "step_costs",
    "step_fns",
]

PROMPT = "And the LORD said unto Moses, Speak unto"  # the bundled model's (a KJV model)
CHAT = "Tell me about the history of Paris."  # a chat model's: a user message in its template


def prompt_ids(tok: Tokenizer) -> list[int]:
    """The benchmark prompt: a user message in the model's chat template, or for a model
    without one (the bundled KJV model) the plain `PROMPT`."""
    if tok.chat_template is None:
        return tok.encode(PROMPT)
    return tok.apply_chat_template([{"role": "user", "content": CHAT}])


# ----------------------------------------------------------- (c) minillm vs transformers


@torch.inference_mode()
def hf_greedy(hf: Any, prompt: list[int], n: int, use_cache: bool) -> list[int]:
    """transformers' `generate`, greedy: `n` new token ids after one unpadded prompt (on the
    model's device), with or without its KV cache."""
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        use_cache=use_cache,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def compare_hf(
    name: str | None = None,
    new_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 1,
    uncached: bool = True,
    layout: bool | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> dict[str, Any]:
    """`new_tokens` greedy tokens (EOS disabled on both sides) from `prompt_ids`: time of
    transformers' generate (use_cache=True, and False) relative to minillm's generate, on
    model `name` (None: the bundled model) in `dtype` on `device` ("auto": bf16 on a GPU, fp16
    on a T4, fp32 on a CPU). `layout` (default: on a CPU) adds minillm with `decode_layout`, the
    weights stored [in, out] for the matrix-vector products of decode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model, tok = load_model(name, dtype=dtype, device=device), load_tokenizer(name)
    weight = model.lm_head.weight
    layout = weight.device.type == "cpu" if layout is None else layout
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(name), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    hf.generation_config.eos_token_id = None  # generate exactly new_tokens, like ignore_eos
    ids = prompt_ids(tok)
    out: dict[str, list[int]] = {}

    def ours(m: Transformer, label: str) -> Callable[[], None]:
        def call() -> None:
            out[label] = generate(m, [ids], greedy_params(new_tokens))[0]

        return call

    def theirs(use_cache: bool) -> Callable[[], None]:
        def call() -> None:
            out[f"HF use_cache={use_cache}"] = hf_greedy(hf, ids, new_tokens, use_cache)

        return call

    fns = {"minillm": ours(model, "minillm")}
    if layout:
        fast = decode_layout(load_model(name, dtype=dtype, device=device))
        fns["minillm, decode layout"] = ours(fast, "layout")
    fns["HF use_cache=True"] = theirs(True)
    if uncached:
        fns["HF use_cache=False"] = theirs(False)
    samples = time_samples(fns, repeats=repeats, warmup=warmup)
    ratios = paired_ratios(samples, "minillm")
    same = all(out[k] == out["minillm"] for k in out)
    assert same, "minillm and transformers generated different tokens"
    assert len(out["minillm"]) == new_tokens
    return {
        "model": name or "bundled",
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "same_tokens": same,
        "time_ratio": ratios,  # time / minillm's time
        "tokens_per_s": {k: new_tokens / statistics.median(v) for k, v in samples.items()},
    }


def print_hf(r: dict[str, Any]) -> None:
    """The table of `compare_hf`: each generator's time relative to minillm's."""
    print(
        f"\n(c) {r['model']} ({r['dtype']}, {r['device']}), {r['prompt_tokens']}-token prompt, "
        f"{r['new_tokens']} new greedy tokens; same tokens: {r['same_tokens']}"
    )
    print(f"{'generator':<24} {'time / minillm':>15} {'tokens/s (this run)':>20}")
    for name, ratio in r["time_ratio"].items():
        print(f"{name:<24} {ratio:>14.2f}x {r['tokens_per_s'][name]:>20.1f}")
