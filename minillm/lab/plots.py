"""Matplotlib helpers the notebooks share: grouped bars, 100% stacked bars, sweeps.

Each helper draws on the given `ax` (or a new figure), labels the bars with their
values and returns the Axes, so a notebook cell stays one call long.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

Series = Mapping[str, float]


def _new_ax(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def bar_chart(
    data: Series | Mapping[str, Series],
    *,
    ylabel: str,
    title: str | None = None,
    fmt: Callable[[float], str] | None = "{:.3g}".format,
    log: bool = False,
    baseline: float | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Bars of `{label: value}`, or grouped bars of `{group: {series: value}}`.

    `fmt` writes each value above its bar (None: no labels); `baseline` draws a
    dashed line (e.g. 1.0 on a chart of ratios); `log` uses a log y axis, for
    values that span orders of magnitude such as memory across model sizes.
    """
    groups: Mapping[str, Series]
    if isinstance(next(iter(data.values())), Mapping):
        groups = data  # type: ignore[assignment]
    else:  # one series: one single-bar group per label
        groups = {label: {"": value} for label, value in data.items()}  # type: ignore[misc]
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    own_figure = ax is None
    ax = _new_ax(ax, (max(4.0, 0.9 * len(groups) * len(series) ** 0.5 + 2), 3.4))
    width = 0.8 / len(series)
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(name, float("nan")) for g in groups.values()]
        bars = ax.bar(xs, ys, width, label=name or None)
        if fmt is not None:
            labels = [fmt(y) if y == y else "" for y in ys]  # y != y: missing (nan)
            ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)), list(groups))
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle="--", linewidth=1)
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if len(series) > 1 and own_figure:  # below the axes, clear of the value labels
        fits = sum(len(s) + 6 for s in series) * 0.07 <= ax.figure.get_figwidth()  # ~inches
        ax.figure.legend(loc="outside lower center", ncol=len(series) if fits else 1, fontsize=8)
    elif len(series) > 1:
        ax.legend(fontsize=8)
    return ax


def stacked_fractions(
    rows: Mapping[str, Series],
    *,
    title: str | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Horizontal 100% bars: one row per case, `{part: fraction}` stacked left to right.

    Fractions of a row should sum to 1 (e.g. the parts of a `TimeSplit`); segments
    wider than 6% carry their percentage.
    """
    parts = list(dict.fromkeys(p for r in rows.values() for p in r))
    own_figure = ax is None
    ax = _new_ax(ax, (7.5, 0.55 * len(rows) + 1.4))
    labels = list(rows)[::-1]  # first row on top
    left = [0.0] * len(labels)
    for part in parts:
        widths = [rows[label].get(part, 0.0) for label in labels]
        bars = ax.barh(labels, widths, left=left, label=part)
        texts = [f"{w:.0%}" if w >= 0.06 else "" for w in widths]
        ax.bar_label(bars, labels=texts, label_type="center", fontsize=8, color="white")
        left = [a + w for a, w in zip(left, widths, strict=True)]
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    if own_figure:  # below the axes, outside them (constrained layout makes room)
        ax.figure.legend(loc="outside lower center", ncol=len(parts), fontsize=8)
    else:
        ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def line_chart(
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    ax: Axes | None = None,
) -> Axes:
    """One line with markers per series over shared x values (a sweep: size, position,
    batch). Log axes for sweeps over orders of magnitude."""
    ax = _new_ax(ax, (6.0, 3.6))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", markersize=4, label=name)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return ax
