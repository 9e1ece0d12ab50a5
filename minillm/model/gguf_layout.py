"""How llama.cpp lays out a Llama checkpoint: its tensor names and its RoPE row order.

Both directions live here, once: `minillm.export.gguf` writes GGUF files with `gguf_name` and
`rope_to_interleaved`; `minillm.model.gguf` reads them back with `hf_name` and
`rope_from_interleaved`.

Why the rows move: Hugging Face's Llama rotates the dimension pairs (j, j + d/2) of each
head ("rotate half"), llama.cpp rotates adjacent pairs (2j, 2j + 1). The attention scores are
the same if the q and k projection rows are reordered to match, so converters permute those
two weights and nothing else.
"""

from __future__ import annotations

import torch

# HF tensor name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """The llama.cpp tensor name of an HF Llama tensor name."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise ValueError(f"no GGUF name for tensor {hf_name!r}: only plain Llama checkpoints export")


def hf_name(gguf_tensor_name: str) -> str:
    """The HF Llama tensor name of a llama.cpp tensor name (the inverse of `gguf_name`)."""
    if gguf_tensor_name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[gguf_tensor_name]
    parts = gguf_tensor_name.split(".", 2)  # blk, i, rest
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _HF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_HF_LAYER_NAMES[parts[2]]}"
    raise ValueError(
        f"GGUF tensor {gguf_tensor_name!r} has no Llama counterpart: minillm reads plain Llama "
        "GGUF files (no biases, no rope_freqs, no MoE)"
    )


def rope_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from HF's rotate-half RoPE layout (pairs (j, j + d/2))
    to llama.cpp's adjacent pairs (2j, 2j + 1): the same attention scores, other row order."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)


def rope_from_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `rope_to_interleaved`: llama.cpp's q/k rows back in HF's order."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)
