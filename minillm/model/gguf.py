"""Read a llama.cpp GGUF file as a normal Hugging Face checkpoint directory (chapter 08's
export, run backwards).

A GGUF holds everything a model needs in one file: metadata (shapes, RoPE base, the
tokenizer's vocabulary, merges and chat template) and tensors, often quantized. minillm reads
it with the `gguf` package's `GGUFReader` and writes, once, what `load_model` and transformers
already read: config.json, model.safetensors (fp32, dequantized by `minillm.model.gguf_quants`,
q/k rows put back in HF's RoPE order), tokenizer.json, tokenizer_config.json (special tokens,
chat template) and generation_config.json. The directory lives in the user cache
(`MINILLM_CACHE`, default ~/.cache/minillm) and is reused while the file is unchanged:

    from minillm.model.gguf import cached_hf_dir
    model_dir = cached_hf_dir("SmolLM2-135M-Instruct.Q4_1.gguf")
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from minillm.model.checkpoint import write_checkpoint
from minillm.model.config import ModelConfig
from minillm.model.gguf_layout import hf_name, rope_from_interleaved
from minillm.model.gguf_quants import dequantize
from minillm.model.gguf_tokenizer import build_tokenizer, tokenizer_config
from minillm.paths import cache_root

# Bump when the written directory changes, so that older caches are rebuilt.
CONVERTER_VERSION = 1
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
_FILES += ("tokenizer_config.json", "source.json")  # source.json last: it marks completion


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key of the file with its Python value (lists for arrays)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The ModelConfig of a GGUF Llama, from llama.cpp's `{arch}.*` keys."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r}: minillm reads Llama GGUF files only (llama.cpp "
            "writes Mistral and SmolLM as 'llama' too)"
        )
    key = lambda name, default=None: meta.get(f"llama.{name}", default)  # noqa: E731
    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    rope_dims, rope_scaling = key("rope.dimension_count", head_dim), key("rope.scaling.type")
    if rope_dims != head_dim or rope_scaling not in (None, "none"):
        raise ValueError(
            "this GGUF uses partial or scaled RoPE (llama.rope.dimension_count / "
            "llama.rope.scaling.type), which minillm's GGUF reader does not map: load the "
            "model from its Hugging Face checkpoint instead"
        )
    return ModelConfig(
        vocab_size=key("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def read_state_dict(reader: GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors in fp32 under their HF names, q/k rows back in HF's rotate-half order."""
    state = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest dim first
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type, shape)
        if name.endswith("q_proj.weight"):
            w = rope_from_interleaved(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = rope_from_interleaved(w, cfg.num_key_value_heads)
        state[name] = w
    return state


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF file as an HF checkpoint directory (see the module docstring)."""
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    cfg = config_from_metadata(meta, {t.name for t in reader.tensors})
    out_dir = write_checkpoint(cfg, read_state_dict(reader, cfg), out_dir)
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    tok_config = tokenizer_config(meta, cfg.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out_dir


def _source(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "gguf": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def _is_current(model_dir: Path, source: dict[str, Any]) -> bool:
    if not all((model_dir / f).is_file() for f in _FILES):
        return False
    return json.loads((model_dir / "source.json").read_text()) == source


def cached_hf_dir(gguf_path: str | Path) -> Path:
    """The HF directory of a GGUF file in the cache, converted on first use (a few seconds
    for a 135M model) and reused while the file's size and mtime are unchanged.

    The conversion writes into a temporary directory next to the target and renames it into
    place, so an interrupted or concurrent run never leaves a half-written model behind."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    target = cache_root() / "gguf" / gguf_path.stem
    source = _source(gguf_path)
    if _is_current(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / "source.json").write_text(json.dumps(source, indent=2) + "\n")
        if target.exists():  # stale (another file, or an older converter): move it aside
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
            target.rename(stale / "old")
            shutil.rmtree(stale)
        tmp.rename(target)
    except OSError:
        if not _is_current(target, source):  # not a concurrent run that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
