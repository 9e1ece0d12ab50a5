"""ORT's own attention node in our export: com.microsoft GroupQueryAttention (chapter 03).

ORT GenAI's graph is small because one contrib node per layer, GroupQueryAttention
(GQA), does what `export_static_step` spells out: RoPE on q and k, the write of the new
K/V into the cache buffer, and grouped-query attention over the row's cached tokens. On
SmolLM2 at 512 tokens that node takes 2.6 ms a step where the opset-23 graph's Attention,
ScatterElements and RotaryEmbedding take 4.3 ms (CLAIMS 03.8). This module writes the same
node into *our* export: `torch.onnx.ops.symbolic_multi_out` puts any ONNX op in the graph,
and `GqaCache` is the cache protocol spelled as that op. `export_gqa_step` then rewrites
the traced graph into the shape of GenAI's (`minillm.export.onnx_gqa_fuse`: q, k and v as
one packed product, each residual Add inside its norm).

GQA's cache contract is not the static graph's. There is no mask and no slot input: row b
holds its tokens in slots 0..seqlens_k[b], so prompts are *right*-padded and each token's
slot is its position (GQA derives the RoPE positions from seqlens_k itself).
- Prefill (T == total_sequence_length): seqlens_k[b] = len_b - 1. All T slots are written,
  a short row's padding too; its queries never look past seqlens_k[b], and decode
  overwrites those slots.
- Decode (T = 1): row b's token goes to slot seqlens_k[b] (= the tokens it holds) and
  attends slots 0..seqlens_k[b]; total_sequence_length = the longest row's count + 1.
With past and present bound to one buffer, GQA writes the new slot in place, as
ScatterElements does in the static graph (ORT compares the two pointers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from minillm.export.onnx import export_module, finish_graph
from minillm.export.onnx_gqa_fuse import fuse_gqa_graph
from minillm.export.onnx_runtime import graph_metadata
from minillm.export.onnx_static import LLM_OPSET, onnx_rms_norm
from minillm.export.ort_binding import SharedBufferDecoder, kv_names
from minillm.model.transformer import Transformer, rope_cos_sin

GQA_INPUTS = ["input_ids", "seqlens_k", "total_sequence_length"]


class GqaCache:
    """The cache protocol as one GroupQueryAttention node per layer (export only: the op
    exists in ONNX Runtime, not in PyTorch). q, k, v arrive unrotated (`rope_in_attention`):
    the node rotates them with the cos/sin tables, at positions it reads off seqlens_k."""

    def __init__(
        self,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]],
        seqlens_k: torch.Tensor,
        total_sequence_length: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        self.present = [list(kv) for kv in past]
        self.lengths = [seqlens_k, total_sequence_length]
        self.tables = [cos, sin]

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        if not torch.onnx.is_in_onnx_export():
            raise RuntimeError(
                "GqaCache only exists inside an ONNX export (ONNX Runtime computes its op): "
                "run the graph export_gqa_step wrote, with OrtGqaDecoder"
            )
        B, H, T, D = q.shape
        kv_heads = k.shape[1]

        def tokens(x: torch.Tensor) -> torch.Tensor:  # GQA's layout: [B, T, heads * D]
            return x.transpose(1, 2).reshape(B, T, -1)

        past_k, past_v = self.present[layer]
        out, present_k, present_v = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::GroupQueryAttention",
            [tokens(q), tokens(k), tokens(v), past_k, past_v, *self.lengths, *self.tables],
            {"num_heads": H, "kv_num_heads": kv_heads, "do_rotary": 1, "scale": D**-0.5},
            dtypes=[q.dtype] * 3,
            shapes=[(B, T, H * D), past_k.shape, past_v.shape],
            version=1,
        )
        self.present[layer] = [present_k, present_v]
        return out.view(B, T, H, D).transpose(1, 2)


def unrotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A model's `ops.rope` that leaves q and k as they are."""
    return x


def rope_in_attention(model: Transformer) -> contextlib.AbstractContextManager[Transformer]:
    """`with rope_in_attention(model):` the model's RoPE off for the export (`ops.rope`
    `unrotated`): GroupQueryAttention applies it (`do_rotary`), the rotate-half form
    `apply_rope` computes (`rotary_interleaved` = 0)."""
    return model.using(rope=unrotated)


