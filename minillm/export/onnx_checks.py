"""Inspect an exported ONNX graph: the checker, its input/output shapes, whether every axis
meant to be dynamic stayed dynamic (`FrozenAxisError` otherwise), and its op counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class FrozenAxisError(ValueError):
    """An axis meant to be dynamic would be (or was) exported as a constant."""


def _dims(value_info: Any) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def graph_shapes(proto: Any) -> dict[str, list[int | str]]:
    """Each graph input's and output's shape: ints for fixed axes, names for dynamic ones."""
    return {v.name: _dims(v) for v in [*proto.graph.input, *proto.graph.output]}


def check_onnx(
    path: str | Path | Any, dynamic: Mapping[str, Mapping[int, str]] | None = None
) -> Any:
    """Run `onnx.checker` on the file and check that each axis in `dynamic` ({name: {dim:
    axis}}) is symbolic in the graph; raise `FrozenAxisError` naming any that is fixed."""
    import onnx

    proto = onnx.load(str(path)) if isinstance(path, (str, Path)) else path
    onnx.checker.check_model(proto, full_check=True)
    shapes = graph_shapes(proto)
    for name, axes in (dynamic or {}).items():
        if name not in shapes:
            raise ValueError(f"no graph input or output named {name!r}; have {sorted(shapes)}")
        for dim, axis in axes.items():
            if isinstance(shapes[name][dim], int):
                raise FrozenAxisError(
                    f"{name} dim {dim} ({axis}) is fixed at {shapes[name][dim]} in the exported "
                    f"graph (shape {shapes[name]}): mark it dynamic when exporting "
                    "(dynamic_shapes with Dim.DYNAMIC for dynamo=True, dynamic_axes for "
                    "dynamo=False); if it was marked, export with an example of size >= 2 on it."
                )
    return proto


def op_counts(path_or_proto: str | Path | Any) -> Counter[str]:
    """How many nodes of each op type the graph has (domain-prefixed if not ONNX's own)."""
    import onnx

    proto = (
        onnx.load(str(path_or_proto)) if isinstance(path_or_proto, (str, Path)) else path_or_proto
    )
    return Counter(
        f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        for n in proto.graph.node
    )
