"""The GPU check's goals (issue 15's, read off the report) and its Markdown rendering."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Report = dict[str, Any]


def _rows(report: Report, part: str, key: str) -> list[dict]:
    return report["parts"].get(part, {}).get(key, [])


def _goal(name: str, target: str, value: float | None, met: bool | None, where: str) -> dict:
    return {"goal": name, "target": target, "value": value, "met": met, "where": where}


def paged_64x2k(report: Report) -> dict:
    rows = [
        r
        for r in _rows(report, "kernels", "paged_decode")
        if r["batch"] == 64 and r["context"] == 2048 and r["block_size"] == 16
    ]  # the best launch configuration of the sweep counts
    best = max((r["frac_of_copy"] for r in rows), default=None)
    met = None if best is None or report["mode"] == "cpu" else best >= 0.70
    return _goal("paged decode, batch 64 x 2k", ">= 70% of copy bandwidth", best, met, "kernels")


def paged_1x8k(report: Report) -> dict:
    rows = [
        r
        for r in _rows(report, "kernels", "paged_decode")
        if r["batch"] == 1 and r["context"] == 8192 and r["splits"] > 1
    ]
    best = max((r["frac_of_copy"] for r in rows), default=None)
    met = None if best is None or report["mode"] == "cpu" else best >= 0.50
    return _goal(
        "paged decode split-K, batch 1 x 8k", ">= 50% of copy bandwidth", best, met, "kernels"
    )


def prefill_2k(report: Report) -> dict:
    rows = [
        r
        for r in _rows(report, "kernels", "flash_prefill")
        if r.get("config", "").startswith("default") and r.get("heads") == "32/8x128"
    ]
    value = rows[0]["time_vs_sdpa"] if rows else None
    met = None if value is None or report["mode"] == "cpu" else value <= 2.0
    return _goal("flash prefill at 2k tokens", "<= 2x SDPA flash time", value, met, "kernels")


def cuda_graph_b1(report: Report) -> dict:
    speed = report["parts"].get("cuda_graphs", {}).get("speedup", {}).get("batch 1")
    value = speed["eager_vs_compiled"] if speed else None
    met = None if value is None or report["mode"] == "cpu" else value >= 3.0
    return _goal(
        "CUDA-graph decode, batch 1, SmolLM2 shape", ">= 3x eager", value, met, "cuda_graphs"
    )


def int4_m1(report: Report) -> dict:
    rows = [
        r
        for r in _rows(report, "kernels", "int4_matmul")
        if r.get("shape", "").startswith("M=1 N=4096 K=4096") and r["config"].startswith("default")
    ]
    value = rows[0]["speedup_vs_dense"] if rows else None
    met = None if value is None or report["mode"] == "cpu" else value > 1.0
    return _goal("int4 matmul, M=1, 4096x4096", "faster than bf16 cuBLAS", value, met, "kernels")


GOALS: list[Callable[[Report], dict]] = [
    paged_64x2k,
    paged_1x8k,
    prefill_2k,
    cuda_graph_b1,
    int4_m1,
]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return lines


def markdown(report: Report) -> str:
    env = report["parts"].get("env", {})
    lines = [
        f"# GPU check ({report['mode']} mode)",
        "",
        f"Device: {env.get('device', '?')}; torch {env.get('torch', '?')}, triton "
        f"{env.get('triton', '?')}, transformers {env.get('transformers', '?')}; Triton kernels "
        f"ran as: {env.get('triton_mode', '?')}. {report['checks_passed']}/"
        f"{report['checks_total']} checks passed in {report['seconds']:.0f} s.",
        "",
        "Produced by `make gpu-check` (`python3 -m benchmarks.gpu_check`) at commit "
        f"{report.get('commit', 'unknown')}; every speed is a ratio or a fraction of a ceiling "
        "measured in the same run.",
        "",
        *([report["note"], ""] if report.get("note") else []),
        "## Goals",
        "",
    ]
    goal_rows = [
        {
            "goal": g["goal"],
            "target": g["target"],
            "measured": g["value"],
            "met": {True: "yes", False: "NO", None: "not measured"}[g["met"]],
        }
        for g in report["goals"]
    ]
    lines += _table(goal_rows)
    for name, part in report["parts"].items():
        lines += ["", f"## {name}: {part['status']} ({part['seconds']:.1f} s)", ""]
        if part["status"] != "ok":
            lines.append(f"{part.get('reason', '')}")
            if "traceback" in part:
                lines += ["", "```", part["traceback"][-1500:], "```"]
            continue
        for c in part.get("checks", []):
            mark = "PASS" if c["passed"] else "FAIL"
            detail = f": {_fmt(c['detail'])}" if c.get("detail") not in ("", None) else ""
            lines.append(f"- {mark} {c['name']}{detail}")
        for key, value in part.items():
            if key in ("status", "seconds", "checks"):
                continue
            if isinstance(value, list) and value and isinstance(value[0], dict):
                lines += ["", f"**{key}**", "", *_table(value)]
            else:
                lines += ["", f"**{key}**: {_fmt(value)}"]
    return "\n".join(lines) + "\n"
