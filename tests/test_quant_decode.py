"""benchmarks/quant_decode.py (over `minillm.bench.quant_decode`): a small run times every
format against fp32 and writes a JSON that says which machine measured it (the int8/int4
kernels' speed depends on it)."""

from __future__ import annotations

import json

import torch

from benchmarks import quant_decode as script
from minillm.bench import quant_decode


def test_a_small_run_records_every_format_and_the_machine(tmp_path, capsys) -> None:
    out = tmp_path / "qd.json"
    results = script.main(["--model", "bundled", "--batch", "1", "--quick", "--json", str(out)])
    g = quant_decode.group_size_for(quant_decode.load("bundled"))
    names = {"fp32", "bf16", "int8", "int8+head", f"int4-g{g}", f"int4-g{g}+head"}
    assert names | {f"int4-g{g} dequant"} == set(results[1])
    rows = results[1]
    assert rows["fp32"]["speedup"] == 1.0 and all(r["speedup"] > 0 for r in rows.values())
    assert rows[f"int4-g{g}"]["bytes"] < rows["int8"]["bytes"] < rows["fp32"]["bytes"]
    saved = json.loads(out.read_text())
    assert saved["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert saved["machine"]["threads"] == 1 and set(saved["1"]) == set(rows)
    assert "SUMMARY quant_decode bundled" in capsys.readouterr().out
