"""Small random transformers models and their greedy decoding: the reference that
minillm's parity and KV-cache tests compare against (offline, seconds to build)."""

from __future__ import annotations

import torch
import transformers

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name: (config class, model class, config fields beyond BASE)
CASES = {
    "llama-mha-untied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-gqa-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama3-rope-scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-head-dim-and-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, head_dim=32, attention_bias=True, mlp_bias=True),
    ),
    "qwen2-qkv-bias": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=True),
    ),
}


def build_hf(case: str, path) -> transformers.PreTrainedModel:
    """A seeded random model for `case`, saved as an HF checkpoint in `path`."""
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    # No EOS: transformers would stop at it (or, with min_new_tokens, forbid it), while
    # ignore_eos=True lets minillm emit it like any other token.
    hf.generation_config.eos_token_id = None
    with torch.no_grad():  # random biases: HF initialises them to zero, which would hide bugs
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    hf.save_pretrained(path)
    return hf
