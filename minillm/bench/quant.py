"""Chapter 06's weight formats side by side: the library baselines (bitsandbytes, torch.ao,
ONNX Runtime), a cached decode step to time, and the tables of `python -m benchmarks.quant`:
(a) quality, bytes and speed on the bundled model, (b) bytes and speed at SmolLM2-135M's
shapes. Part (d), the Q4_1 caveat, is in `minillm.bench.q4_1`."""

from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minillm.cache import KVCache
from minillm.export.quiet import quiet  # bitsandbytes and torch.ao too; notebook 06 uses it
from minillm.lab import format_bytes, time_ratios
from minillm.model import ModelConfig, Transformer, load_model, load_tokenizer
from minillm.model.shapes import SMOLLM2_135M
from minillm.model.transformer import rope_inv_freq
from minillm.quant import quantize_model, weight_bytes
from minillm.quant.linear import linear_names, use_cpu_kernels
from minillm.training import held_out_ids, next_token_agreement, perplexity

SEED = 0
WINDOW = 256
OURS = ["int8", "int8-tensor", "int4-g128", "int4sym-g128", "nf4-g128", "int4-g64", "int4sym-g64"]
OURS += ["nf4-g64", "nf4-g64-dq", "int4-g32", "nf4-g32"]
LIBRARIES = ["bnb-int8", "bnb-nf4-g64", "torch.ao-int8", "ort-int8"]
SPEED_BIG = ["bf16", "int8", "int4-g64", "nf4-g64", "torch.ao-int8", "bnb-int8", "bnb-nf4-g64"]
Progress = Callable[[list[str]], Iterable[str]]


# ---------------------------------------------------------------------- library models


def _kept(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """The linears a library quantizes: all but those ending in `keep`."""
    return [n for n in linear_names(model) if not n.endswith(keep)]


def bnb_model(model: Transformer, kind: str) -> Transformer:
    """A copy with every linear but lm_head replaced by bitsandbytes' Linear8bitLt
    (`kind='int8'`, LLM.int8() with outlier threshold 6) or Linear4bit (`'nf4'`, block 64,
    no double quantization, fp32 compute), quantized on the CPU."""
    with quiet():
        import bitsandbytes as bnb
    model = copy.deepcopy(model)
    for name in _kept(model):
        lin = model.get_submodule(name)
        args = (lin.in_features, lin.out_features, lin.bias is not None)
        if kind == "int8":
            new = bnb.nn.Linear8bitLt(*args, has_fp16_weights=False, threshold=6.0)
        else:
            new = bnb.nn.Linear4bit(
                *args, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=False
            )
        new.load_state_dict(lin.state_dict())
        with quiet():
            new = new.to("cpu")  # quantization happens when the weight is moved
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model


def torch_ao_int8(model: Transformer) -> tuple[Transformer, str]:
    """torch.ao dynamic int8 (weights int8 per tensor, activations quantized per call) of
    every linear but lm_head, and the deprecation warning torch prints for it."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    spec = dict.fromkeys(_kept(model), default_dynamic_qconfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = quantize_dynamic(copy.deepcopy(model), spec, dtype=torch.qint8)
    notes = sorted({str(w.message).splitlines()[0] for w in caught})
    return qmodel, " / ".join(notes)


def library_weight_bytes(model: nn.Module) -> int:
    """Stored bytes of the linear weights of a bitsandbytes / torch.ao model (+ lm_head)."""
    total = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if callable(w):  # torch.ao DynamicQuantizedLinear: weight() -> quantized tensor
            q = w()
            total += q.int_repr().nbytes + 8  # int8 codes + one fp64 scale, int64 zero
        elif type(mod).__name__ in ("Linear8bitLt", "Linear4bit"):
            total += w.nbytes
            state = getattr(w, "quant_state", None)
            extra = [getattr(w, "SCB", None)] + ([state.absmax] if state is not None else [])
            total += sum(t.nbytes for t in extra if t is not None)
        elif isinstance(mod, nn.Linear):
            total += w.nbytes
    return total


def _ort_step(path: Path, context: int = 64) -> Callable[[], Any]:
    """One decode step of an ONNX decoder-step graph at position `context`, pasts prefilled."""
    import numpy as np

    from minillm.export import onnx_runtime as rt

    dec = rt.OrtDecoder(rt.ort_session(path))
    _, pos, mask, past = dec.prefill([list(range(1, context + 1))])
    ids = np.array([[7]], np.int64)
    positions = pos[:, None].astype(np.int64)
    mask1 = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)

    def step() -> Any:
        return dec.step(ids, positions, mask1, past)

    step()
    return step


def ort_int8(model: Transformer, workdir: Path) -> dict[str, Any]:
    """ONNX Runtime dynamic int8 (chapter 03, per-channel weights): a logits function, the
    int8 file's size, and decode-step functions of the fp32 and int8 step graphs (None if
    the step graph could not be built)."""
    from minillm.export import onnx as ox
    from minillm.export import onnx_runtime as rt

    with quiet():
        fp = ox.export_forward(model, workdir / "forward.onnx")
        q8 = rt.quantize_int8(fp, workdir / "forward.int8.onnx", per_channel=True)
    out = {"logits": rt.ort_logits_fn(rt.ort_session(q8)), "bytes": q8.stat().st_size}
    out["step_fp32"] = out["step_int8"] = None
    with contextlib.suppress(Exception), quiet():
        sp = ox.export_decoder_step(model, workdir / "step.onnx")
        sq = rt.quantize_int8(sp, workdir / "step.int8.onnx", per_channel=True)
        out["step_fp32"], out["step_int8"] = _ort_step(sp), _ort_step(sq)
    return out


# --------------------------------------------------------------------------- decode step


def decode_step(
    model: nn.Module, cfg: ModelConfig, context: int = 64, batch: int = 1
) -> Callable[[], Any]:
    """One cached decode step of `batch` sequences at position `context` (the first
    `context` slots prefilled)."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg.vocab_size, (batch, context + 1), generator=g)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    cache = KVCache(cfg, batch, context + 1, dtype=dtype)
    with torch.inference_mode():
        cache.kv_len = context
        model(ids[:, :context], cache=cache)
    cache.kv_len = context + 1
    pos = torch.full((batch, 1), context)

    @torch.inference_mode()
    def step() -> Any:
        return model(ids[:, context:], positions=pos, cache=cache)

    return step


