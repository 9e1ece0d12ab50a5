"""ONNX Runtime decoding as production runs it: a fixed-size K/V cache written in place,
bound once with IOBinding, no copy of the cache per token (chapter 03).

`OrtDecoder` (minillm.export.onnx_runtime) feeds each step's presents back as the next
pasts: every step the graph concatenates past ++ new (a copy of the whole cache, per
layer) and `session.run` hands numpy arrays in and allocates new ones out. At 512 tokens
of context that copying is a large part of a small model's step.

Here the decoder-step graph takes the whole cache buffer `past_key_i [batch, kv_heads,
max_sequence, head_dim]` and a `cache_position [sequence]` input (the slots this step's
tokens go to), writes the new K/V there with `scatter` (ONNX ScatterElements on the slot
axis), attends over all `max_sequence` slots with `attention_mask [batch, max_sequence]`
(1 = slot holds a real token) and outputs the buffer as `present_key_i`.

`OrtStaticDecoder` binds each layer's past input and present output to the *same* OrtValue
(one preallocated numpy buffer): ORT's ScatterElements sees its output is its input and
skips the copy, so a step writes only the new slot (a lone ScatterElements on a
[1, 3, 40960, 4] buffer, measured: 4 us in place, 240 us into a separate buffer).

One more copy hides in attention: the exporter translates grouped-query attention by
repeating K and V up to the number of query heads, every step. `grouped_sdpa` (the
cache's `sdpa`) exports it per kv head instead. benchmarks/ort_iobinding.py times the whole
decode; ORT GenAI does the same with its own attention op (`past_present_share_buffer`).

What is left of a step besides the weights is many small nodes: an RMSNorm exports as
seven (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul: ORT's optimizer fuses the
x / sqrt(.) form, not torch's x * rsqrt(.)), RoPE as six per tensor, attention as a
dozen. ONNX opset 23 has an op for each of the three (RMSNormalization, RotaryEmbedding,
Attention with grouped-query heads), the standard counterparts of the contrib ops ORT
GenAI's builder writes; `onnx_llm_ops` exports the model with them (`llm_ops=True`), through
the model's and the cache's extension points (`Transformer.using`, `SdpaCache.sdpa`).
`minillm.export.onnx_gqa` goes one step further, to GenAI's own GroupQueryAttention node
(RoPE, the cache write and attention in one), and `onnx_gqa_fuse` to GenAI's graph shape.
Both decoders share their IOBinding code (`minillm.export.ort_binding.SharedBufferDecoder`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minillm.cache.protocol import SdpaCache, SdpaFn, masked_sdpa
from minillm.export.onnx import export_module, finish_graph
from minillm.export.ort_binding import SharedBufferDecoder, kv_names
from minillm.model.transformer import Transformer

LLM_OPSET = 23  # the first opset with RMSNormalization, RotaryEmbedding and Attention


class ScatterCache(SdpaCache):
    """The cache protocol over fixed-size buffers that arrive as graph inputs: `update`
    scatters the step's K/V into slots `cache_position` and returns the whole buffer;
    `sdpa` attends over it (`SdpaCache.sdpa`: `grouped_sdpa`, `onnx_attention`)."""

    def __init__(
        self,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        cache_position: torch.Tensor,
        sdpa: SdpaFn = masked_sdpa,
    ) -> None:
        self.present = [list(kv) for kv in past]
        self.attention_mask, self.cache_position, self.sdpa = mask, cache_position, sdpa

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, kv_heads, T, head_dim] at slots cache_position [T]."""
        slots = self.cache_position.view(1, 1, -1, 1).expand_as(k)
        for i, new in enumerate((k, v)):
            buf = self.present[layer][i]
            self.present[layer][i] = buf.scatter(2, slots, new.to(buf.dtype))
        return self.present[layer][0], self.present[layer][1]

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, S]: query t sees real slots up to its own slot, and always itself."""
        S = self.attention_mask.shape[1]
        slots = torch.arange(S, device=positions.device)
        own = self.cache_position[:, None]  # [T, 1]
        real = self.attention_mask.bool()[:, None, None, :]
        return ((slots[None, :] <= own) & real) | (slots[None, :] == own)


def grouped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """A cache's `sdpa` that exports grouped-query attention as attention per kv head with
    its query heads stacked, instead of the exporter's translation of `enable_gqa=True`,
    which first repeats K and V up to the query heads: a copy of the whole cache per layer
    per step.

    Query head h = g * n_rep + r uses kv head g, so q [B, H, T, d] viewed as
    [B, kv_heads, n_rep * T, d] puts every query of kv head g against K[:, g] once."""
    if mask is None or mask.dtype != torch.bool:
        raise ValueError("grouped_sdpa exports the cached step: a boolean mask only")
    B, H, T, D = q.shape
    groups = k.shape[1]
    rep = H // groups
    qg = q.reshape(B, groups, rep * T, D)
    mask = mask.unsqueeze(2).expand(B, 1, rep, T, -1).reshape(B, 1, rep * T, -1)
    scores = (qg @ k.transpose(-1, -2)) * D**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    # P.V with V broadcast over its query heads rather than one [rep * T, S] @ [S, D]
    # product: at decode (T = 1) each is a matrix-vector product, which ORT's MLAS runs
    # straight from V, where a product with several rows first packs V into a scratch
    # copy (30 layers at 2064 slots: 2.7 ms instead of 4.5, benchmarks/ort_iobinding).
    out = probs.reshape(B, groups, rep, T, -1) @ v.unsqueeze(2)
    return out.reshape(B, H, T, D)


def onnx_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's `ops.norm` as one opset-23 RMSNormalization node (`F.rms_norm`) instead
    of the seven elementary ops torch's x * rsqrt(.) form becomes."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def onnx_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's `ops.rope` as one opset-23 RotaryEmbedding node."""
    half = cos.shape[-1] // 2  # the tables repeat each angle for channels i and i + d/2
    return torch.onnx.ops.rotary_embedding(x, cos[..., :half], sin[..., :half])


