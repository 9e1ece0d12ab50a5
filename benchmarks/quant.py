"""Chapter 06 benchmark: what each weight format costs in quality, saves in bytes, and does
to decode speed, on this machine, in one run.

    python -m benchmarks.quant [--quick] [--windows N] [--threads N] [--no-ort] [--json out.json]
    python -m benchmarks.quant --q4-1 [--windows N]     # part (d) alone

(a) Bundled model (trained, so perplexity means something): for fp32, bf16, our INT8 /
    INT4 / NF4 schemes and the libraries (bitsandbytes 8-bit and NF4, torch.ao dynamic
    int8, ONNX Runtime dynamic int8): weight bytes of the linear layers and of the whole
    model, held-out perplexity and its change vs fp32, next-token agreement with fp32,
    and the time of one cached decode step as a ratio to fp32 (A/B interleaved).
(b) SmolLM2-135M shapes, random weights (speed and bytes do not depend on what the
    weights learned): weight bytes for every scheme, and decode-step time ratios vs fp32.
    Here the linear layers are 80% of the weights, as in real checkpoints; in the bundled
    model the tied 4096 x 128 embedding is 40% and is kept in fp32 (see quantize_model).

(d) `--q4-1`: SmolLM2-135M-Instruct, whose published weights went through Q4_1: each
    scheme against the dequantized fp32 as the reference (Factbook and KJV perplexity,
    next-token agreement, weight error): re-quantizing to INT4 g32 lands near Q4_1's own
    grid, so it says little about what INT4 costs a model (`q4_1_caveat`).

The last line is one `SUMMARY quant:` line. Speed figures are ratios of calls timed in
alternation in the same run: absolute times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minillm import load_model, load_tokenizer
from minillm.cache import KVCache
from minillm.lab import format_bytes, time_ratios
from minillm.model import ModelConfig, Transformer
from minillm.model.shapes import SMOLLM2_135M
from minillm.quant import quantize_model, weight_bytes
from minillm.quant.linear import linear_names, use_cpu_kernels
from minillm.training import held_out_ids, next_token_agreement, perplexity

ROOT = Path(__file__).resolve().parents[1]

SEED = 0
WINDOW = 256
OURS = [
    "int8",
    "int8-tensor",
    "int4-g128",
    "int4sym-g128",
    "nf4-g128",
    "int4-g64",
    "int4sym-g64",
    "nf4-g64",
    "nf4-g64-dq",
    "int4-g32",
    "nf4-g32",
]
LIBRARIES = ["bnb-int8", "bnb-nf4-g64", "torch.ao-int8", "ort-int8"]
SPEED_BIG = ["bf16", "int8", "int4-g64", "nf4-g64", "torch.ao-int8", "bnb-int8", "bnb-nf4-g64"]


@contextlib.contextmanager
def quiet() -> Any:
    """Silence library notices (bitsandbytes prints one at import, torch.ao warns)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield


# ---------------------------------------------------------------------- library models


def _kept(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> list[str]:
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
    schemes: list[str], windows: int | None, repeats: int, use_ort: bool = True, progress=None
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
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(SMOLLM2_135M))
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # to_empty broke the tie
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    from minillm.model.transformer import rope_inv_freq

    model.inv_freq = rope_inv_freq(model.config)
    return model.eval()


