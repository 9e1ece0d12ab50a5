"""The decode layout changes where the weights sit in memory, nothing a reader can see:
same logits (to rounding), same greedy tokens, same state dict, same saved checkpoint."""

import torch

from minillm import SamplingParams, generate, load_model, save_model
from minillm.model.layout import decode_layout, is_decode_layout


def test_decode_layout_keeps_values_ties_tokens_and_checkpoints(model, prompts, tmp_path):
    fast = decode_layout(load_model())
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_decode_layout(m.weight) for m in linears)
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # still tied
    assert decode_layout(fast) is fast  # idempotent: nothing re-laid twice
    for name, w in model.state_dict().items():
        assert torch.equal(w, fast.state_dict()[name]), name
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with torch.inference_mode():
        ids = torch.tensor([prompts[1]])
        # To rounding: BLAS sums the transposed weight in another order, a few fp32 ulps of
        # logits near 20 (1.1e-5 on an AMX Xeon); a misplaced weight moves them by whole units.
        torch.testing.assert_close(fast(ids), model(ids), atol=1e-5, rtol=2e-6)
    assert generate(fast, prompts, params) == generate(model, prompts, params)
    reloaded = load_model(save_model(fast, tmp_path / "saved"))
    assert all(w.is_contiguous() for w in reloaded.state_dict().values())
    assert generate(reloaded, prompts, params) == generate(model, prompts, params)
