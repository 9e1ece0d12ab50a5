"""Chapter 06 benchmark: the course's GPTQ and AWQ against a real library, vLLM's
llm-compressor, on the same model, the same calibration tokens and the same evaluator.

    python -m benchmarks.llm_compressor --python /path/to/venv/bin/python [--model bundled]
                                        [--group G] [--windows N] [--json out.json]

llm-compressor 0.14 wants transformers <= 5.17 (the course pins 5.19), so it lives in a
venv of its own: `python -m venv V && V/bin/pip install torch==2.13.0 llmcompressor`
installs against the course's torch without another torch build (checked with the CPU
wheel). This script writes the calibration token ids to a file, runs itself under that
venv's `--python` as a worker (GPTQModifier and AWQModifier, int4 asymmetric, group G,
lm_head kept), which saves each result as a plain HF directory of *dequantized* fp32
weights; then it scores those, our RTN / GPTQ / AWQ and fp32 with the same evaluator.
Without `--python` (or with one where llm-compressor does not import) it says so and
scores ours only. One SUMMARY line.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]


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
    """Quantize with llm-compressor in the other venv; None on success, else why not."""
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5], int(sys.argv[5]), sys.argv[6])
        return {}
    from benchmarks.quant_decode import group_size_for
    from minillm import BUNDLED_DIR, load_model, load_tokenizer
    from minillm.model.weights import resolve_model_dir
    from minillm.quant import quantize_model
    from minillm.quant.awq import awq_quantize_model
    from minillm.quant.calibrate import calibration_batches
    from minillm.quant.gptq import gptq_quantize_model
    from minillm.training import held_out_ids, next_token_agreement, perplexity

    ap = report.parser(__doc__, quick="8 held-out windows")
    ap.add_argument("--python", default=None, help="a python with llmcompressor installed")
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument(
        "--library-only", action="store_true", help="skip our GPTQ/AWQ (quant_methods has them)"
    )
    args = ap.parse_args(argv)
    run = report.start(f"llm_compressor {args.model}", args)
    name = None if args.model == "bundled" else args.model
    model_dir = BUNDLED_DIR if name is None else resolve_model_dir(name)
    base, tok = load_model(name), load_tokenizer(name)
    g = args.group or group_size_for(base)
    batches = calibration_batches(tok, n_batches=4, batch_size=4, seq_len=256)
    ids = held_out_ids(tok)
    kw = {"window": 256, "max_windows": 8 if args.quick else args.windows}
    scheme = f"int4-g{g}"
    models = {"fp32": base, f"RTN {scheme}": quantize_model(copy.deepcopy(base), scheme)}
    if not args.library_only:
        models[f"GPTQ {scheme} (ours)"] = gptq_quantize_model(copy.deepcopy(base), batches, scheme)
        models[f"AWQ {scheme} (ours)"] = awq_quantize_model(copy.deepcopy(base), batches, scheme)
    notes = {}
    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calib.pt"
        torch.save(torch.cat(batches), calib)
        for method in ("gptq", "awq"):
            label = f"{method.upper()} {scheme} (llm-compressor)"
            if args.python is None:
                notes[label] = "skipped: no --python with llmcompressor given"
                continue
            out = Path(tmp) / method
            why = run_library(args.python, model_dir, calib, out, g, method)
            if why is None:
                models[label] = load_model(out)
            else:
                notes[label] = why
    base_ppl = perplexity(base, ids, **kw)
    rows = {}
    print(f"model {args.model}, group {g}, {kw['max_windows']} held-out windows of 256 tokens")
    for label, m in models.items():
        ppl = perplexity(m, ids, **kw)
        agree = next_token_agreement(base, m, ids, **kw)
        rows[label] = {"ppl": ppl, "ppl_delta": ppl / base_ppl - 1, "agreement": agree}
        print(f"  {label:<36}{ppl:>9.3f}{100 * (ppl / base_ppl - 1):>+8.2f}%{agree:>8.3f}")
    for label, why in notes.items():
        print(f"  {label}: {why}")
    parts = [f"{k} {100 * v['ppl_delta']:+.2f}%" for k, v in rows.items() if k != "fp32"]
    run.finish({"rows": rows, "notes": notes}, "ppl delta " + ", ".join(parts))
    return rows


if __name__ == "__main__":
    main()
