"""Layer fusion: the fused model computes what the original computes, with fewer ops."""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.lab import count_ops, ops_per_forward
from minillm.model import ModelConfig, Transformer
from minillm.quant.fusion import FusedAttention, FusedMLP, fuse_model

OPTIONS = [
    {},
    {"fuse_qkv": False, "fuse_gate_up": False},
    {"fold_norms": False, "fuse_gate_up": False},
    {"fold_norms": False, "fuse_qkv": False},
]


def ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    # Folding a norm into a weight changes fp32 rounding, not the math: allow 1e-5 of the
    # logits' scale (measured: ~5e-7 on the bundled model).
    worst = (a - b).abs().max().item()
    assert worst <= 1e-5 * a.abs().max().item(), f"max |diff| {worst:.3g}"


@pytest.fixture(scope="module")
def qwen_like() -> Transformer:
    """Qwen2-style: q/k/v biases, GQA, head_dim not hidden/heads, untied head."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        qkv_bias=True,
        tie_word_embeddings=False,
        architecture="Qwen2ForCausalLM",
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so folding them is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_fused_logits_equal_the_original(model, qwen_like, options):
    for m in (model, qwen_like):
        x = ids(2, 48, m.config.vocab_size)
        fused = fuse_model(m, **options)
        with torch.inference_mode():
            assert_same_logits(m(x), fused(x))


def test_fused_model_generates_the_same_tokens_with_a_kv_cache(model, prompts):
    fused = fuse_model(model)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert generate(fused, prompts, params) == generate(model, prompts, params)


def test_fusion_replaces_modules_and_leaves_the_original_alone(model):
    fused = fuse_model(model)
    assert all(isinstance(layer.self_attn, FusedAttention) for layer in fused.model.layers)
    assert all(isinstance(layer.mlp, FusedMLP) for layer in fused.model.layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert not hasattr(model.model.layers[0].self_attn, "qkv_proj")
    with pytest.raises(ValueError, match="already fused"):
        fuse_model(fused)


def test_fusion_saves_the_expected_ops(model):
    x = ids(1, 16, model.config.vocab_size)
    n_layers = model.config.num_hidden_layers
    before, after = ops_per_forward(model, x), ops_per_forward(fuse_model(model), x)
    # q/k/v: 3 GEMMs -> 1, gate/up: 2 -> 1 per layer.
    assert before["gemms"] - after["gemms"] == 3 * n_layers
    with torch.no_grad():
        muls_before = count_ops(lambda: model(x))["aten::mul"]
        muls_after = count_ops(lambda: fuse_model(model)(x))["aten::mul"]
    # One weight multiply per RMSNorm folded away: two per layer and the final norm.
    assert muls_before - muls_after == 2 * n_layers + 1
    assert after["compute_ops"] < before["compute_ops"]
