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

from exercises.feedback import worst
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
    case = (
        "static_attention(B 2, 4 heads, 2 kv heads, 3 tokens at positions [[2, 3, 4], "
        "[6, 7, 8]], 12 slots)"
    )
    assert out.shape == q.shape, (
        f"{case}: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}; hint: one "
        "output per query head and token, [B, H, T, D]"
    )
    ref = reference_attention(q, expected_k, expected_v, positions)
    err = (out - ref).abs().max().item()
    assert err < 1e-5, (
        f"{case}: expected the row-by-row reference (max |diff| < 1e-5), got max |diff| "
        f"{err:.3g}; hint: each query at position p sees slots 0..p of its own row (this "
        "step's tokens included), scale 1/sqrt(head_dim), kv head j serving query heads "
        "j*rep .. (j+1)*rep - 1"
    )


def test_ch05_static_attention_writes_the_cache_in_place_at_the_positions(ch05):
    q, k, v, k_cache, v_cache = random_case(1)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    ch05.static_attention(q, k, v, k_cache, v_cache, positions)
    case = "static_attention(positions [[0, 1, 2], [5, 6, 7]], caches of 12 slots)"
    hint = (
        "write into the k_cache and v_cache passed in (in place), token t of row b at slot "
        "positions[b, t], every kv head"
    )
    for b in range(2):
        for t in range(3):
            p = int(positions[b, t])
            for name, cache, new in (("k", k_cache, k), ("v", v_cache, v)):
                assert torch.equal(cache[b, :, p], new[b, :, t]), (
                    f"{case}: expected {name}[{b}, :, {t}] in slot {p} of row {b} of "
                    f"{name}_cache: {worst(cache[b, :, p], new[b, :, t])}; hint: {hint}"
                )
    written = torch.zeros(2, 12, dtype=torch.bool)
    written[torch.arange(2)[:, None], positions] = True
    untouched = ~written[:, None, :, None].expand_as(k_cache)
    for name, cache, before in (("K", k_cache, before_k), ("V", v_cache, before_v)):
        assert torch.equal(cache[untouched], before[untouched]), (
            f"{case}: expected the other slots of {name} unchanged, got "
            f"{int((cache[untouched] != before[untouched]).sum())} changed values; hint: write "
            "at positions[b, t] only: no clearing, shifting or appending"
        )


def test_ch05_static_attention_ignores_slots_past_each_position(ch05):
    q, k, v, k_cache, v_cache = random_case(2, T=1)
    positions = torch.tensor([[3], [9]])
    out = ch05.static_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions)
    junk_k, junk_v = k_cache.clone(), v_cache.clone()
    junk_k[0, :, 4:], junk_v[0, :, 4:] = 1e4, -1e4  # past row 0's position: must not matter
    again = ch05.static_attention(q, k, v, junk_k, junk_v, positions)
    assert torch.allclose(out, again, atol=1e-5), (
        f"static_attention(one token a row, at positions [[3], [9]]): expected the same output "
        f"with junk in row 0's slots 4.., got max |diff| {(out - again).abs().max():.3g}; hint: "
        "slots past a query's position leak into it: mask slot s when s > the query's position"
    )


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
    case = f"the decode step with static_attention, compiled, over {STEPS} steps"
    hint = (
        "a shape or a Python value changed between steps, so dynamo compiled again: slice "
        "nothing by position, attend over all max_len slots, keep positions as tensors"
    )
    assert counter.frame_count == 1, (
        f"{case}: expected 1 compiled frame, got {counter.frame_count}; hint: {hint}"
    )
    assert counters["stats"]["unique_graphs"] == 1, (
        f"{case}: expected 1 graph, got {counters['stats']['unique_graphs']}; hint: {hint}"
    )
    assert recompiles == 0, f"{case}: expected 0 recompiles, got {recompiles}; hint: {hint}"
    assert counter.op_count > 0, (
        f"{case}: expected ops in the compiled graph, got {counter.op_count}; hint: the "
        "attention must be torch operations dynamo can trace"
    )


def test_ch05_static_attention_compiled_tokens_equal_eager_generate(ch05, bundled):
    tokens, _ = decode_compiled(ch05, bundled, PROMPTS, STEPS)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    expected = generate(bundled, PROMPTS, greedy)  # chapter 02's eager cached path, ragged rows
    assert tokens == expected, (
        f"greedy decode with static_attention compiled, prompts of 16 and 11 tokens: expected "
        f"chapter 02's generate {expected}, got {tokens}; hint: check the positions written, "
        "the mask per row and the grouped heads"
    )
