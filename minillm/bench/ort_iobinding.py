"""Chapter 03's ONNX Runtime decoding as production runs it: every ORT variant's graph
(`export_graphs`), decode timed against the plain loop (`speed_fns`, `measure_context`),
ORT's profiler's split of a step (`step_splits`, `split_report`) and the runtimes' greedy
tokens and perplexity (`quality`). `python -m benchmarks.ort_iobinding` runs them; its
docstring (benchmarks/ort_iobinding.py) says what each variant is.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.export import ort_profile as prof
from minillm.export.onnx import export_decoder_step
from minillm.export.onnx_gqa import OrtGqaDecoder, export_gqa_step
from minillm.export.onnx_runtime import OrtDecoder, ort_logits_fn, ort_session
from minillm.export.onnx_static import OrtStaticDecoder, export_static_step
from minillm.export.ort_genai import GenaiDecoder, build_genai_model, genai_missing
from minillm.generation import SamplingParams, generate
from minillm.generation.cached import eager_decode_step, prefill
from minillm.lab import paired_ratios, time_samples
from minillm.model import (
    BUNDLED_DIR,
    Transformer,
    load_model,
    load_tokenizer,
    random_model,
    save_model,
)
from minillm.model.shapes import CONFIGS
from minillm.model.weights import load_config
from minillm.training import held_out_ids, perplexity

PLAIN, GENAI = "ORT loop (concat)", "ORT GenAI"
MINILLM = "minillm (PyTorch, KVCache)"
STATIC_REPEAT = "IOBinding, K/V repeated"  # the exporter's GQA: repeats K/V per query head
STATIC = "IOBinding, grouped"  # attention per kv head: no copy of the cache at all
STATIC_OPS = "IOBinding, opset-23 ops"  # RMSNormalization, RotaryEmbedding, Attention nodes
STATIC_GRAPHS = {STATIC_REPEAT: {"grouped": False}, STATIC: {}, STATIC_OPS: {"llm_ops": True}}
GQA = "IOBinding, GroupQueryAttention"  # ORT's contrib node: RoPE, cache write, attention
GQA_FUSED = "IOBinding, GQA + GenAI's fusions"  # packed q/k/v, Add + RMSNorm as one node
GQA_GRAPHS = {GQA: False, GQA_FUSED: True}  # variant: export_gqa_step's `fuse`


def speed_model(name: str) -> Transformer:
    """'bundled-1k', a shape of `minillm.model.shapes` (random weights), or anything
    `load_model` takes ('smollm2': the real weights; speed does not depend on them)."""
    if name == "bundled-1k":
        cfg = load_config(BUNDLED_DIR).to_hf() | {"max_position_embeddings": 1024}
        return random_model(cfg)
    if name in CONFIGS:
        return random_model(name)
    return load_model(name)


def plain_runner(session: Any, prompt: list[int], steps: int) -> Callable[[], Any]:
    """The plain loop after `prompt`: `steps` steps with a fixed token, from the same
    prefilled cache every call (past ++ new concatenated by the graph at each step)."""
    plain = OrtDecoder(session)
    _, pos0, mask0, past0 = plain.prefill([prompt])
    token = np.array([[7]], np.int64)

    def run_plain() -> Any:
        mask, past, pos = mask0, past0, pos0
        for _ in range(steps):
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            logits, past = plain.step(token, pos[:, None], mask, past)
            pos = pos + 1
        return logits

    return run_plain


def static_runner(session: Any, prompt: list[int], steps: int) -> Callable[[], Any]:
    """`OrtStaticDecoder` after `prompt`: the same steps, slots len(prompt).. rewritten
    in place every call."""
    context = len(prompt)
    static = OrtStaticDecoder(session, max_len=context + steps)
    static.allocate(1)
    smask = np.zeros((1, context + steps), np.int64)
    smask[:, :context] = 1
    static.step(np.array([prompt]), np.arange(context)[None], smask, np.arange(context))
    token = np.array([[7]], np.int64)

    def run_static() -> Any:
        mask = smask.copy()
        for i in range(steps):
            mask[:, context + i] = 1
            slot = np.array([context + i])
            logits = static.step(token, slot[None], mask, slot)
        return logits

    return run_static


def gqa_runner(session: Any, prompt: list[int], steps: int) -> Callable[[], Any]:
    """`OrtGqaDecoder` after `prompt`: the same steps, slots len(prompt).. rewritten in
    place every call (row 0 holds len(prompt) + i tokens before step i)."""
    context = len(prompt)
    gqa = OrtGqaDecoder(session, max_len=context + steps)
    gqa.allocate(1)
    gqa.step(np.array([prompt]), np.array([context - 1]), context)
    token = np.array([[7]], np.int64)

    def run_gqa() -> Any:
        for i in range(steps):
            logits = gqa.step(token, np.array([context + i]), context + i + 1)
        return logits

    return run_gqa


def speed_prompt(model: Transformer, context: int) -> list[int]:
    """The timed prompt: `context` random token ids (seeded)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, model.config.vocab_size, (context,), generator=g).tolist()


