"""The harness's results as a table, a SUMMARY line and a bar chart."""

from __future__ import annotations

from typing import Any

from minillm.lab.memory import format_bytes
from minillm.lab.plots import bar_chart


def format_table(result: dict[str, Any]) -> str:
    """One line per backend: throughputs, p50/p99 latencies (ms), memory (peak RSS of the
    process, and what loading + warming up this backend added to it), same tokens."""
    width = max([24] + [len(label_of(r)) for r in result["results"]])
    head = (
        f"{'backend':{width}s} {'status':7s} {'conc':>4s} {'req/s':>6s} {'tok/s':>7s} "
        f"{'TTFT p50/p99':>13s} "
        f"{'TPOT p50/p99':>13s} {'ITL p50/p99':>13s} {'E2E p50/p99':>15s} {'peak RSS':>9s} "
        f"{'RSS +':>9s} {'same':>5s}"
    )
    lines = [head]
    for r in result["results"]:
        if r["status"] != "ok":
            lines.append(f"{label_of(r):{width}s} {r['status']:7s} {r['reason']}")
            continue
        pair = lambda k, r=r: f"{r[k]['p50']:.1f}/{r[k]['p99']:.1f}"  # noqa: E731
        rss = format_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "n/a"
        added = format_bytes(r["rss_increase_bytes"]) if r["peak_rss_bytes"] else "n/a"
        lines.append(
            f"{label_of(r):{width}s} {'ok':7s} {r['concurrency']:4d} {r['req_s']:6.2f} "
            f"{r['output_tok_s']:7.1f} "
            f"{pair('ttft_ms'):>13s} {pair('tpot_ms'):>13s} {pair('itl_ms'):>13s} "
            f"{pair('e2e_ms'):>15s} {rss:>9s} {added:>9s} {r['same_as_minillm']:5.0%}"
        )
    return "\n".join(lines)


def label_of(row: dict[str, Any]) -> str:
    """A row's name: the backend, with its concurrency when above 1 (`minillm x8`)."""
    level = row.get("concurrency", 1)
    return row["backend"] if level == 1 else f"{row['backend']} x{level}"


def plot_results(
    result: dict[str, Any], metric: str = "tpot_ms", stat: str = "p50", ax: Any = None
) -> Any:
    """Bar chart of one metric over the backends that ran (e.g. tpot_ms p50, output_tok_s)."""
    ok = [r for r in result["results"] if r["status"] == "ok"]
    if not ok:
        raise ValueError("no backend ran: nothing to plot")
    short = lambda r: label_of(r).replace("http://", "").replace("/v1", "")  # noqa: E731
    data = {short(r): r[metric][stat] if isinstance(r[metric], dict) else r[metric] for r in ok}
    label = f"{metric} ({stat})" if isinstance(ok[0][metric], dict) else metric
    ax = bar_chart(data, ylabel=label, title=f"{result['workload'].get('name', 'workload')}", ax=ax)
    ax.tick_params(axis="x", labelrotation=30)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    return ax