class GqaStepGraph(nn.Module):
    """(ids, seqlens_k, total_sequence_length, cache buffers) -> (logits, buffers)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        positions = torch.arange(model.config.max_position_embeddings)
        cos, sin = rope_cos_sin(model.inv_freq, positions)
        half = cos.shape[-1] // 2  # GQA's tables hold each angle once: [positions, d / 2]
        self.register_buffer("cos_cache", cos[..., :half].contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin[..., :half].contiguous(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        seqlens_k: torch.Tensor,
        total_sequence_length: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        tables = (self.cos_cache, self.sin_cache)
        cache = GqaCache(past, seqlens_k, total_sequence_length, *tables)
        # No positions: with RoPE inside GQA the model's own tables go unused (and the
        # exporter drops them).
        logits = self.model(input_ids, cache=cache)
        return (logits, *(t for kv in cache.present for t in kv))


def export_gqa_step(model: Transformer, path: str | Path, fuse: bool = True) -> Path:
    """Export the decoder step with one GroupQueryAttention node per layer (RoPE, cache
    write and attention) and opset 23's RMSNormalization; batch, sequence and
    max_sequence axes dynamic (checked by `check_onnx`). `fuse` rewrites the traced graph
    into GenAI's shape (`fuse_gqa_graph`: packed q, k, v; residual Add and norm as one
    node); `fuse=False` keeps it as traced."""
    cfg, n = model.config, model.config.num_hidden_layers
    dtype = model.lm_head.weight.dtype
    if dtype != torch.float32:
        raise ValueError(
            f"the model is {dtype}: ORT's CPU GroupQueryAttention runs float32, "
            "export model.float()"
        )
    if cfg.head_dim % 16:
        raise ValueError(
            f"head_dim {cfg.head_dim}: GroupQueryAttention rotates heads whose size is a "
            "multiple of 16; export this model with export_static_step (RoPE outside)"
        )
    kv = kv_names(n)
    inputs = GQA_INPUTS + [f"past_{x}" for x in kv]
    outputs = ["logits", *(f"present_{x}" for x in kv)]
    batch, seq, slots = 2, 3, 8  # distinct sizes, so no axis is mistaken for another
    kv_shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
    example = (
        torch.zeros(batch, seq, dtype=torch.long),
        torch.full((batch,), seq - 1, dtype=torch.int32),
        torch.tensor(seq, dtype=torch.int32),
        [(torch.zeros(kv_shape), torch.zeros(kv_shape)) for _ in range(n)],
    )
    d = torch.export.Dim.DYNAMIC
    kv_dims = {0: d, 2: d}
    dynamic = ({0: d, 1: d}, {0: d}, None, [(kv_dims, kv_dims)] * n)
    with rope_in_attention(model), model.using(norm=onnx_rms_norm):
        graph = GqaStepGraph(model)
        export_module(graph, example, path, inputs, outputs, dynamic, opset_version=LLM_OPSET)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "seqlens_k": {0: "batch"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in inputs[len(GQA_INPUTS) :] + outputs[1:]:
        axes[name] = {0: "batch", 2: "max_sequence"}
    return finish_graph(path, model, axes, rewrite=fuse_gqa_graph if fuse else None)


class OrtGqaDecoder(SharedBufferDecoder):
    """Generation on the GroupQueryAttention graph (`export_gqa_step`): prompts
    right-padded, each row's length in seqlens_k, the cache bound once (IOBinding)."""

    GRAPH_INPUT, EXPORTER = "seqlens_k", "export_gqa_step"

    def __init__(self, session: Any, max_len: int, eos_token_id: int | None = None) -> None:
        super().__init__(session, max_len, eos_token_id)
        table = graph_metadata(session)["max_position_embeddings"]
        if max_len > table:
            raise ValueError(
                f"max_len {max_len}: the graph's RoPE tables hold {table} positions; "
                f"use max_len <= {table}"
            )

    def step(self, ids: np.ndarray, seqlens_k: np.ndarray, total: int) -> np.ndarray:
        """One run: row b's T tokens go to the slots before seqlens_k[b] + 1; returns
        logits [B, T, vocab]."""
        return self.run(
            {
                "input_ids": np.ascontiguousarray(ids, dtype=np.int64),
                "seqlens_k": np.ascontiguousarray(seqlens_k, dtype=np.int32),
                "total_sequence_length": np.array(total, dtype=np.int32),
            }
        )

    def prefill(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        lengths = np.array([len(p) for p in prompts])
        ids = np.zeros((len(prompts), lengths.max()), np.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = p
        logits = self.step(ids, lengths - 1, int(lengths.max()))
        last = logits[np.arange(len(prompts)), lengths - 1]  # each row's own last token

        def step(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal lengths
            out = self.step(tokens.numpy()[:, None], lengths, int(lengths.max()) + 1)
            lengths = lengths + 1
            return torch.from_numpy(out[:, -1])

        return torch.from_numpy(last), step
