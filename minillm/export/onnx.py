"""Export minillm to ONNX and run it with ONNX Runtime: chapter 03.

Chapter 03's API (stable; chapter 04 builds on it), by module:

    onnx (here)
    export_forward(model, path, ...)         -> Path   input_ids -> logits
    export_decoder_step(model, path, ...)    -> Path   one step with explicit past K/V
    export_module(module, args, path, ...)   torch.onnx.export of any module, pitfalls named
    ConcatCache, ForwardGraph, DecoderStepGraph   the exported modules (model.py unchanged)
    UnsupportedOpError                       an op the exporter cannot write, named
    onnx_checks
    check_onnx(path, dynamic=...)            -> onnx.ModelProto   checker + dynamic axes
    op_counts(path_or_proto)                 -> Counter of op types
    FrozenAxisError                          an axis the trace froze, named
    onnx_runtime
    ort_session(path, level="all", threads=1, optimized_path=None, disabled_optimizers=())
    ort_logits_fn(session)                   -> (ids [B, T] -> logits [B, T, V]) for evaluate
    OrtDecoder(session).generate(prompts, params)   greedy / sampled generation on ORT
    quantize_int8(src, dst)                  -> Path   ORT dynamic int8 (weights int8)
    quiet
    quiet()                                  context: silence exporter prints and warnings

Two graphs:

1. **forward** (`export_forward`): `input_ids [batch, sequence]` -> `logits [batch,
   sequence, vocab]`, positions 0..T-1 and a causal mask built inside. What perplexity
   needs, and what article A's example exports.
2. **decoder step** (`export_decoder_step`): inputs `input_ids [batch, sequence]`,
   `position_ids [batch, sequence]`, `attention_mask [batch, past_sequence + sequence]`
   (int64, 1 = a real token, 0 = padding), and per layer i `past_key_i`, `past_value_i`
   `[batch, kv_heads, past_sequence, head_dim]`; outputs `logits [batch, sequence,
   vocab]` and `present_key_i`, `present_value_i` `[batch, kv_heads, past_sequence +
   sequence, head_dim]` (past and new K/V concatenated, the same names as Hugging
   Face's / Optimum's decoder graphs). One graph serves prefill (past_sequence = 0) and
   decode (sequence = 1): the loop feeds each step's presents back as the next pasts.

ONNX has no mutable buffers, so the pre-allocated `KVCache` of chapter 02 (written in
place at each position) becomes `ConcatCache`: the same cache protocol (the model calls
its `attention`), but its `update` returns past ++ new and the graph outputs that as the
present.

Pitfalls, caught here with errors that name the fix:

- an axis meant to be dynamic but exported as a constant (no `dynamic_shapes`, or, with
  earlier torch versions, an example of size 1 that `torch.export` specialised): the
  graph then rejects any other size. `export_forward` and `export_decoder_step` verify
  every intended dynamic axis of the saved graph with `check_onnx`, which raises
  `FrozenAxisError` naming the axis and the fix. (With torch 2.13 a 1-token example
  exports this model correctly: tests/test_onnx_export.py checks that.)
- an op with no ONNX translation (e.g. `torch.median`, `torch.erfinv`) fails deep in
  the exporter; `export_module` re-raises it as `UnsupportedOpError` naming the op and
  the two fixes (rewrite with supported ops, or `custom_translation_table`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minillm.cache.protocol import SdpaCache, SdpaFn, masked_sdpa
from minillm.export.onnx_checks import check_onnx
from minillm.export.quiet import quiet
from minillm.model.transformer import Transformer

FORWARD_AXES = {"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}


class UnsupportedOpError(RuntimeError):
    """The exporter has no ONNX translation for an op the model uses."""


class ConcatCache(SdpaCache):
    """KVCache's interface for an exported graph: K/V arrive as inputs (`past`) and
    leave as outputs (`presents`), past and new concatenated along the sequence axis.

    `attention_mask [B, P + T]` marks real slots (1) and padding (0): a query at slot
    P + t sees the real slots up to its own, and always itself (so a padding query's
    softmax has a finite row instead of NaNs that would leak into later layers' V).
    `sdpa`: the attention this cache runs over its K/V (`SdpaCache.sdpa`)."""

    def __init__(
        self,
        past_k: Sequence[torch.Tensor],
        past_v: Sequence[torch.Tensor],
        mask: torch.Tensor,
        sdpa: SdpaFn = masked_sdpa,
    ) -> None:
        self.past_k, self.past_v, self.attention_mask = list(past_k), list(past_v), mask
        self.present_k, self.present_v = list(past_k), list(past_v)  # past ++ new, per layer
        self.sdpa = sdpa

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, kv_heads, T, head_dim] to the layer's past; return all of it."""
        self.present_k[layer] = torch.cat([self.past_k[layer], k.to(self.past_k[layer].dtype)], 2)
        self.present_v[layer] = torch.cat([self.past_v[layer], v.to(self.past_v[layer].dtype)], 2)
        return self.present_k[layer], self.present_v[layer]

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, P + T]: slot s is visible to query t if s <= P + t and s is real."""
        T, S = positions.shape[1], self.attention_mask.shape[1]
        slots = torch.arange(S, device=positions.device)
        query_slots = torch.arange(T, device=positions.device) + (S - T)
        causal = slots[None, :] <= query_slots[:, None]  # [T, S]
        real = self.attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        return (causal & real) | (slots[None, :] == query_slots[:, None])


class ForwardGraph(nn.Module):
    """input_ids -> logits: the model's plain causal forward, as one function to export."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