def build(model: Transformer, scheme: str) -> tuple[nn.Module, str]:
    """(model in `scheme`, a note). fp32 / bf16 / ours / library names; one of ours with
    '+kernel' ('int8+kernel', 'int4-g64+kernel') runs on torch's CPU kernels."""
    if scheme == "fp32":
        return model, ""
    if scheme == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16), ""
    if scheme == "bnb-int8":
        return bnb_model(model, "int8"), ""
    if scheme == "bnb-nf4-g64":
        return bnb_model(model, "nf4"), ""
    if scheme == "torch.ao-int8":
        return torch_ao_int8(model)
    if scheme.endswith("+kernel"):  # on torch's CPU int8 / int4 kernels (bf16 activations)
        quantized = quantize_model(copy.deepcopy(model), scheme.removesuffix("+kernel"))
        skipped = use_cpu_kernels(quantized)
        return quantized, f"no kernel for {sorted(skipped)}" if skipped else ""
    return quantize_model(copy.deepcopy(model), scheme), ""


def model_bytes(model: nn.Module, scheme: str) -> tuple[int, int]:
    """(bytes of the quantizable linear weights, bytes of all weights)."""
    if scheme in ("bnb-int8", "bnb-nf4-g64", "torch.ao-int8"):
        head = model.lm_head.weight.nbytes
        lin = library_weight_bytes(model) - head
        others = sum(
            p.nbytes for n, p in model.named_parameters() if "layers" in n and p.dim() == 1
        )
        emb = model.model.embed_tokens.weight.nbytes + model.model.norm.weight.nbytes
        return lin, lin + others + emb
    kept = model.lm_head.weight.nbytes
    return weight_bytes(model, only_linear=True) - kept, weight_bytes(model)


# ------------------------------------------------------------------------------- (a) table


