"""The notebooks' "Check the article" tables: each claim of the two source articles, what the
run in front of you measured, a verdict, and what kind of evidence the verdict rests on.

The articles are Chinese, and article A numbers its chapters 一 to 十; `cite` writes
every source with its English chapter title beside it, so a table reads without a CJK font
and without the article at hand. CLAIMS.md uses the same verdicts and kinds.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ARTICLES = {
    "A": "LLM inference and deployment, from PyTorch to ONNX / TensorRT / vLLM",
    "B": "Inference acceleration engines: ONNX Runtime / TensorRT / vLLM / TGI",
}
NUMERALS = "一二三四五六七八九十"
CHAPTERS_A = {
    1: "inference vs training",
    2: "KV cache",
    3: "ONNX export",
    4: "TensorRT",
    5: "torch.compile",
    6: "INT8/INT4 quantization",
    7: "vLLM and PagedAttention",
    8: "choosing a framework",
    9: "FAQ",
    10: "roadmap",
}
SECTIONS_B = {
    1: "why inference engines",
    2: "TorchScript and torch.compile",
    3: "ONNX Runtime",
    4: "TensorRT",
    5: "vLLM",
    6: "TGI",
    7: "engine comparison",
    8: "summary",
}

VERDICTS = (
    "holds",  # the measurement agrees with the claim as stated
    "holds with conditions",  # true under conditions the article does not state
    "wrong",  # the measurement contradicts it
    "not measured on its hardware",  # the claim is about hardware this run did not have
    "not measured here",  # nothing in this run bears on it (said why in `measured`)
)
KINDS = (
    "measured",  # the verdict rests on a number this run produced
    "argued",  # on reasoning or arithmetic from measured or documented facts
    "definitional",  # true by definition or by the API's documentation
)


def cite(source: str) -> str:
    """'A 七 Why' -> 'A 7 (vLLM and PagedAttention) Why'; 'A 一 问题二' -> 'A 1 (inference
    vs training), question 2'; 'B 5' -> 'B 5 (vLLM)'; 'A FAQ Q9' stays as it is."""

    def chapter_a(m: re.Match[str]) -> str:
        n = NUMERALS.index(m.group(1)) + 1
        return f"A {n} ({CHAPTERS_A[n]})"

    def section_b(m: re.Match[str]) -> str:
        return f"B {m.group(1)} ({SECTIONS_B[int(m.group(1)[0])]})"

    out = re.sub(rf"A ([{NUMERALS}])(?![{NUMERALS}])", chapter_a, source)
    out = re.sub(r"B (\d(?:\.\d)?)", section_b, out)
    return re.sub(
        r" ?问题([一二三四五六七八九])",
        lambda m: f", question {NUMERALS.index(m.group(1)) + 1}",
        out,
    )


@dataclass(frozen=True)
class Claim:
    """One row: where the article says it, what it says, what this run measured, and the
    verdict with the kind of evidence behind it."""

    source: str
    claim: str
    measured: str
    verdict: str
    kind: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: use one of {VERDICTS}")
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r}: use one of {KINDS}")


def span(values: Sequence[float], fmt: Callable[[float], str] = lambda v: f"{v:.2f}x") -> str:
    """`min-max` of figures over runs or rounds as `fmt` prints them (`+1.0% to +2.0%` for
    signed ones), or one figure when the two print the same: a range, never the best alone."""
    low, high = fmt(min(values)), fmt(max(values))
    if low == high:
        return low
    if low.startswith(("+", "-")):
        return f"{low} to {high}"
    return f"{low.rstrip('x%')}-{high}"


def this_run() -> str:
    """The machine, torch and date a table's figures come from (CLAIMS.md copies the line)."""
    import torch

    from minillm.lab.machine import cpu_name

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    return (
        f"{device}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d', time.gmtime())}"
    )


def claims_table(claims: list[Claim]) -> str:
    """Markdown: source (with English titles), claim, measured here, verdict (kind), and a
    last line naming the machine and date of the run (`this_run`)."""
    lines = ["| source | claim | measured here | verdict |", "|---|---|---|---|"]
    for c in claims:
        lines.append(
            f"| {cite(c.source)} | {c.claim} | {c.measured} | **{c.verdict}** ({c.kind}) |"
        )
    return "\n".join([*lines, "", f"*This run: {this_run()}*"])