class DecoderStepGraph(nn.Module):
    """(ids, positions, attention_mask, past K/V of every layer) -> (logits, presents)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        cache = ConcatCache([k for k, _ in past], [v for _, v in past], attention_mask)
        logits = self.model(input_ids, position_ids, cache=cache)
        presents = [t for kv in zip(cache.present_k, cache.present_v, strict=True) for t in kv]
        return (logits, *presents)


def step_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the decoder-step graph for a model of `num_layers`."""
    kv = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "position_ids", "attention_mask", *(f"past_{n}" for n in kv)]
    return inputs, ["logits", *(f"present_{n}" for n in kv)]


def step_dynamic_axes(num_layers: int) -> dict[str, dict[int, str]]:
    """Which axis of each decoder-step input/output is dynamic, and its name."""
    inputs, outputs = step_names(num_layers)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in inputs[3:]:
        axes[name] = {0: "batch", 2: "past_sequence"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 2: "total_sequence"}
    return axes


_MISSING_OP = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'")


def export_module(
    module: nn.Module,
    args: tuple[Any, ...],
    path: str | Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: Any = None,
    dynamo: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    opset_version: int | None = None,
    unoptimized_path: str | Path | None = None,
    **kwargs: Any,
) -> Path:
    """`torch.onnx.export` to one self-contained file, quietly, with the unsupported-op
    failure re-raised as `UnsupportedOpError` naming the op and the fixes.
    `unoptimized_path` (dynamo only) also saves the graph before the exporter's own
    optimisation pass (constant folding, dead code and common subexpressions removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = dict(
        input_names=list(input_names), output_names=list(output_names), dynamo=dynamo
    )
    if opset_version is not None:
        options["opset_version"] = opset_version
    if dynamo:
        options.update(dynamic_shapes=dynamic_shapes, external_data=False)
        if unoptimized_path is not None:
            options["optimize"] = False
    else:
        axes = {k: dict(v) for k, v in (dynamic_axes or {}).items()}
        options.update(f=str(path), dynamic_axes=axes)
    try:
        with quiet(), torch.no_grad():
            program = torch.onnx.export(module.eval(), args, **options, **kwargs)
    except torch.onnx.OnnxExporterError as err:
        match = _MISSING_OP.search(str(err))
        if match is None:
            raise
        op = f"torch.ops.{match[1]}.{match[2]}"
        raise UnsupportedOpError(
            f"the ONNX exporter has no translation for {op}. Fix: rewrite that part of "
            f"the model with ops ONNX has (e.g. sort/topk, where, matmul), or pass "
            f"custom_translation_table={{{op}: <an onnxscript function>}} to "
            "torch.onnx.export."
        ) from err
    if program is not None:  # the dynamo exporter returns the program; legacy writes `f`
        if unoptimized_path is not None:
            program.save(str(unoptimized_path))
            with quiet():
                program.optimize()
        program.save(str(path))
    return path


def sdpa_without_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query SDPA, kv heads repeated up to the query heads first: the legacy
    (TorchScript) exporter cannot translate `enable_gqa`. A model's `ops.attention` (no
    mask: causal) or a cache's `sdpa`."""
    if k.shape[-3] != q.shape[-3]:
        n_rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(n_rep, dim=-3), v.repeat_interleave(n_rep, dim=-3)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None
    )