def export_graphs(model: Transformer, workdir: Path) -> dict[str, Path]:
    """Every ORT variant's graph of `model`, written to `workdir` and keyed by variant name
    (GENAI: its builder's directory, where onnxruntime-genai is installed). The graphs
    have dynamic sequence axes: one export serves every context."""
    graphs = {PLAIN: export_decoder_step(model, workdir / "step.onnx")}
    for i, (name, options) in enumerate(STATIC_GRAPHS.items()):
        graphs[name] = export_static_step(model, workdir / f"static{i}.onnx", **options)
    for name, fuse in GQA_GRAPHS.items():
        graphs[name] = export_gqa_step(model, workdir / f"gqa{int(fuse)}.onnx", fuse=fuse)
    if genai_missing() is None:
        graphs[GENAI] = _genai_build(model, workdir)
    return graphs


def speed_fns(
    model: Transformer, graphs: dict[str, Path], context: int, steps: int, threads: int
) -> dict[str, Callable[[], Any]]:
    """Each callable runs `steps` greedy-free decode steps (fixed token) after `context`:
    one per graph of `model` in `graphs` (`export_graphs`'s keys; GENAI optional), and
    minillm's own decode."""
    needed = [PLAIN, *STATIC_GRAPHS, *GQA_GRAPHS]
    if missing := [name for name in needed if name not in graphs]:
        raise ValueError(f"no graph for {missing}: export them with export_graphs(model, dir)")
    prompt = speed_prompt(model, context)
    fns = {PLAIN: plain_runner(ort_session(graphs[PLAIN], threads=threads), prompt, steps)}
    for name in STATIC_GRAPHS:
        fns[name] = static_runner(ort_session(graphs[name], threads=threads), prompt, steps)
    for name in GQA_GRAPHS:
        fns[name] = gqa_runner(ort_session(graphs[name], threads=threads), prompt, steps)

    with torch.inference_mode():
        cache, _, lengths = prefill(model, [prompt], steps)
    tokens = torch.full((1, 1), 7)

    @torch.inference_mode()
    def run_minillm() -> Any:
        cache.kv_len = context  # the same work every call: rewrite slots context.. again
        for i in range(steps):
            logits = eager_decode_step(model, cache, tokens, (lengths + i)[:, None])
        return logits

    fns[MINILLM] = run_minillm
    if GENAI in graphs:
        gen = GenaiDecoder(graphs[GENAI], threads)
        generator = gen.generator(prompt, context + steps + 1)

        def run_genai() -> Any:
            generator.rewind_to(context)
            for _ in range(steps):
                generator.generate_next_token()

        fns[GENAI] = run_genai
    return fns


def _genai_build(model: Transformer, workdir: Path) -> Path:
    hf = save_model(model, workdir / "hf")
    # The builder insists on tokenizer files (it copies them next to the graph); we
    # feed token ids, so the bundled tokenizer's files serve any random-weight shape.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_DIR / name, hf / name)
    return build_genai_model(hf, workdir / "genai", "fp32")


def step_splits(
    model: Transformer,
    graphs: dict[str, Path],
    workdir: Path,
    context: int,
    steps: int,
    threads: int,
    step_ms: dict[str, float],
) -> dict[str, prof.StepSplit]:
    """ORT's profiler on the plain loop and on IOBinding (grouped, and both
    GroupQueryAttention graphs) on `graphs` (`export_graphs`), profiles written to
    `workdir`: each step split by kind (`minillm.export.ort_profile`), the median of 2
    profiled calls of each, interleaved (a slow spell hits all the loops);
    `step_ms`: each one's step time measured without the profiler."""
    cfg = model.config
    slots = range(context, context + steps + 1)
    dims = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim)
    if any(d in slots for d in dims):
        raise ValueError(
            f"context {context}: a model dimension {dims} is among the slot counts "
            "the profile tells the sequence axis by; profile another context"
        )
    layer_k = cfg.num_key_value_heads * context * cfg.head_dim * model.lm_head.weight.element_size()
    prompt = speed_prompt(model, context)
    sessions, runs = {}, {}
    for name, runner in (
        (PLAIN, plain_runner),
        (STATIC, static_runner),
        *((name, gqa_runner) for name in GQA_GRAPHS),
    ):
        profile = workdir / f"profile{len(runs)}"
        sessions[name] = prof.profiled_session(graphs[name], threads, profile)
        runs[name] = runner(sessions[name], prompt, steps)
    for _ in range(3):  # a warm-up round, then 2 profiled ones, the loops interleaved
        for run in runs.values():
            run()
    return {
        name: prof.step_split(session, 2 * steps, layer_k, slots, step_ms[name])
        for name, session in sessions.items()
    }


