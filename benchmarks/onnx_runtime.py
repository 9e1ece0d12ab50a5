"""Chapter 03 benchmark: PyTorch eager vs ONNX Runtime (each optimisation level, int8) on CPU.

    python -m benchmarks.onnx_runtime [--models bundled,smollm2] [--quick] [--no-smol]
                                      [--threads N] [--json results.json]

For each model, the decoder-step graph (`minillm.export.onnx.export_decoder_step`) is
exported once and serves both phases, as it does in generation:

(a) file sizes: the PyTorch state dict (`torch.save`, .pt), safetensors, the fp32 .onnx
    and ORT's dynamic int8 .onnx (`quantize_int8`).
(b) graph: node count at each ORT level (ORT_DISABLE_ALL / BASIC / EXTENDED / ALL), from
    the optimised graph ORT saves (`optimized_model_filepath`).
(c) speed: a prefill of `--prefill` tokens (empty past) and a decode step after a past
    of `--past` tokens (8 of them per timed call), batch 1, on the same inputs: minillm
    eager (with its KVCache) vs ORT at each level vs ORT int8 (level ALL). All variants
    are timed in alternation in the same rounds; a ratio is the median over rounds of
    eager's time / the variant's time (> 1: faster than eager). torch and ORT both use
    `--threads` threads.
(d) quality of int8: held-out perplexity of PyTorch, ORT fp32 and ORT int8, and int8's
    next-token agreement with fp32; the bundled model on its held-out KJV, SmolLM2 on the
    CIA World Factbook and the KJV (`minillm.training.factbook_ids`, `held_out_ids`).

Models (`--models`, default both): the bundled model (1.3M parameters) and SmolLM2-135M-
Instruct (`smollm2`, offline; its export takes minutes and ~3.5 GB of memory); `--no-smol`
is `--models bundled`. ONNX Runtime runs on its CPU provider, so everything here runs on
the CPU in fp32 whatever GPU the machine has. Ends with one `SUMMARY onnx:` line, the
models' figures one after another; `--json` writes the per-model results under "models".
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench.onnx_runtime import run_model
from minillm.lab import format_bytes


def summary(r: dict[str, Any]) -> str:
    """One model's part of the SUMMARY line: speed-ups, node counts, sizes, int8 quality."""
    s, sz = r["speed"], r["sizes"]
    line = (
        f"{r['model']}: ORT all vs eager {s['prefill']['ORT all']:.2f}x prefill"
        f"{r['prefill']}, {s['decode']['ORT all']:.2f}x decode@{r['past']}; ORT disable "
        f"{s['prefill']['ORT disable']:.2f}x/{s['decode']['ORT disable']:.2f}x; int8 "
        f"{s['prefill']['ORT int8']:.2f}x/{s['decode']['ORT int8']:.2f}x; nodes "
        f"{r['nodes']['disable']}->{r['nodes']['all']}; sizes pt {format_bytes(sz['pt'])}, "
        f"safetensors {format_bytes(sz['safetensors'])}, onnx {format_bytes(sz['onnx'])}, "
        f"int8 {format_bytes(sz['onnx int8'])}"
    )
    if "quality" in r:
        for corpus in ("factbook", "kjv"):
            if corpus in r["quality"]:
                q = r["quality"][corpus]
                line += (
                    f"; {corpus} ppl fp32 {q['ppl_ort_fp32']:.2f} int8 {q['ppl_ort_int8']:.2f}, "
                    f"agreement {q['agreement_int8']:.1%}"
                )
    return line


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer repeats and windows")
    ap.add_argument("--models", default="bundled,smollm2", help="comma-separated models")
    ap.add_argument("--no-smol", action="store_true", help="the bundled model only")
    ap.add_argument("--prefill", type=int, default=128, help="tokens of the timed prefill")
    ap.add_argument("--past", type=int, default=128, help="cached tokens before each decode")
    args = ap.parse_args(argv)
    run = report.start("onnx", args)
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}; torch and ORT use {args.threads} thread(s)")
    repeats = 10 if args.quick else 30
    results = []
    names = ["bundled"] if args.no_smol else args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = None if name == "bundled" else name
            model, tok = load_model(path), load_tokenizer(path)
            small = model.num_parameters() < 10**7
            results.append(
                run_model(
                    name,
                    model,
                    Path(tmp) / name.replace("/", "_"),
                    args.prefill,
                    args.past,
                    args.threads,
                    repeats if small else max(repeats // 3, 5),
                    max_windows=(8 if args.quick else 32) if small else (2 if args.quick else 8),
                    tokenizer=tok,
                )
            )
            del model
    print()
    summaries = " | ".join(summary(r) for r in results)
    return run.finish({"models": results}, f"{summaries}; {args.threads} thread(s)")


if __name__ == "__main__":
    main()
