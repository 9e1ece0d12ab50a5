"""Chapter 03's ONNX Runtime measurements: one model's decoder-step graph exported in fp32
and int8 (`export`), its file sizes and node counts per ORT level, prefill and decode
speed against PyTorch eager on the same inputs (`phase_fns`, `speed`) and int8's quality
(`quality`); `run_model` does all of it. `python -m benchmarks.onnx_runtime` runs it per
model and says what each part measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.bench.workload import SEED
from minillm.cache import KVCache
from minillm.export.onnx import export_decoder_step
from minillm.export.onnx_checks import op_counts
from minillm.export.onnx_runtime import (
    LEVELS,
    OrtDecoder,
    ort_logits_fn,
    ort_session,
    quantize_int8,
)
from minillm.lab import format_bytes, paired_ratios, time_samples
from minillm.model import Tokenizer, Transformer, load_tokenizer, save_model
from minillm.training import factbook_ids, held_out_ids, next_token_agreement, perplexity

EAGER = "torch eager"


def export(model: Transformer, out_dir: Path) -> dict[str, Path]:
    """The decoder-step graph in fp32 and int8, plus the .pt and safetensors files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32 = export_decoder_step(model, out_dir / "step.onnx")
    paths = {"onnx": fp32, "onnx int8": quantize_int8(fp32, out_dir / "step_int8.onnx")}
    torch.save(model.state_dict(), out_dir / "model.pt")
    paths["pt"] = out_dir / "model.pt"
    paths["safetensors"] = save_model(model, out_dir / "hf") / "model.safetensors"
    return paths


def file_sizes(paths: dict[str, Path]) -> dict[str, int]:
    """Bytes of each file, keyed as in `export` (pt, safetensors, onnx, onnx int8)."""
    return {k: paths[k].stat().st_size for k in ("pt", "safetensors", "onnx", "onnx int8")}


def node_counts(path: Path, out_dir: Path) -> dict[str, int]:
    """Nodes in the graph ORT runs at each optimisation level."""
    counts = {}
    for level in LEVELS:
        saved = out_dir / f"step_{level}.onnx"
        ort_session(path, level, optimized_path=saved)
        counts[level] = sum(op_counts(saved).values())
    return counts


def sessions(paths: dict[str, Path], threads: int) -> dict[str, Any]:
    """One ORT session per level for the fp32 graph, and int8 at level ALL."""
    out = {f"ORT {level}": ort_session(paths["onnx"], level, threads) for level in LEVELS}
    out["ORT int8"] = ort_session(paths["onnx int8"], "all", threads)
    return out


def phase_fns(
    model: Transformer, sess: dict[str, Any], prefill: int, past: int, steps: int = 8
) -> dict[str, dict[str, Callable[[], Any]]]:
    """Callables for one prefill of `prefill` tokens, and for `steps` decode steps (each
    the same step after `past` tokens: a single one is too short to time reliably),
    batch 1, same token ids for every variant. Each returns its (last) logits."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (1, max(prefill, past + 1)), generator=g)
    pre, ctx, last = ids[:, :prefill], ids[:, :past], ids[:, past : past + 1]
    pos = torch.tensor([[past]])
    cache = KVCache(model.config, 1, max(prefill, past + 1))
    with torch.inference_mode():
        cache.kv_len = past
        model(ctx, cache=cache)
    cache.kv_len = past + 1

    @torch.inference_mode()
    def eager_prefill() -> torch.Tensor:
        cache.kv_len = prefill
        out = model(pre, cache=cache)[:, -1]
        cache.kv_len = past + 1
        return out

    @torch.inference_mode()
    def eager_decode() -> torch.Tensor:
        for _ in range(steps):  # each step rewrites slot `past`: the same work every time
            out = model(last, pos, cache=cache)[:, -1]
        return out

    fns: dict[str, dict[str, Callable[[], Any]]] = {
        "prefill": {EAGER: eager_prefill},
        "decode": {EAGER: eager_decode},
    }
    pre_np = pre.numpy()
    pre_mask = np.ones_like(pre_np)
    step_ids, step_pos = last.numpy(), pos.numpy()
    step_mask = np.ones((1, past + 1), np.int64)
    for name, session in sess.items():
        dec = OrtDecoder(session)
        ctx_np = ctx.numpy()
        _, past_kv = dec.step(
            ctx_np, np.arange(past)[None], np.ones_like(ctx_np), dec.empty_past(1)
        )
        empty = dec.empty_past(1)

        def ort_prefill(dec=dec, empty=empty) -> Any:
            return dec.step(pre_np, pre_mask.cumsum(1) - 1, pre_mask, empty)[0]

        def ort_decode(dec=dec, past_kv=past_kv) -> Any:
            for _ in range(steps):
                out = dec.step(step_ids, step_pos, step_mask, past_kv)[0]
            return out

        fns["prefill"][name], fns["decode"][name] = ort_prefill, ort_decode
    return fns


def check_outputs(fns: dict[str, dict[str, Callable[[], Any]]]) -> dict[str, float]:
    """Largest |logit - eager logit| of each fp32 variant, over both phases."""
    worst: dict[str, float] = {}
    for phase in fns.values():
        ref = phase[EAGER]().numpy()
        for name, fn in phase.items():
            if name not in (EAGER, "ORT int8"):
                diff = float(np.abs(np.asarray(fn())[:, -1] - ref).max())
                worst[name] = max(worst.get(name, 0.0), diff)
    return worst


def speed(
    fns: dict[str, dict[str, Callable[[], Any]]], repeats: int, warmup: int = 3
) -> dict[str, dict[str, float]]:
    """Per phase: each variant's speed-up over eager (eager time / its time, paired
    median over rounds in which all variants ran in alternation)."""
    out = {}
    for phase, phase_fns_ in fns.items():
        samples = time_samples(phase_fns_, repeats=repeats, warmup=warmup)
        ratios = paired_ratios(samples, EAGER)
        out[phase] = {name: 1 / r for name, r in ratios.items()}
        out[phase + "_ms"] = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
    return out


def quality(
    model: Transformer,
    paths: dict[str, Path],
    max_windows: int,
    tokenizer: Tokenizer | None = None,
    window: int | None = None,
) -> dict[str, Any]:
    """Held-out perplexity (PyTorch, ORT fp32, ORT int8) and int8's next-token agreement
    with ORT fp32, per corpus: the held-out KJV for the bundled model (its own tokenizer,
    the default), and the CIA World Factbook too for a model with a chat template (a real
    English model). `window` defaults to the model's context, at most 256 tokens."""
    tok = tokenizer or load_tokenizer()
    corpora = {"kjv": held_out_ids(tok)}
    if tok.chat_template is not None:
        corpora = {"factbook": factbook_ids(tok), **corpora}
    window = window or min(model.config.max_position_embeddings, 256)
    fp32 = ort_logits_fn(ort_session(paths["onnx"]))
    int8 = ort_logits_fn(ort_session(paths["onnx int8"]))
    kw = dict(window=window, batch_size=4, max_windows=max_windows)
    out: dict[str, Any] = {"tokens": max_windows * window, "window": window}
    for name, ids in corpora.items():
        out[name] = {
            "ppl_torch": perplexity(model, ids, **kw),
            "ppl_ort_fp32": perplexity(fp32, ids, **kw),
            "ppl_ort_int8": perplexity(int8, ids, **kw),
            "agreement_int8": next_token_agreement(fp32, int8, ids, **kw),
        }
    return out