def quality(workdir: Path, max_tokens: int = 32, windows: int = 8) -> dict[str, Any]:
    """Greedy tokens and held-out perplexity on the bundled model, each runtime."""
    model, tok = load_model(), load_tokenizer()
    prompts = [tok.encode(p) for p in ("In the beginning", "And the LORD said unto Moses")]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = OrtDecoder(ort_session(export_decoder_step(model, workdir / "q_step.onnx")))
    static = OrtStaticDecoder(
        ort_session(export_static_step(model, workdir / "q_static.onnx")), max_len=128
    )
    ref = generate(model, prompts, params)
    out: dict[str, Any] = {
        "tokens_equal": {
            PLAIN: plain.generate(prompts, params) == ref,
            STATIC: static.generate(prompts, params) == ref,
        }
    }
    for name, fuse in GQA_GRAPHS.items():
        path = export_gqa_step(model, workdir / f"q_gqa{int(fuse)}.onnx", fuse=fuse)
        gqa = OrtGqaDecoder(ort_session(path), 128)
        out["tokens_equal"][name] = gqa.generate(prompts, params) == ref
    ids = held_out_ids(tok)
    kw = {"window": 128, "max_windows": windows}
    out["ppl"] = {
        "minillm": perplexity(model, ids, **kw),
        PLAIN: perplexity(ort_logits_fn(plain.session), ids, **kw),
    }
    if genai_missing() is None:
        for precision in ("fp32", "int4"):
            gen = GenaiDecoder(
                build_genai_model(BUNDLED_DIR, workdir / f"genai_{precision}", precision)
            )
            name = f"{GENAI} {precision}"
            out["tokens_equal"][name] = gen.generate(prompts, max_tokens) == ref
            out["ppl"][name] = perplexity(gen.logits_fn(), ids, **kw)
    else:
        out["genai"] = genai_missing()
    return out


def split_report(splits: dict[str, prof.StepSplit], speedup: dict[str, float]) -> dict[str, Any]:
    """The profile's verdict at one context: the plain loop's cache-copy fraction f and
    1 / (1 - f), what removing the copies alone gains; c, copies and attention together,
    and 1 / (1 - c), the bound on any loop that keeps the other kernels; each split (ms
    per step, by kind and by op type)."""
    f, c = splits[PLAIN].copy_fraction, splits[PLAIN].cache_fraction
    out: dict[str, Any] = {"copy_fraction": f, "bound": prof.amdahl_bound(f)}
    out |= {"cache_fraction": c, "cache_bound": prof.amdahl_bound(c)}
    measured = (STATIC, STATIC_OPS, GQA, GQA_FUSED, GENAI)
    out["measured"] = {name: speedup[name] for name in measured if name in speedup}
    out["split_ms"] = {
        name: {**s.kinds, "outside kernels": s.outside, "step": s.step_ms}
        for name, s in splits.items()
    }
    out["by_op_ms"] = {name: s.by_op for name, s in splits.items()}
    return out


def measure_context(
    model: Transformer,
    graphs: dict[str, Path],
    workdir: Path,
    context: int,
    steps: int,
    threads: int,
    repeats: int,
    profile: bool = True,
) -> dict[str, Any]:
    """(a) each variant's speed-up over the plain loop after `context` tokens (`speed_fns`,
    interleaved rounds, paired ratios) and, with `profile`, (b) the profiler's verdict
    (`step_splits`, `split_report`) next to it."""
    fns = speed_fns(model, graphs, context, steps, threads)
    samples = time_samples(fns, repeats=repeats, warmup=2)
    del fns  # the sessions and caches of this context
    speedup = {name: 1 / r for name, r in paired_ratios(samples, PLAIN).items()}
    at: dict[str, Any] = {"speedup": speedup}
    if profile:
        step_ms = {n: 1e3 * statistics.median(t) / steps for n, t in samples.items()}
        splits = step_splits(model, graphs, workdir, context, steps, threads, step_ms)
        at |= split_report(splits, speedup)
    return at


def print_split(context: int, report: dict[str, Any]) -> None:
    """Part (b) at one context: each loop's step by kind, and the bounds next to the
    measured speed-ups (`split_report`'s result)."""
    print(f"\n(b) where a step goes at {context} (ORT profiler, ms per step, median step):")
    for name, kinds in report["split_ms"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in kinds.items() if k != "step")
        print(f"      {name:<34}{kinds['step']:6.1f} ms = {parts}")
    measured = ", ".join(f"{k} {v:.2f}x" for k, v in report["measured"].items())
    plain = report["split_ms"][PLAIN]  # the profiler inflates short kernels (StepSplit):
    if (kernels := sum(plain[kind] for kind in prof.KINDS)) > 1.2 * plain["step"]:
        print(f"    not reliable: the profiled kernels ({kernels:.2f} ms) outlast the step")
    print(
        f"    the plain loop's kernel time: cache copies {100 * report['copy_fraction']:.0f}% "
        f"(removing them alone gains at most {report['bound']:.2f}x, Amdahl), copies and "
        f"attention {100 * report['cache_fraction']:.0f}% (no loop that keeps the other "
        f"kernels beats {report['cache_bound']:.2f}x); measured {measured}"
    )
