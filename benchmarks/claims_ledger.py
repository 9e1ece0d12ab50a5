"""CLAIMS.md's chapter tables, generated from the committed notebooks' "Check the article" output.

    python -m benchmarks.claims_ledger           # rewrite the tables in CLAIMS.md
    python -m benchmarks.claims_ledger --check   # exit 1 if a table is out of date

Each notebook ends by rendering its claims (`minillm.lab.claims.claims_table`): the article's
words, what that run measured, formatted from the run's own variables or from the results
files it reads, and a verdict. The ledger copies those rows as the committed notebook shows
them, numbered per chapter (`06.2`), with the machine and date the run records, so every
figure in a table has one source: a notebook output anyone can re-run. The GPU column is the
one thing not in a notebook: `GPU` below, what `make gpu-check` measured, whose figures
tests/test_readme.py finds in benchmarks/results/gpu-h200.md. A chapter's table sits in
CLAIMS.md between `<!-- claims NN: generated ... -->` and `<!-- /claims NN -->`.

Standard library only: the test imports it, and it only reads JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import generated

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "CLAIMS.md"
NOTEBOOKS = ROOT / "notebooks"
COMMAND = "python -m benchmarks.claims_ledger"
HEADER = "| source | claim | measured here | verdict |"
RUN = re.compile(r"^\*This run: (.+)\*$", re.M)  # the line claims_table writes under a table

# What the H200 run of `make gpu-check` (benchmarks/results/gpu-h200.md) measured on a row's
# claim, where it measured anything; "—" for the others.
GPU = {
    "04.4": "Auto-tuning and multi-stream not measured: torch-tensorrt is not installed on the "
    "GPU machine (skipped: needs torch_tensorrt).",
    "04.5": "Partial (bundled model, H200): eager fp16 takes 0.86-0.90x and torch.compile fp16 "
    "0.41-0.45x the time of eager fp32; torch-tensorrt and the ORT CUDA/TensorRT providers are "
    "not installed there.",
    "05.2": "SmolLM2-135M shape, bf16: eager decode step / reduce-overhead (CUDA graph) step "
    "13.44x at batch 1, 13.93x at batch 8; compile + 3 warm-up calls 41 s.",
    "05.3": "On the GPU the launch overhead is the point: 13.44x from one CUDA-graph replay per "
    "step (batch 1, 30 layers).",
    "05.4": "reduce-overhead recorded CUDA graphs with no skips (the cache's static addresses): "
    "13.44x eager at batch 1.",
    "05.8": "Not run: torch-tensorrt not installed on the GPU machine.",
    "06.4": "Our fused INT4 kernel ran compiled on an H200 in bf16: 0.30x the speed of the bf16 "
    "cuBLAS matmul at M=1, 4096x4096: hardware-agnostic, but this first kernel is slower, not "
    "faster.",
    "06.6": "Speed on an H200 (M=1, 4096x4096): our int4 kernel 0.30x cuBLAS bf16 speed: 4x "
    "fewer bytes did not become speed with this kernel.",
    "06.9": "Not measured: the check times our INT4 Triton kernel (row 06.4), not INT8/FP8 "
    "tensor-core GEMMs (`torch._int_mm`, `torch._scaled_mm`).",
    "07.6": "H200, bf16, Llama-3-8B attention shapes: paged decode 14.6% of the measured copy "
    "bandwidth at batch 64 x 2k, 6.6% at batch 1 x 8k with split-K (goals 70% / 50%: not met).",
    "08.1": "Engine on an H200 (bf16, Triton decode kernel, SmolLM2-135M shape, random weights): "
    "34 / 890 / 2346 output tok/s at 1 / 32 / 128 in flight (same greedy tokens as `generate` in "
    "fp32 and bf16). vLLM not installed there.",
    "08.3": "Throughput on an H200 grows 70x from 1 to 128 in flight (SmolLM2 shape) while a step "
    "takes 30 -> 53 ms: the GPU was mostly idle at batch 1. GPU utilisation itself not read.",
    "08.4": "Not the article's setup (no 7B, no A100); minillm `generate` vs transformers "
    "`generate`, batch 1, bf16, H200: transformers takes 0.83x minillm's time (both eager).",
    "09.1": "`minillm.bench.tensorrt.compare_backends` on the H200 (bundled model): eager fp16 "
    "takes 0.86-0.90x and torch.compile fp16 0.41-0.45x the time of eager fp32; torch-tensorrt "
    "and the ORT CUDA/TensorRT providers are not installed there.",
    "10.6": "See 06.6 (H200: our int4 kernel slower than bf16 cuBLAS at M=1).",
    "10.8": "See 05.2: 13.44x from CUDA graphs at batch 1 on an H200.",
    "10.9": "See 08.1 (engine on an H200; vLLM not installed there).",
}


@dataclass(frozen=True)
class Row:
    """One claims row as a notebook rendered it (Markdown cells, verdict with its kind)."""

    source: str
    claim: str
    measured: str
    verdict: str


def notebook(chapter: str) -> Path:
    found = sorted(NOTEBOOKS.glob(f"{chapter}_*.ipynb"))
    if len(found) != 1:
        raise SystemExit(f"no single notebook for chapter {chapter} in {NOTEBOOKS}: {found}")
    return found[0]


def chapters() -> list[str]:
    return [p.name[:2] for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))]


def cells_of(row: str) -> list[str]:
    """A Markdown table row's cells ('|' inside backticks or escaped as '\\|' stays put)."""
    cells, cell, code = [], "", False
    i = 0
    while i < len(row):
        ch = row[i]
        if ch == "\\" and row[i + 1 : i + 2] == "|":
            cell += "\\|"
            i += 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        i += 1
    return cells[1:]  # the text before the first '|' is empty