def run_model(
    name: str,
    model: Transformer,
    out_dir: Path,
    prefill: int,
    past: int,
    threads: int,
    repeats: int,
    max_windows: int | None,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Every part on one model, its files written to `out_dir`: sizes, node counts, the
    fp32 graphs' largest logit difference, speed, and quality when `max_windows`; printed."""
    t0 = time.perf_counter()
    paths = export(model, out_dir)
    result: dict[str, Any] = {"model": name, "params": model.num_parameters()}
    result["export_s"] = time.perf_counter() - t0
    result["sizes"] = file_sizes(paths)
    result["nodes"] = node_counts(paths["onnx"], out_dir)
    fns = phase_fns(model, sessions(paths, threads), prefill, past)
    result["max_abs_diff"] = check_outputs(fns)
    result["speed"] = speed(fns, repeats)
    if max_windows:
        result["quality"] = quality(model, paths, max_windows, tokenizer)
    result["prefill"], result["past"] = prefill, past
    print_result(result)
    return result


def print_result(r: dict[str, Any]) -> None:
    """`run_model`'s result, part by part: (a) sizes, (b) nodes, (c) speed, (d) quality."""
    print(f"\n== {r['model']}: {r['params']:,} parameters (export + int8: {r['export_s']:.0f} s)")
    sizes = r["sizes"]
    print("(a) file sizes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in sizes.items()))
    print(f"    .onnx / .safetensors = {sizes['onnx'] / sizes['safetensors']:.2f}x, ", end="")
    print(f".onnx / .pt = {sizes['onnx'] / sizes['pt']:.2f}x, int8 / fp32 .onnx = ", end="")
    print(f"{sizes['onnx int8'] / sizes['onnx']:.2f}x")
    print("(b) nodes ORT runs: " + ", ".join(f"{k} {v}" for k, v in r["nodes"].items()))
    worst = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_diff"].items())
    print(f"    max |logit - eager| (fp32 graphs): {worst}")
    print("(c) speed-up over eager (eager time / time; > 1 = faster), batch 1, same inputs")
    pre, dec = f"prefill {r['prefill']}", f"decode @{r['past']}"
    print(f"    {'variant':<16} {pre:>12} {dec:>12}")
    for name, ratio in r["speed"]["prefill"].items():
        print(f"    {name:<16} {ratio:>11.2f}x {r['speed']['decode'][name]:>11.2f}x")
    if "quality" in r:
        q = r["quality"]
        print(f"(d) held-out perplexity, {q['tokens']:,} tokens ({q['window']}-token windows)")
        for corpus in ("factbook", "kjv"):
            if corpus in q:
                c = q[corpus]
                print(
                    f"    {corpus:<9} torch {c['ppl_torch']:.3f}, "
                    f"ORT fp32 {c['ppl_ort_fp32']:.3f}, "
                    f"ORT int8 {c['ppl_ort_int8']:.3f} "
                    f"({c['ppl_ort_int8'] / c['ppl_ort_fp32'] - 1:+.1%}); int8 top-1 agreement "
                    f"with fp32 {c['agreement_int8']:.1%}"
                )
