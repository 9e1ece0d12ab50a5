"""Chapter 05 exercise, graded against torch's attention and minillm's eager `generate`.

`ch05` is the module under test (solutions/ by default, exercises/ with
MINILLM_IMPL=exercises). Test names start with `test_ch05_<exercise>`.

The learner's `static_attention` becomes the attention of minillm's Transformer through a
small cache object; the decode step is compiled with a backend that counts the graphs
dynamo hands it (`torch._dynamo.testing.CompileCounter`: no code generation, seconds).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from minillm import SamplingParams, generate, load_model
from minillm.model import Transformer

STEPS = 8  # decode steps at growing positions
PROMPTS = [[(3 * i) % 4000 + 10 for i in range(16)], [(7 * i) % 3000 + 20 for i in range(11)]]


@pytest.fixture(scope="module")
def bundled() -> Transformer:
    return load_model(None, device="cpu", dtype=torch.float32).eval()


class StaticCache:
    """Fixed buffers [layers, B, kv_heads, max_len, head_dim]; attention is the learner's."""

    def __init__(self, fn, model: Transformer, batch: int, max_len: int) -> None:
        cfg = model.config
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k, self.v, self.fn = torch.zeros(shape), torch.zeros(shape), fn

    def attention(self, layer, q, k, v, positions):
        return self.fn(q, k, v, self.k[layer], self.v[layer], positions)


def reference_attention(q, k_all, v_all, positions):
    """Row by row, query by query: softmax over slots 0..p of the row, heads grouped."""
    B, H, T, D = q.shape
    rep = H // k_all.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            keys = k_all[b, :, : p + 1].repeat_interleave(rep, dim=0)  # [H, p+1, D]
            vals = v_all[b, :, : p + 1].repeat_interleave(rep, dim=0)
            w = torch.softmax(keys @ q[b, :, t, :, None] / D**0.5, dim=1)  # [H, p+1, 1]
            out[b, :, t] = (w * vals).sum(1)
    return out


def random_case(seed: int, B=2, H=4, KV=2, T=3, S=12, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    k_cache, v_cache = torch.randn(B, KV, S, D, generator=g), torch.randn(B, KV, S, D, generator=g)
    return q, k, v, k_cache, v_cache


def test_ch05_static_attention_matches_reference_with_ragged_rows_and_grouped_heads(ch05):
    q, k, v, k_cache, v_cache = random_case(0)
    positions = torch.tensor([[2, 3, 4], [6, 7, 8]])  # rows at different places, a chunk of 3
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(2):
        expected_k[b, :, positions[b]] = k[b]
        expected_v[b, :, positions[b]] = v[b]
    out = ch05.static_attention(q, k, v, k_cache, v_cache, positions)
    assert out.shape == q.shape, f"returns {tuple(out.shape)}, expected q's shape {tuple(q.shape)}"
    ref = reference_attention(q, expected_k, expected_v, positions)
    worst = (out - ref).abs().max().item()
    assert worst < 1e-5, (
        f"attention differs from the reference by {worst:.3g}: each query at position p sees "
        "slots 0..p of its own row (this step's tokens included), scale 1/sqrt(head_dim), "
        "kv head j serving query heads j*rep .. (j+1)*rep - 1"
    )


def test_ch05_static_attention_writes_the_cache_in_place_at_the_positions(ch05):
    q, k, v, k_cache, v_cache = random_case(1)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    ch05.static_attention(q, k, v, k_cache, v_cache, positions)
    for b in range(2):
        for t in range(3):
            p = int(positions[b, t])
            assert torch.equal(k_cache[b, :, p], k[b, :, t]), f"k not in slot {p} of row {b}"
            assert torch.equal(v_cache[b, :, p], v[b, :, t]), f"v not in slot {p} of row {b}"
    written = torch.zeros(2, 12, dtype=torch.bool)
    written[torch.arange(2)[:, None], positions] = True
    untouched = ~written[:, None, :, None].expand_as(k_cache)
    assert torch.equal(k_cache[untouched], before_k[untouched]), "other slots of K changed"
    assert torch.equal(v_cache[untouched], before_v[untouched]), "other slots of V changed"


def test_ch05_static_attention_ignores_slots_past_each_position(ch05):
    q, k, v, k_cache, v_cache = random_case(2, T=1)
    positions = torch.tensor([[3], [9]])
    out = ch05.static_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions)
    junk_k, junk_v = k_cache.clone(), v_cache.clone()
    junk_k[0, :, 4:], junk_v[0, :, 4:] = 1e4, -1e4  # past row 0's position: must not matter
    again = ch05.static_attention(q, k, v, junk_k, junk_v, positions)
    assert torch.allclose(out, again, atol=1e-5), "slots past a query's position leak into it"


def decode_compiled(ch05, model: Transformer, prompts: list[list[int]], steps: int):
    """Eager prefill, then `steps` compiled decode steps; (tokens per row, CompileCounter)."""
    lengths = torch.tensor([len(p) for p in prompts])
    T = int(lengths.max())
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts])  # right-padded: slots past
    cache = StaticCache(ch05.static_attention, model, len(prompts), T + steps)  # the row's end
    torch._dynamo.reset()  # are overwritten before they are read
    counters.clear()
    counter = CompileCounter()
    step = torch.compile(
        lambda m, c, t, p: m(t, p, cache=c)[:, -1], backend=counter, fullgraph=True, dynamic=False
    )
    out: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        logits = model(ids, torch.arange(T).expand(len(prompts), T), cache=cache)
        logits = logits[torch.arange(len(prompts)), lengths - 1]
        positions = lengths[:, None].clone()
        for _ in range(steps):
            tokens = logits.argmax(-1)[:, None]
            for row, t in zip(out, tokens.flatten().tolist(), strict=True):
                row.append(t)
            try:
                logits = step(model, cache, tokens, positions)
            except torch._dynamo.exc.TorchDynamoException as e:
                pytest.fail(
                    "torch.compile(fullgraph=True) could not capture the decode step as one "
                    f"graph: {type(e).__name__}: {str(e).splitlines()[0][:200]}. Keep every "
                    "shape fixed (attend over all max_len slots, mask the rest) and never turn "
                    "a position into a Python number (int(), .item(), an `if` on a tensor).",
                    pytrace=False,
                )
            positions = positions + 1
    return out, counter


def test_ch05_static_attention_compiles_to_one_graph_without_recompiles(ch05, bundled):
    _, counter = decode_compiled(ch05, bundled, PROMPTS, STEPS)
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    assert counter.frame_count == 1 and counters["stats"]["unique_graphs"] == 1, (
        f"{counter.frame_count} graphs for {STEPS} decode steps (expected 1): a shape or a "
        "Python value changed between steps, so dynamo compiled again. Slice nothing by "
        "position; attend over all max_len slots"
    )
    assert recompiles == 0, f"{recompiles} recompiles"
    assert counter.op_count > 0, "the compiled graph holds no ops"


def test_ch05_static_attention_compiled_tokens_equal_eager_generate(ch05, bundled):
    tokens, _ = decode_compiled(ch05, bundled, PROMPTS, STEPS)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    expected = generate(bundled, PROMPTS, greedy)  # chapter 02's eager cached path, ragged rows
    assert tokens == expected, (
        f"compiled static decode gave {tokens}, chapter 02's generate {expected}: check the "
        "positions written, the mask per row and the grouped heads"
    )