def claims_output(chapter: str) -> str:
    """The Markdown output of the notebook's claims cell (the one rendering HEADER)."""
    nb = json.loads(notebook(chapter).read_text())
    found = [
        "".join(out["data"]["text/markdown"])
        for cell in nb["cells"]
        for out in cell.get("outputs", [])
        if HEADER in "".join(out.get("data", {}).get("text/markdown", ""))
    ]
    if len(found) != 1:
        raise SystemExit(
            f"{notebook(chapter).name}: {len(found)} claims tables in its saved outputs, want 1 "
            "(run it and save it with `make notebooks NB=" + chapter + "`)"
        )
    return found[0]


def rows(chapter: str) -> tuple[list[Row], str]:
    """The chapter's claims rows as its committed run shows them, and that run's machine line."""
    text = claims_output(chapter)
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        source, claim, measured, verdict = cells_of(line)
        out.append(Row(source, claim, measured, verdict))
    run = RUN.search(text)
    if run is None:
        raise SystemExit(
            f"{notebook(chapter).name}: its claims table has no '*This run: ...*' line"
        )
    return out, run.group(1)


def table(chapter: str) -> str:
    """The CLAIMS.md block for one chapter: where the figures come from, then the rows."""
    found, run = rows(chapter)
    lines = [
        f"<!-- claims {chapter}: generated by {COMMAND} from the notebook's saved output -->",
        f"Figures: `notebooks/{notebook(chapter).name}` as committed ({run}).",
        "",
        "| # | source | claim | measured | verdict | GPU (H200, `make gpu-check`) |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(found, 1):
        key = f"{chapter}.{i}"
        lines.append(
            f"| {key} | {r.source} | {r.claim} | {r.measured} | {r.verdict} | {GPU.get(key, '—')} |"
        )
    lines.append(f"<!-- /claims {chapter} -->")
    return "\n".join(lines)


def block(chapter: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- claims {chapter}: .*?<!-- /claims {chapter} -->", re.S)


def update(text: str) -> str:
    """`text` (CLAIMS.md) with every chapter's block rewritten; each must be there once."""
    for chapter in chapters():
        pattern = block(chapter)
        if len(pattern.findall(text)) != 1:
            raise SystemExit(
                f"CLAIMS.md needs one '<!-- claims {chapter}: ... -->' ... '<!-- /claims "
                f"{chapter} -->' block for notebook {chapter} (add the two markers)"
            )
        start, end = pattern.search(text).span()
        text = text[:start] + table(chapter) + text[end:]
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if CLAIMS.md is stale")
    args = ap.parse_args(argv)
    return generated.rewrite(CLAIMS, update(CLAIMS.read_text()), "tables", COMMAND, args.check)


if __name__ == "__main__":
    sys.exit(main())