def export_forward(
    model: Transformer,
    path: str | Path,
    example_ids: torch.Tensor | None = None,
    dynamo: bool = True,
    opset_version: int | None = None,
    unoptimized_path: str | Path | None = None,
) -> Path:
    """Export input_ids [batch, sequence] -> logits [batch, sequence, vocab], both axes
    dynamic. `dynamo=False` uses the legacy TorchScript exporter (`dynamic_axes`);
    `unoptimized_path` also keeps the graph before the exporter's optimisation pass."""
    if example_ids is None:
        example_ids = torch.zeros(2, 8, dtype=torch.long)
    # The legacy exporter cannot translate SDPA's enable_gqa: repeat the kv heads first.
    with contextlib.nullcontext() if dynamo else model.using(attention=sdpa_without_gqa):
        export_module(
            ForwardGraph(model),
            (example_ids.to(model.lm_head.weight.device),),
            path,
            ["input_ids"],
            ["logits"],
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},),
            dynamo=dynamo,
            dynamic_axes=FORWARD_AXES,
            opset_version=opset_version,
            unoptimized_path=unoptimized_path,
        )
    return finish_graph(path, model, FORWARD_AXES)


def step_example(
    model: Transformer, batch: int = 2, seq: int = 3, past: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Example inputs of the decoder-step graph (random past, all slots real)."""
    cfg = model.config
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    positions = (torch.arange(seq, device=device) + past).expand(batch, seq).contiguous()
    mask = torch.ones(batch, past + seq, dtype=torch.long, device=device)
    shape = (batch, cfg.num_key_value_heads, past, cfg.head_dim)
    kv = [
        (
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return ids, positions, mask, kv


def export_decoder_step(
    model: Transformer, path: str | Path, batch: int = 2, seq: int = 3, past: int = 4
) -> Path:
    """Export the decoder step (see the module docstring for its inputs and outputs)
    with dynamic batch, sequence and past_sequence axes, traced on an example of the
    given sizes; `check_onnx` then verifies that those axes stayed dynamic."""
    n = model.config.num_hidden_layers
    inputs, outputs = step_names(n)
    axes = step_dynamic_axes(n)
    example = step_example(model, batch, seq, past)
    dim = torch.export.Dim.DYNAMIC
    kv_shape = {0: dim, 2: dim}
    dynamic_shapes = (
        {0: dim, 1: dim},
        {0: dim, 1: dim},
        {0: dim, 1: dim},
        [(kv_shape, kv_shape) for _ in range(n)],
    )
    export_module(DecoderStepGraph(model), example, path, inputs, outputs, dynamic_shapes)
    return finish_graph(path, model, axes)


def finish_graph(
    path: str | Path,
    model: Transformer,
    axes: Mapping[str, Mapping[int, str]],
    rewrite: Callable[[Any], Any] | None = None,
) -> Path:
    """The exported file's last pass, one load and one save (a real model's graph is
    hundreds of MB): `add_metadata`, then `rewrite` (a graph rewrite such as
    `fuse_gqa_graph`), then `check_onnx` that every axis in `axes` stayed dynamic."""
    import onnx

    proto = onnx.load(str(path))
    add_metadata(proto, model, axes)
    if rewrite is not None:
        rewrite(proto)
    check_onnx(proto, dynamic=axes)
    onnx.save(proto, str(path))
    return Path(path)


def add_metadata(proto: Any, model: Transformer, axes: Mapping[str, Mapping[int, str]]) -> None:
    """Name the dynamic axes of the ONNX `proto` (the exporter calls them s0, s1, ...) and
    store what a runtime needs besides the graph (EOS, context) in it, in place."""
    rename: dict[str, str] = {}
    for v in proto.graph.input:
        for dim, axis in axes.get(v.name, {}).items():
            d = v.type.tensor_type.shape.dim[dim]
            if d.dim_param:
                rename[d.dim_param] = axis
    if rename:
        symbol = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
        for v in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
            for d in v.type.tensor_type.shape.dim:
                if d.dim_param:
                    d.dim_param = symbol.sub(lambda m: rename[m[1]], d.dim_param)
    for key in ("eos_token_id", "max_position_embeddings"):
        entry = proto.metadata_props.add()
        entry.key, entry.value = f"minillm.{key}", repr(getattr(model.config, key))
