"""How an exercise test words a failure: the case, what was expected, what came back, and
a hint (`tests/exercises/`, read by a learner through `check()`)."""

from __future__ import annotations

import math

import torch


def worst(actual, expected, equal_nan: bool = False) -> str:
    """Where two tensors differ most: 'expected E at index I, got A' (a shape or dtype
    difference if that is all there is). Never raises: it only words a failure."""
    try:
        a, e = actual.detach().double(), expected.detach().double()
        if a.shape != e.shape:
            return f"expected shape {tuple(e.shape)}, got {tuple(a.shape)}"
        gap = (a - e).abs().nan_to_num(nan=math.inf)
        gap[a == e] = 0  # -inf == -inf too
        if equal_nan:
            gap[a.isnan() & e.isnan()] = 0
        if gap.numel() == 0 or gap.max() == 0:
            if actual.dtype != expected.dtype:
                return f"expected dtype {expected.dtype}, got {actual.dtype}"
            return "no element differs in value (their bits do: -0.0 vs 0.0?)"
        i = tuple(int(n) for n in torch.unravel_index(gap.argmax(), gap.shape))
        return f"expected {e[i].item():.6g} at index {i}, got {a[i].item():.6g}"
    except Exception:
        return f"expected {expected!r:.200}, got {actual!r:.200}"


def assert_close(actual, expected, what: str, hint: str, **tol) -> None:
    """torch.testing.assert_close (the same tolerances), failing with the case, the worst
    element's expected and actual value, torch's summary, and a hint at the mistake."""

    def message(summary: str) -> str:
        where = worst(actual, expected, tol.get("equal_nan", False))
        lines = [s for s in summary.splitlines() if s.strip() and " are not " not in s][:2]
        lines = [] if where.startswith("expected shape") else lines
        return "\n".join([f"{what}: {where}", *lines, f"hint: {hint}"])

    torch.testing.assert_close(actual, expected, msg=message, **tol)
