"""Write a Hugging Face checkpoint directory: config.json, generation_config.json and
safetensors (sharded past a size), which both minillm and transformers load.

`minillm.model.weights.save_model` writes a model through it, and `minillm.model.gguf` the
tensors it dequantized from a GGUF file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from minillm.model.config import ModelConfig


def write_checkpoint(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `state` (HF tensor names; no lm_head.weight when tied: safetensors refuses
    shared storage, and HF omits it too) with `cfg` as config.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in state.items():
        size = sum(t.nbytes for t in shards[-1].values())
        if max_shard_bytes and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata=meta)
        return out_dir
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / fname, metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}}
    index["weight_map"] = weight_map
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir
