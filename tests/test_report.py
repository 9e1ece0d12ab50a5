"""The benchmarks' shared frame: options, header, JSON and the SUMMARY line (on the paged
benchmark, which only counts blocks and so runs in a second)."""

from __future__ import annotations

import json

import torch

from benchmarks import paged


def test_a_benchmark_writes_its_json_and_one_summary_line(tmp_path, capsys):
    out = tmp_path / "paged.json"
    results = paged.main(["--quick", "--requests", "40", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith(f"torch {torch.__version__}, 1 thread(s), quick=True")
    (summary,) = [line for line in printed.splitlines() if line.startswith("SUMMARY ")]
    assert summary.startswith("SUMMARY paged: real tokens fill") and summary.endswith(" s")
    saved = json.loads(out.read_text())
    assert saved["threads"] == 1 and saved["quick"] is True and saved["seconds"] > 0
    assert saved["machine"]["threads"] == 1 and saved["machine"]["torch"] == torch.__version__
    assert saved["trace"]["requests"] == 40 == results["trace"]["requests"]
