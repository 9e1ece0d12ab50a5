"""Real models' shapes, for speed and memory work without downloading weights.

Each entry is the part of the model's HF `config.json` that sets the shapes (checked
against the hub files). `random_model` builds a Transformer with those shapes and random
weights: speed and memory depend on shapes, not on what the weights learned (say so
wherever a figure comes from one).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer

_LLAMA = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5}

# HuggingFaceTB/SmolLM2-135M, -360M, -1.7B (one family: a natural draft/target pair)
SMOLLM2_135M: dict[str, Any] = {
    **_LLAMA,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
SMOLLM2_360M: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
}
SMOLLM2_1_7B: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "rope_theta": 130000.0,
}
# TinyLlama/TinyLlama-1.1B-Chat-v1.0
TINYLLAMA_1_1B: dict[str, Any] = {
    **_LLAMA,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
CONFIGS = {
    "SmolLM2-135M": SMOLLM2_135M,
    "SmolLM2-360M": SMOLLM2_360M,
    "SmolLM2-1.7B": SMOLLM2_1_7B,
    "TinyLlama-1.1B": TINYLLAMA_1_1B,
}


def random_model(
    cfg: str | ModelConfig | dict[str, Any], seed: int = 0, **overrides: Any
) -> Transformer:
    """A Transformer with the shapes of `cfg` (a name in CONFIGS, a ModelConfig or an HF
    config dict), any HF config keys in `overrides` changed, and random weights, in eval
    mode."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown model shape {cfg!r}: choose one of {', '.join(CONFIGS)}")
        cfg = CONFIGS[cfg]
    if isinstance(cfg, ModelConfig):
        cfg = cfg.to_hf()
    cfg = ModelConfig.from_hf({**cfg, **overrides})
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def write_random_checkpoint(
    cfg: str | ModelConfig | dict[str, Any],
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    **overrides: Any,
) -> Path:
    """A checkpoint directory of `random_model(cfg, seed, **overrides)` in `dtype`, with the
    bundled model's tokenizer (so that it runs in the engine: keep vocab_size=4096 where
    its tokens must be detokenized). For the code that loads from disk, such as each
    tensor-parallel rank reading its shard (`max_shard_bytes`: split into files of that size,
    with an index, as large checkpoints are)."""
    from minillm.model.weights import BUNDLED_DIR, save_model

    model = random_model(cfg, seed, **overrides).to(dtype)
    out_dir = save_model(model, out_dir, max_shard_bytes)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_DIR / name, out_dir / name)
    return out_dir
