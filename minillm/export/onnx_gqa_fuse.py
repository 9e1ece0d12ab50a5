"""The two fusions ORT GenAI's builder writes and our traced GroupQueryAttention graph lacks
(chapter 03).

`export_gqa_step` traces the model, so its graph keeps the model's structure around the
GroupQueryAttention node: three projections, each viewed as heads and flattened back
(two Reshapes that undo each other), the node's output viewed and flattened again before
o_proj, and each residual Add followed by its own RMSNormalization. GenAI's builder
writes the graph op by op and has neither:

    pack qkv    q, k and v read the same normed input: one MatMul with the weight
                [Wq | Wk | Wv] (and bias, if the model has one) feeds the node's packed
                query input, key and value left empty, as GenAI's qkv_proj does. The
                Reshape pairs on the way in and out go with it: the node takes and gives
                [batch, tokens, heads * head_dim], the layout a projection has.
    skip norm   Add(residual, x) then RMSNormalization becomes one com.microsoft
                SkipSimplifiedLayerNormalization, whose fourth output is the sum the next
                residual Add reads.

Both are exact in real arithmetic (the packed product computes the same dot products).
This is not a general optimizer: it rewrites the graph `export_gqa_step` writes and
raises on anything else. onnxscript's `ort_fusions.optimize_for_ort`, the general one,
finds neither pattern in that graph (it matches SimplifiedLayerNormalization, not opset
23's RMSNormalization, and a packed QKV cut by Slice nodes).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

MS = "com.microsoft"


class _Graph:
    """A GraphProto with its producer and consumer maps (built once: the rewrites only
    splice nodes in and out and rename consumer inputs, kept in sync by `rewire`)."""

    def __init__(self, proto: Any) -> None:
        self.graph = proto.graph
        self.inits = {t.name: t for t in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output if o}
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for n in self.graph.node:
            for name in n.input:
                self.consumers[name].append(n)

    def only_consumer(self, name: str, op: str) -> Any:
        users = self.consumers[name]
        if len(users) != 1 or users[0].op_type != op:
            raise ValueError(
                f"{name} feeds {[u.op_type for u in users]}, expected one {op}: "
                "fuse_gqa_graph rewrites the graph export_gqa_step writes, unchanged"
            )
        return users[0]

    def rewire(self, old: str, new: str) -> None:
        """Every node that read `old` reads `new`."""
        for user in self.consumers.pop(old, []):
            user.input[:] = [new if name == old else name for name in user.input]
            self.consumers[new].append(user)

    def weight(self, name: str) -> np.ndarray:
        if name not in self.inits:
            raise ValueError(f"{name} is computed, not a stored weight: nothing to pack")
        return numpy_helper.to_array(self.inits[name])

    def add_init(self, name: str, value: np.ndarray) -> None:
        self.graph.initializer.append(numpy_helper.from_array(value, name))


def _projection(g: _Graph, name: str) -> tuple[Any, Any | None]:
    """The MatMul (and bias Add) that `name`, a GroupQueryAttention input, is computed by
    through the per-head view and back (Reshapes)."""
    node = g.producer.get(name)
    while node is not None and node.op_type == "Reshape":
        node = g.producer.get(node.input[0])
    bias = None
    if node is not None and node.op_type == "Add":
        bias, node = node, g.producer.get(next(i for i in node.input if i not in g.inits))
    if node is None or node.op_type != "MatMul":
        source = "a graph input" if node is None else node.op_type
        raise ValueError(
            f"GroupQueryAttention's input {name} comes from {source}, not a projection: "
            "fuse_gqa_graph rewrites the graph export_gqa_step writes, unchanged"
        )
    return node, bias


def _pack_qkv(g: _Graph, gqa: Any, new_nodes: dict[int, list[Any]]) -> None:
    if not all(gqa.input[:3]):
        raise ValueError(f"{gqa.name} already takes q, k, v packed: the graph is fused")
    projections = [_projection(g, name) for name in gqa.input[:3]]
    matmuls = [mm for mm, _ in projections]
    if len({mm.input[0] for mm in matmuls}) != 1:
        raise ValueError(f"{gqa.name}: q, k and v are projections of different inputs")
    stem = f"{gqa.name}/qkv_proj"
    g.add_init(f"{stem}.weight", np.concatenate([g.weight(m.input[1]) for m in matmuls], 1))
    packed = [helper.make_node("MatMul", [matmuls[0].input[0], f"{stem}.weight"], [stem])]
    biases = [b for _, b in projections]
    if any(biases):
        if not all(biases):
            raise ValueError(f"{gqa.name}: some of q, k, v have a bias and some do not")
        stored = [g.weight(next(i for i in b.input if i in g.inits)) for b in biases]
        g.add_init(f"{stem}.bias", np.concatenate(stored, -1))
        packed.append(helper.make_node("Add", [stem, f"{stem}.bias"], [f"{stem}/biased"]))
    new_nodes[id(matmuls[0])] = packed  # where q's projection was: its input is ready
    gqa.input[:3] = [packed[-1].output[0], "", ""]
    # The output: the node's [B, T, H*D] viewed as heads, flattened back, then o_proj.
    view = g.only_consumer(gqa.output[0], "Reshape")
    flat = g.only_consumer(view.output[0], "Reshape")
    g.rewire(flat.output[0], gqa.output[0])


def _skip_norm(g: _Graph, norm: Any, new_nodes: dict[int, list[Any]]) -> bool:
    add = g.producer.get(norm.input[0])
    if add is None or add.op_type != "Add" or any(i in g.inits for i in add.input):
        return False  # not a residual sum: the first layer's norm of the embeddings
    attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
    if attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1:
        raise ValueError(f"{norm.name}: {attrs} is not a last-axis float32 RMSNorm")
    keep_sum = len(g.consumers[add.output[0]]) > 1  # the next residual reads the sum
    fused = helper.make_node(
        "SkipSimplifiedLayerNormalization",
        [*add.input, norm.input[1]],
        [norm.output[0], "", "", add.output[0]] if keep_sum else [norm.output[0]],
        domain=MS,
        epsilon=attrs.get("epsilon", 1e-5),
    )
    new_nodes[id(add)] = [fused]  # the Add's place: its inputs are ready there
    new_nodes[id(norm)] = []
    return True


def fuse_gqa_graph(proto: Any) -> Counter[str]:
    """Rewrite `proto` (an `export_gqa_step` graph) in place: each layer's q, k, v as one
    packed projection into GroupQueryAttention, each residual Add and RMSNormalization as
    one SkipSimplifiedLayerNormalization. Returns how many of each it fused."""
    g = _Graph(proto)
    gqas = [n for n in g.graph.node if n.op_type == "GroupQueryAttention"]
    if not gqas:
        raise ValueError(
            "no GroupQueryAttention node: fuse_gqa_graph rewrites the graph export_gqa_step writes"
        )
    new_nodes: dict[int, list[Any]] = {}  # id(node) -> what replaces it, in its place
    done: Counter[str] = Counter()
    for gqa in gqas:
        _pack_qkv(g, gqa, new_nodes)
        done["packed qkv"] += 1
    for norm in [n for n in g.graph.node if n.op_type == "RMSNormalization"]:
        done["skip norm"] += _skip_norm(g, norm, new_nodes)
    nodes = [m for n in g.graph.node for m in new_nodes.get(id(n), [n])]
    _drop_unused(g.graph, nodes)
    return done


def _drop_unused(graph: Any, nodes: list[Any]) -> None:
    """Keep the nodes (and initializers) the graph's outputs still depend on."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed |= set(node.input)
    graph.ClearField("node")
    graph.node.extend(reversed(kept))
    live = [t for t in graph.initializer if t.name in needed]
    graph.ClearField("initializer")
    graph.initializer.extend(live)
