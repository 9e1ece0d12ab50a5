"""Chapter 06's GPTQ and AWQ against vLLM's llm-compressor (`python -m
benchmarks.llm_compressor`): the same model, calibration tokens and evaluator for ours and
the library's, which runs in a venv of its own (it pins an older transformers) and hands
back dequantized fp32 weights."""

from __future__ import annotations

import copy
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def worker(model_dir: str, calib: str, out: str, group: int, method: str) -> None:
    """Runs under the llm-compressor venv: quantize, then save dequantized weights."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.load(calib)
    data = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * len(ids)}
    )
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=group
    )
    groups = {"g": QuantizationScheme(targets=["Linear"], weights=weights)}
    cls = GPTQModifier if method == "gptq" else AWQModifier
    recipe = cls(config_groups=groups, ignore=["lm_head"])
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        max_seq_length=ids.shape[1],
        num_calibration_samples=len(ids),
    )
    state = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_scale"):
            args = mod.quantization_scheme.weights
            zero = getattr(mod, "weight_zero_point", None)
            state[f"{name}.weight"] = fake_quantize(mod.weight, mod.weight_scale, zero, args)
    full = {  # the model's own tensors, not the quantization parameters next to them
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if k.endswith((".weight", ".bias")) and not k.endswith("_scale.weight")
    }
    full.update(state)
    full.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(full, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(model_dir).glob("*.json"):
        if f.name != "model.safetensors.index.json":
            shutil.copy(f, out_dir / f.name)
    print(f"quantized {len(state)} linears")


def run_library(
    python: str, model_dir: Path, calib: Path, out: Path, group: int, method: str
) -> str | None:
    """Quantize with llm-compressor in the other venv (the script's `--worker` mode, which
    calls `worker`); None on success, else why not."""
    cmd = [
        python,
        "-m",
        "benchmarks.llm_compressor",
        "--worker",
        str(model_dir),
        str(calib),
        str(out),
        str(group),
        method,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return f"llm-compressor {method} failed under {python}: {done.stderr.strip()[-600:]}"
    return None


def compare(
    model: str, python: str | None, group: int | None, windows: int, library_only: bool
) -> dict[str, Any]:
    """Held-out perplexity, its change vs fp32 and next-token agreement with fp32 of RTN,
    our GPTQ / AWQ (unless `library_only`) and llm-compressor's (with `python`), int4 with
    group `group` (default: the largest of 128/64/32 that fits), over `windows` windows of
    256 tokens; and why each library row is missing, if it is."""
    # imported here: the worker, in llm-compressor's venv, needs none of them
    from minillm.bench.quant_decode import group_size_for
    from minillm.model import load_model, load_tokenizer
    from minillm.model.weights import resolve_model_dir
    from minillm.quant import quantize_model
    from minillm.quant.awq import awq_quantize_model
    from minillm.quant.calibrate import calibration_batches
    from minillm.quant.gptq import gptq_quantize_model
    from minillm.training import held_out_ids, next_token_agreement, perplexity

    name = None if model == "bundled" else model
    model_dir = resolve_model_dir(name)
    base, tok = load_model(name), load_tokenizer(name)
    g = group or group_size_for(base)
    batches = calibration_batches(tok, n_batches=4, batch_size=4, seq_len=256)
    ids = held_out_ids(tok)
    kw = {"window": 256, "max_windows": windows}
    scheme = f"int4-g{g}"
    models = {"fp32": base, f"RTN {scheme}": quantize_model(copy.deepcopy(base), scheme)}
    if not library_only:
        models[f"GPTQ {scheme} (ours)"] = gptq_quantize_model(copy.deepcopy(base), batches, scheme)
        models[f"AWQ {scheme} (ours)"] = awq_quantize_model(copy.deepcopy(base), batches, scheme)
    notes = {}
    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calib.pt"
        torch.save(torch.cat(batches), calib)
        for method in ("gptq", "awq"):
            label = f"{method.upper()} {scheme} (llm-compressor)"
            if python is None:
                notes[label] = "skipped: no --python with llmcompressor given"
                continue
            out = Path(tmp) / method
            why = run_library(python, model_dir, calib, out, g, method)
            if why is None:
                models[label] = load_model(out)
            else:
                notes[label] = why
    base_ppl = perplexity(base, ids, **kw)
    rows = {}
    for label, m in models.items():
        ppl = perplexity(m, ids, **kw)
        agree = next_token_agreement(base, m, ids, **kw)
        rows[label] = {"ppl": ppl, "ppl_delta": ppl / base_ppl - 1, "agreement": agree}
    return {"group": g, "windows": windows, "rows": rows, "notes": notes}


def print_rows(result: dict[str, Any]) -> None:
    """`compare`'s rows (perplexity, change vs fp32, agreement), then its notes."""
    for label, r in result["rows"].items():
        print(f"  {label:<36}{r['ppl']:>9.3f}{100 * r['ppl_delta']:>+8.2f}%{r['agreement']:>8.3f}")
    for label, why in result["notes"].items():
        print(f"  {label}: {why}")
