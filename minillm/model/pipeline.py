"""Pipeline parallelism: the layers split into consecutive stages, one a rank.

    stage 0        embedding, layers [0, a)      ->  hidden states [B, T, hidden]  ->
    stage 1        layers [a, b)                 ->  hidden states                 ->
    ...
    stage N-1      layers [.., L), norm, LM head ->  logits

Unlike tensor parallelism nothing inside a layer is split and a stage never waits on a
collective: it receives one tensor and sends one. The price is that a single batch runs the
stages one after another (its latency is the whole model's, plus the hops); throughput
comes from keeping a different batch in every stage at once (`minillm.engine.parallel`).

A stage is the ordinary `Transformer` built with its own number of layers: its forward
skips the embedding unless it is the first and the head unless it is the last. The modules
a stage does not run stay on the meta device (no memory, and running one by mistake is an
error), and `load_stage` reads only the stage's tensors from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from minillm.model.config import ModelConfig
from minillm.model.parallel import read_shard
from minillm.model.transformer import Transformer
from minillm.model.weights import assign_weights


def stage_layers(cfg: ModelConfig, size: int) -> list[tuple[int, int]]:
    """Each stage's layers [start, end), balanced by the weights each stage reads per
    token: the LM head counts on the last stage as the layers it is worth (TinyLlama's
    32000 x 2048 head is 1.5 of its layers), so the last stage gets fewer layers."""
    layers = cfg.num_hidden_layers
    if not 1 <= size <= layers:
        raise ValueError(
            f"pipeline_parallel_size={size}: each stage needs at least one of this model's "
            f"{layers} layers, so use a size from 1 to {layers}"
        )
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size
    head = cfg.vocab_size * h / per_layer  # in layers
    bounds, start = [], 0
    for stage in range(size - 1):
        share = (layers - start + head) / (size - stage)  # what is left, shared out evenly
        end = min(max(start + 1, round(start + share)), layers - (size - 1 - stage))
        bounds.append((start, end))
        start = end
    return [*bounds, (start, layers)]


class Stage(Transformer):
    """Layers [start, end) of a model of `cfg` (`stage_layers`): the first stage takes token
    ids, any other the hidden states [B, T, hidden] of the stage before; the last returns
    logits, any other its hidden states. Its layers are numbered from 0, and so are the
    layers of its KV cache."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__(dataclasses.replace(cfg, num_hidden_layers=end - start))
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == cfg.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) if self.first else input_ids

    def head(self, x: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
        return super().head(x, logits_at) if self.last else x


def load_stage(
    model_dir: str | Path,
    cfg: ModelConfig,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Stage:
    """The stage holding layers [start, end) of the checkpoint in `model_dir`, reading only
    its own tensors (its layers renumbered from 0; the embedding on the first stage, the
    norm and the LM head on the last, the embedding there too when the head is tied)."""
    with torch.device("meta"):
        stage = Stage(cfg, start, end)
    names = {}  # the stage's name -> the checkpoint's
    for name in stage.state_dict():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            names[name] = f"model.layers.{int(index) + start}.{rest}"
    if stage.first or (stage.last and cfg.tie_word_embeddings):
        names["model.embed_tokens.weight"] = "model.embed_tokens.weight"
    if stage.last:
        names["model.norm.weight"] = "model.norm.weight"
        if not cfg.tie_word_embeddings:
            names["lm_head.weight"] = "lm_head.weight"
    state = read_shard(Path(model_dir), list(names.values()), cfg, 0, 1)
    state = {k: state[v] for k, v in names.items()}
    return assign_weights(stage, state, dtype, torch.device(device))  # type: ignore[return-value]