def onnx_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """A cache's `sdpa` (and the model's `ops.attention`) as one opset-23 Attention node,
    grouped by q/kv_num_heads natively."""
    if mask is None:
        raise ValueError("onnx_llm_ops exports the cached step: an explicit mask only")
    heads = {"q_num_heads": q.shape[1], "kv_num_heads": k.shape[1]}
    return torch.onnx.ops.attention(q, k, v, mask, **heads)[0]


def onnx_llm_ops(model: Transformer) -> contextlib.AbstractContextManager[Transformer]:
    """`with onnx_llm_ops(model):` the model's RMSNorm, RoPE and attention as single
    opset-23 nodes (RMSNormalization, RotaryEmbedding, Attention) instead of the elementary
    ops they are written in (the cache's attention is its `sdpa`: give it `onnx_attention`,
    as `export_static_step` does).
    `torch.onnx.ops` gives each a PyTorch reference the trace runs, so the exported graph
    computes what the model computes (tests/test_onnx_static.py)."""
    return model.using(norm=onnx_rms_norm, rope=onnx_rope, attention=onnx_attention)


class StaticStepGraph(nn.Module):
    """(ids, positions, attention_mask, cache_position, cache buffers) -> (logits, buffers)."""

    def __init__(self, model: Transformer, sdpa: SdpaFn = masked_sdpa) -> None:
        super().__init__()
        self.model, self.sdpa = model, sdpa  # sdpa: the cache's attention (`ScatterCache`)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_position: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        cache = ScatterCache(past, attention_mask, cache_position, self.sdpa)
        logits = self.model(input_ids, position_ids, cache=cache)
        return (logits, *(t for kv in cache.present for t in kv))


def static_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the static-cache step graph."""
    kv = kv_names(num_layers)
    inputs = ["input_ids", "position_ids", "attention_mask", "cache_position"]
    return inputs + [f"past_{n}" for n in kv], ["logits", *(f"present_{n}" for n in kv)]


def export_static_step(
    model: Transformer, path: str | Path, grouped: bool = True, llm_ops: bool = False
) -> Path:
    """Export the static-cache decoder step with dynamic batch, sequence and
    max_sequence axes (checked by `check_onnx`); `grouped`: attention per kv head
    (`grouped_sdpa`), no repeated copy of K/V; `llm_ops`: opset 23's RMSNormalization,
    RotaryEmbedding and Attention (`onnx_llm_ops`; its Attention is grouped natively)."""
    cfg, n = model.config, model.config.num_hidden_layers
    inputs, outputs = static_names(n)
    batch, seq, slots = 2, 3, 8  # distinct sizes, so no axis is mistaken for another
    kv_shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
    dtype = model.lm_head.weight.dtype
    example = (
        torch.zeros(batch, seq, dtype=torch.long),
        torch.arange(seq).expand(batch, seq).contiguous(),
        torch.ones(batch, slots, dtype=torch.long),
        torch.arange(seq),
        [
            (torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype))
            for _ in range(n)
        ],
    )
    d = torch.export.Dim.DYNAMIC
    kv_dims = {0: d, 2: d}
    dynamic = ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d}, {0: d}, [(kv_dims, kv_dims)] * n)
    context, sdpa, opset = contextlib.nullcontext(), masked_sdpa, None
    if llm_ops:
        context, sdpa, opset = onnx_llm_ops(model), onnx_attention, LLM_OPSET
    elif grouped:
        sdpa = grouped_sdpa
    with context:
        graph = StaticStepGraph(model, sdpa)
        export_module(graph, example, path, inputs, outputs, dynamic, opset_version=opset)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "max_sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in inputs[4:] + outputs[1:]:
        axes[name] = {0: "batch", 2: "max_sequence"}
    return finish_graph(path, model, axes)


class OrtStaticDecoder(SharedBufferDecoder):
    """The static-cache step graph (`export_static_step`): prompts left-padded, one
    `cache_position` for every row, an attention mask over the slots."""

    GRAPH_INPUT, EXPORTER = "cache_position", "export_static_step"

    def step(
        self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, slots: np.ndarray
    ) -> np.ndarray:
        """One run writing K/V at `slots`; returns logits [B, T, vocab]."""
        names = ("input_ids", "position_ids", "attention_mask", "cache_position")
        values = (ids, positions, mask, slots)
        return self.run(
            {n: np.ascontiguousarray(v, np.int64) for n, v in zip(names, values, strict=True)}
        )

    def prefill(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        longest = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), longest), np.int64)
        mask = np.zeros((len(prompts), self.max_len), np.int64)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p) :], mask[b, longest - len(p) : longest] = p, 1
        positions = np.maximum(mask[:, :longest].cumsum(1) - 1, 0)
        logits = self.step(ids, positions, mask, np.arange(longest))[:, -1]
        slot, pos = longest, positions[:, -1] + 1

        def step(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal slot, pos
            mask[:, slot] = 1
            out = self.step(tokens.numpy()[:, None], pos[:, None], mask, np.array([slot]))
            slot, pos = slot + 1, pos + 1
            return torch.from_numpy(out[:, -1])

        return torch.from_numpy(logits), step
