"""`make gpu-check`'s tiny CPU mode, so the GPU check cannot rot between GPU runs: every part
runs (Triton's interpreter, small shapes, the eager backend), its correctness checks pass, and
both reports are written. Its speed numbers mean nothing on a CPU and are not checked."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check


@pytest.mark.slow
def test_cpu_mode_runs_every_part_and_writes_both_reports(tmp_path):
    report = gpu_check.main(["--cpu", "--out", str(tmp_path)])
    parts = report["parts"]
    assert set(parts) == set(gpu_check.PARTS)
    failed = {n: p.get("reason") for n, p in parts.items() if p["status"] != "ok"}
    assert not failed, failed
    assert report["checks_total"] >= 10
    assert report["checks_passed"] == report["checks_total"], [
        c for p in parts.values() for c in p.get("checks", []) if not c["passed"]
    ]
    assert all(g["met"] is None for g in report["goals"])  # speed goals: GPU only
    skipped = parts["notebooks"]
    assert skipped["06 bitsandbytes NF4 matmul"]["reason"] == "needs CUDA"
    saved = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert saved["checks_passed"] == report["checks_passed"]
    md = (tmp_path / "gpu-cpu.md").read_text()
    assert "## Goals" in md and "## engine: ok" in md


def test_a_failing_part_is_reported_and_the_others_still_run(monkeypatch):
    def broken(run):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_check.PARTS, "hf", broken)
    report = gpu_check.run_all(cpu=True, only=["env", "hf"])
    assert report["parts"]["hf"]["status"] == "failed"
    assert "planted failure" in report["parts"]["hf"]["reason"]
    assert report["parts"]["env"]["status"] == "ok"


def test_a_spent_budget_skips_the_rest_and_says_so():
    report = gpu_check.run_all(cpu=True, budget_s=0.0, only=["env", "kernels"])
    assert all(p["status"] == "skipped" for p in report["parts"].values())
    assert "budget" in report["parts"]["kernels"]["reason"]