def quality_table(
    schemes: list[str],
    windows: int | None,
    repeats: int,
    use_ort: bool = True,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Rows of (a): bytes, perplexity, agreement with fp32, decode-step ratio vs fp32."""
    base = load_model()
    ids = held_out_ids(load_tokenizer())
    kw = {"window": WINDOW, "max_windows": windows}
    base_ppl = perplexity(base, ids, **kw)
    base_step = decode_step(base, base.config)
    rows = []
    it = progress(schemes) if progress else schemes
    for scheme in it:
        note = ""
        if scheme == "ort-int8":
            if not use_ort:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    ort = ort_int8(base, Path(tmp))
                except Exception as err:  # chapter 03's module missing or failing here
                    rows.append({"scheme": scheme, "note": f"skipped: {err}"})
                    continue
                ppl = perplexity(ort["logits"], ids, **kw)
                agree = next_token_agreement(base, ort["logits"], ids, **kw)
                ratio, note = None, "file size; lm_head int8 too"
                if ort["step_int8"] is not None:
                    fns = {
                        "fp32": base_step,
                        "ort-fp32": ort["step_fp32"],
                        scheme: ort["step_int8"],
                    }
                    r = time_ratios(fns, "ort-fp32", repeats)
                    ratio = r[scheme]
                    note += f"; step time vs ORT fp32 (ORT fp32 = {1 / r['fp32']:.2f}x torch fp32)"
                row = {"scheme": scheme, "linear_bytes": None, "model_bytes": ort["bytes"]}
                row |= {"ppl": ppl, "ppl_delta": ppl / base_ppl - 1, "agreement": agree}
                rows.append(row | {"step_ratio": ratio, "note": note})
            continue
        model, note = build(base, scheme)
        lin, total = model_bytes(model, scheme)
        ppl = perplexity(model, ids, **kw)
        agree = 1.0 if scheme == "fp32" else next_token_agreement(base, model, ids, **kw)
        ratio = 1.0
        if scheme != "fp32":
            fns = {"fp32": base_step, scheme: decode_step(model, base.config)}
            ratio = time_ratios(fns, "fp32", repeats)[scheme]
        row = {"scheme": scheme, "linear_bytes": lin, "model_bytes": total, "ppl": ppl}
        row |= {"ppl_delta": ppl / base_ppl - 1, "agreement": agree, "step_ratio": ratio}
        rows.append(row | {"note": note})
    fp32 = rows[0]
    for row in rows:
        if row.get("linear_bytes"):
            row["linear_reduction"] = fp32["linear_bytes"] / row["linear_bytes"]
        if row.get("model_bytes"):
            row["model_reduction"] = fp32["model_bytes"] / row["model_bytes"]
    return rows


def print_quality(rows: list[dict[str, Any]]) -> None:
    """Table (a), then each row's note."""
    head = f"{'scheme':<14}{'linear W':>11}{'x less':>8}{'model W':>11}{'x less':>8}"
    print(head + f"{'ppl':>8}{'d ppl':>8}{'agree':>7}{'step/fp32':>11}")
    for r in rows:
        if "ppl" not in r:
            print(f"{r['scheme']:<14}{r['note']}")
            continue
        lin = format_bytes(r["linear_bytes"]) if r.get("linear_bytes") else "-"
        lr = f"{r['linear_reduction']:.2f}" if r.get("linear_reduction") else "-"
        step = f"{r['step_ratio']:.2f}" if r.get("step_ratio") else "-"
        print(
            f"{r['scheme']:<14}{lin:>11}{lr:>8}{format_bytes(r['model_bytes']):>11}"
            f"{r['model_reduction']:>8.2f}{r['ppl']:>8.2f}{100 * r['ppl_delta']:>+7.2f}%"
            f"{r['agreement']:>7.3f}{step:>11}"
        )
    for r in rows:
        if "ppl" in r and r.get("note"):
            print(f"  {r['scheme']}: {r['note']}")


# -------------------------------------------------------------------- (b) realistic shapes


def big_model() -> Transformer:
    """SmolLM2-135M's shapes with random N(0, 0.02) weights (the embedding tied to lm_head),
    built on the meta device first so that no default initialisation runs."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(SMOLLM2_135M))
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # to_empty broke the tie
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    model.inv_freq = rope_inv_freq(model.config)
    return model.eval()


def realistic_table(
    schemes: list[str], speed: list[str], repeats: int, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Rows of (b): bytes for every scheme, decode-step ratio vs fp32 for `speed`."""
    base = big_model()
    base_step = decode_step(base, base.config)
    rows = []
    it = progress(schemes) if progress else schemes
    for scheme in it:
        model, _ = build(base, scheme)
        lin, total = model_bytes(model, scheme)
        ratio = 1.0 if scheme == "fp32" else None
        if scheme in speed:
            fns = {"fp32": base_step, scheme: decode_step(model, base.config)}
            ratio = time_ratios(fns, "fp32", repeats)[scheme]
        rows.append(
            {"scheme": scheme, "linear_bytes": lin, "model_bytes": total, "step_ratio": ratio}
        )
        del model
    for r in rows:
        r["linear_reduction"] = rows[0]["linear_bytes"] / r["linear_bytes"]
        r["model_reduction"] = rows[0]["model_bytes"] / r["model_bytes"]
    return rows


def print_realistic(rows: list[dict[str, Any]]) -> None:
    """Table (b)."""
    print(
        f"{'scheme':<14}{'linear W':>11}{'x less':>8}{'model W':>11}{'x less':>8}{'step/fp32':>11}"
    )
    for r in rows:
        step = f"{r['step_ratio']:.2f}" if r["step_ratio"] else "-"
        print(
            f"{r['scheme']:<14}{format_bytes(r['linear_bytes']):>11}{r['linear_reduction']:>8.2f}"
            f"{format_bytes(r['model_bytes']):>11}{r['model_reduction']:>8.2f}{step:>11}"
        )