def realistic_table(
    schemes: list[str], speed: list[str], repeats: int, progress=None
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
    print(
        f"{'scheme':<14}{'linear W':>11}{'x less':>8}{'model W':>11}{'x less':>8}{'step/fp32':>11}"
    )
    for r in rows:
        step = f"{r['step_ratio']:.2f}" if r["step_ratio"] else "-"
        print(
            f"{r['scheme']:<14}{format_bytes(r['linear_bytes']):>11}{r['linear_reduction']:>8.2f}"
            f"{format_bytes(r['model_bytes']):>11}{r['model_reduction']:>8.2f}{step:>11}"
        )


# ------------------------------------------------------------------------- (c) GPU kernel


# ------------------------------------------------------------------------------------ main


def summary(quality: list[dict[str, Any]], big: list[dict[str, Any]]) -> str:
    """One line: the goals of the chapter, each with its figure."""
    q = {r["scheme"]: r for r in quality if "ppl" in r}
    b = {r["scheme"]: r for r in big}
    parts = [f"int8 ppl {100 * q['int8']['ppl_delta']:+.2f}%"]
    for g in (128, 64, 32):
        if f"nf4-g{g}" in q and f"int4-g{g}" in q:
            parts.append(
                f"g{g} ppl nf4 {q[f'nf4-g{g}']['ppl']:.2f} / int4 {q[f'int4-g{g}']['ppl']:.2f}"
                + (f" / int4sym {q[f'int4sym-g{g}']['ppl']:.2f}" if f"int4sym-g{g}" in q else "")
            )
    parts.append(
        f"135M linear bytes int8 {b['int8']['linear_reduction']:.2f}x, "
        f"int4-g64 {b['int4-g64']['linear_reduction']:.2f}x, "
        f"nf4-g64-dq {b['nf4-g64-dq']['linear_reduction']:.2f}x less"
    )
    speed = ", ".join(
        f"{s} {b[s]['step_ratio']:.2f}" for s in SPEED_BIG if b.get(s, {}).get("step_ratio")
    )
    parts.append(f"135M decode step time / fp32: {speed}")
    return "SUMMARY quant: " + "; ".join(parts)


# ------------------------------------------------------------- (d) the Q4_1 caveat, SmolLM2

Q4_1_SCHEMES = ["q4_1-g32", "int4-g32", "int4sym-g32", "nf4-g32", "int4-g64", "nf4-g64", "int8"]


def q4_1_roundtrip(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """llama.cpp's Q4_1 applied again: per block of `group` weights of a row, d = (max -
    min) / 15 and m = min, both stored fp16; q = round((w - m) / d); w' = m + q d. Our
    `int4-g32` differs in one way: its zero point is an integer code (so that 0 is exact),
    where Q4_1's minimum is any fp16 value."""
    g = w.float().reshape(w.shape[0], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = ((g - m) / d.clamp(min=1e-12)).round().clamp(0, 15)
    return (m + q * d).reshape(w.shape).to(w.dtype)


def requantized(model: Transformer, scheme: str) -> Transformer:
    """A copy of `model` whose linear weights (the LM head / tied embedding kept, as
    `quantize_model` does) went through `scheme` and back: the fp32 weights the quantized
    layers compute with (fake quantization; same numbers as QuantLinear's forward)."""
    from minillm.quant.linear import QuantLinear

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in out.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
                if scheme == "q4_1-g32":
                    mod.weight.copy_(q4_1_roundtrip(mod.weight))
                else:
                    mod.weight.copy_(QuantLinear(mod, scheme).dequantized_weight())
    return out


def q4_1_caveat(
    windows: int = 8, window: int = 512, schemes: list[str] | None = None
) -> dict[str, Any]:
    """SmolLM2-135M-Instruct ships as Q4_1 (`load_model("smollm2")` dequantizes it to fp32),
    so its weights already sit on a 4-bit grid of 32-weight blocks. Re-quantizing them to a
    4-bit g32 format measures how close that format is to Q4_1's grid, not what 4 bits cost
    a model: every scheme here is measured against the dequantized fp32 (the reference), on
    held-out perplexity (CIA World Factbook and KJV, `windows` x `window` tokens each), next-
    token agreement with the reference, and the weights themselves (share left unchanged,
    relative RMS error). The Q8_0 embedding, never on a 4-bit grid, is the control: the
    same scheme's weight error on it is what 4 bits cost weights that are not."""
    from minillm.training import factbook_ids

    ref, tok = load_model("smollm2"), load_tokenizer("smollm2")
    corpora = {"factbook": factbook_ids(tok), "kjv": held_out_ids(tok)}
    kw = {"window": window, "max_windows": windows}
    base = {c: perplexity(ref, ids, **kw) for c, ids in corpora.items()}
    emb = ref.model.embed_tokens.weight.detach()
    rows = [{"scheme": "fp32 (Q4_1 dequantized)", **{f"ppl_{c}": v for c, v in base.items()}}]
    for scheme in schemes or Q4_1_SCHEMES:
        model = requantized(ref, scheme)
        row: dict[str, Any] = {"scheme": scheme}
        before, after = [], []
        for name, mod in ref.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
                before.append(mod.weight.detach().flatten())
                after.append(model.get_submodule(name).weight.detach().flatten())
        w, w2 = torch.cat(before), torch.cat(after)
        row["unchanged"] = (w2 == w).double().mean().item()
        row["rel_rms"] = ((w2 - w).norm() / w.norm()).item()
        ctrl = requantized_weight(emb, scheme)
        row["control_rel_rms"] = ((ctrl - emb).norm() / emb.norm()).item()
        for c, ids in corpora.items():
            row[f"ppl_{c}"] = perplexity(model, ids, **kw)
            row[f"d_{c}"] = row[f"ppl_{c}"] / base[c] - 1
        row["agreement"] = next_token_agreement(ref, model, corpora["factbook"], **kw)
        rows.append(row)
    return {"windows": windows, "window": window, "rows": rows}


def requantized_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """One weight matrix through `scheme` and back."""
    from minillm.quant.linear import QuantLinear

    if scheme == "q4_1-g32":
        return q4_1_roundtrip(w)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return QuantLinear(lin, scheme).dequantized_weight()


def print_q4_1(r: dict[str, Any]) -> None:
    print(
        f"{'scheme':<24}{'unchanged':>10}{'rel RMS':>9}{'(Q8_0 emb)':>11}"
        f"{'Factbook':>10}{'d':>8}{'KJV':>8}{'d':>8}{'agree':>7}"
    )
    for row in r["rows"]:
        if "rel_rms" not in row:
            print(f"{row['scheme']:<24}{'':>30}{row['ppl_factbook']:>10.2f}{'':>8}", end="")
            print(f"{row['ppl_kjv']:>8.2f}")
            continue
        print(
            f"{row['scheme']:<24}{row['unchanged']:>10.1%}{row['rel_rms']:>9.4f}"
            f"{row['control_rel_rms']:>11.4f}{row['ppl_factbook']:>10.2f}"
            f"{100 * row['d_factbook']:>+7.2f}%{row['ppl_kjv']:>8.2f}{100 * row['d_kjv']:>+7.2f}%"
            f"{row['agreement']:>7.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer windows and timing rounds")
    ap.add_argument("--windows", type=int, default=None, help="held-out windows (default all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime int8")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--q4-1",
        action="store_true",
        help="only part (d): SmolLM2's Q4_1 weights re-quantized, vs the dequantized fp32",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.q4_1:
        print("(d) SmolLM2-135M-Instruct (shipped as Q4_1): every scheme vs the dequantized fp32")
        caveat = q4_1_caveat(windows=args.windows or (4 if args.quick else 8))
        print_q4_1(caveat)
        if args.json:
            args.json.write_text(json.dumps(caveat, indent=2))
        by = {row["scheme"]: row for row in caveat["rows"]}
        print(
            "SUMMARY quant q4_1: "
            + "; ".join(
                f"{k} {by[k]['unchanged']:.1%} of weights unchanged, rel RMS "
                f"{by[k]['rel_rms']:.4f} (Q8_0 embedding {by[k]['control_rel_rms']:.4f}), "
                f"perplexity {100 * by[k]['d_factbook']:+.2f}% Factbook / "
                f"{100 * by[k]['d_kjv']:+.2f}% KJV"
                for k in ("q4_1-g32", "int4-g32", "nf4-g32")
                if k in by
            )
        )
        return
    windows = args.windows or (16 if args.quick else None)
    repeats = 5 if args.quick else 15

    print(
        f"torch {torch.__version__}, {args.threads} thread(s), held-out windows: {windows or 'all'}"
    )
    print("\n(a) bundled model: quality, bytes, decode-step time vs fp32 (lm_head kept fp32)")
    schemes = ["fp32", "bf16", *OURS, *LIBRARIES]
    quality = quality_table(schemes, windows, repeats, use_ort=not args.no_ort)
    print_quality(quality)
    _, ao_note = torch_ao_int8(load_model())
    print(f"torch.ao.quantization.quantize_dynamic warns: {ao_note!r}")

    print("\n(b) SmolLM2-135M shapes, random weights: bytes; decode-step time vs fp32")
    # 576 = 9 x 64: group 128 does not divide SmolLM2's hidden size (quantize_int4 says so)
    big_schemes = ["fp32", "bf16", "int8", "int4-g64", "int4sym-g64", "int4-g32", "nf4-g64"]
    big_schemes += ["nf4-g64-dq", "torch.ao-int8", "bnb-int8", "bnb-nf4-g64"]
    big = realistic_table(big_schemes, SPEED_BIG, max(3, repeats // 3))
    print_realistic(big)
    print("\n(c) the fused INT4 kernel on a GPU: python -m benchmarks.kernels (and make gpu-check)")
    if args.json:
        args.json.write_text(json.dumps({"quality": quality, "realistic": big}, indent=2))
    print(summary(quality, big))


if __name__ == "__main__":
    main()
