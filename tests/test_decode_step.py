"""The fixed-shape decode step: same tokens and logits as `generate`, one graph, no
recompiles. Graph capture is checked with cheap backends ("eager", "aot_eager"); the one
real inductor compile (~40 s on a 2-core CPU) is marked slow."""

import copy

import pytest
import torch
from helpers import greedy

from minillm import generate, generate_naive
from minillm.cache import KVCache
from minillm.generation import generate_static
from minillm.generation.cached import prefill
from minillm.generation.static import (
    CompileCounter,
    compile_decode_step,
    decode_step,
    explain_step,
    naive_decode_step,
    recorded_recompiles,
)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """2 layers, dim 64: capture and compile take the least time."""
    return tiny_model()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test counts its own compiles
    yield
    torch._dynamo.reset()


@torch.inference_mode()
def cached_logits(model, prompts, steps):
    """Greedy decode the chapter-02 way (kv_len = slots filled so far): each step's
    logits [B, vocab]."""
    cache, logits, pos = prefill(model, prompts, steps)
    longest, out = max(len(p) for p in prompts), []
    for i in range(steps):
        cache.kv_len = longest + i + 1
        logits = model(logits.argmax(-1)[:, None], pos[:, None], cache=cache)[:, -1]
        out.append(logits)
        pos = pos + 1
    return out


def static_prefill(model, prompts, steps):
    """prefill, then the fixed shapes the static step needs: attend over every slot."""
    cache, logits, pos = prefill(model, prompts, steps)
    cache.kv_len = cache.max_len
    return cache, logits, pos


@torch.inference_mode()
def static_logits(model, prompts, steps, step):
    """The same decode with `step` over the full buffer (kv_len = max_len throughout)."""
    cache, logits, pos = static_prefill(model, prompts, steps)
    out = []
    for _ in range(steps):
        assert cache.kv_len == cache.max_len
        logits = step(model, cache, logits.argmax(-1)[:, None], pos[:, None])
        out.append(logits.clone())
        pos = pos + 1
    return out


def test_eager_static_step_tokens_equal_generate_and_naive(model, prompts):
    for p in prompts:  # batch 1
        expected = generate_naive(model, p, greedy(24))
        assert generate_static(model, [p], greedy(24), compiled=False) == [expected]
        assert generate(model, [p], greedy(24)) == [expected]
    assert generate_static(model, prompts, greedy(24), compiled=False) == generate(
        model, prompts, greedy(24)
    )  # batch 3, three prompt lengths


def test_compiled_step_matches_cached_logits_with_one_graph(model, prompts):
    """aot_eager: dynamo capture + functionalization (the cache writes become graph
    outputs copied back), no code generation. 12 steps, batch 1 and batch 3."""
    for batch in ([prompts[1]], prompts):
        torch._dynamo.reset()
        counter = CompileCounter("aot_eager")
        step = compile_decode_step(backend=counter)
        got = static_logits(model, batch, 12, step)
        for a, b in zip(got, cached_logits(model, batch, 12), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert counter.graphs == 1  # compiled at the first step, reused for the other 11
        assert generate_static(model, batch, greedy(12), compiled=step) == generate(
            model, batch, greedy(12)
        )
        assert counter.graphs == 1  # a second generation: still no recompile


def test_explain_static_one_graph_naive_breaks(tiny):
    with torch.inference_mode():
        cache, logits, pos = static_prefill(tiny, [[1, 2, 3], [4, 5, 6, 7, 8]], 8)
        tokens = logits.argmax(-1)[:, None]
        static = explain_step(decode_step, tiny, cache, tokens, pos[:, None])
        naive = explain_step(naive_decode_step, tiny, cache, tokens, pos[:, None])
    assert (static.graph_count, static.graph_break_count) == (1, 0)
    assert naive.graph_break_count == 1  # int(positions.max()): a tensor read into Python
    assert "item()" in naive.break_reasons[0]


def test_fullgraph_refuses_the_naive_step(tiny):
    """With fullgraph=True a graph break is an error, not a silent split. (Dynamo may
    first try to trace int(positions.max()) as a data-dependent size and fail there.)"""
    step = compile_decode_step(backend="eager", step=naive_decode_step)
    with torch.inference_mode(), pytest.raises(torch._dynamo.exc.TorchDynamoException):
        cache, logits, pos = prefill(tiny, [[1, 2, 3]], 4)
        step(tiny, cache, logits.argmax(-1)[:, None], pos[:, None])


@pytest.mark.parametrize("dynamic, graphs", [(False, 8), (None, 2)])
def test_shrinking_kv_len_recompiles(tiny, dynamic, graphs):
    """generate's kv_len = slots filled: a new shape each step. dynamic=False: one graph
    per length; dynamic=None (torch's default): the second length triggers one
    dynamic-shape recompile. The static step: one graph (test above)."""
    counter = CompileCounter("eager")
    step = compile_decode_step(backend=counter, dynamic=dynamic)
    with torch.inference_mode():
        cache, logits, pos = prefill(tiny, [[1, 2, 3], [4, 5, 6, 7, 8]], 8)
        for _ in range(8):
            cache.kv_len = int(pos.max()) + 1
            logits = step(tiny, cache, logits.argmax(-1)[:, None], pos[:, None])
            pos = pos + 1
    assert counter.graphs == graphs


def test_recorded_recompiles_names_the_failed_guard_quietly(tiny, capfd):
    """One line per recompile (the guard that failed, where it was read), nothing on
    stderr, and the torch._dynamo log level of before restored."""
    import logging

    dynamo = logging.getLogger("torch._dynamo")
    before = dynamo.level
    dynamo.setLevel(logging.ERROR)
    counter = CompileCounter("eager")
    step = compile_decode_step(backend=counter, dynamic=False)
    try:
        with recorded_recompiles() as why, torch.inference_mode():
            cache, logits, pos = prefill(tiny, [[1, 2, 3]], 4)
            for _ in range(3):
                cache.kv_len = int(pos.max()) + 1
                logits = step(tiny, cache, logits.argmax(-1)[:, None], pos[:, None])
                pos = pos + 1
        assert dynamo.level == logging.ERROR
    finally:
        dynamo.setLevel(before)
    assert counter.graphs == 3 and len(why) == 2, (counter.graphs, why)
    assert why[0].startswith("cache.kv_len == 4 (read in minillm/cache/contiguous.py:"), why
    assert "causal_mask" in why[0]
    assert "Recompiling" not in capfd.readouterr().err


@pytest.mark.slow
def test_inductor_step_matches_eager(tiny):
    """One real compile (inductor, default mode), batch 3 of different lengths."""
    prompts, counter = [[5, 17, 3, 42, 8], [9, 1, 60], [7]], CompileCounter("inductor")
    step = compile_decode_step(backend=counter)
    got = static_logits(tiny, prompts, 10, step)
    for a, b in zip(got, static_logits(tiny, prompts, 10, decode_step), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    tokens = generate_static(tiny, prompts, greedy(10), compiled=step)
    assert tokens == generate(tiny, prompts, greedy(10))
    assert tokens[1] == generate_naive(tiny, prompts[1], greedy(10))
    assert counter.graphs == 1


@pytest.mark.slow
def test_frozen_weights_step_matches_eager_and_reads_each_new_cache(tiny):
    """freeze=True makes the weights constants of the graph, never the K/V cache: the
    compiled step, reused on a second call's new cache (other prompts), still reads and
    writes that cache and gives generate's tokens."""
    step = compile_decode_step("default", freeze=True)
    for prompts in ([[5, 17, 3, 42, 8], [9, 1, 60], [7]], [[11, 2, 30], [4, 4, 4], [61, 9]]):
        got = static_logits(tiny, prompts, 10, step)
        for a, b in zip(got, static_logits(tiny, prompts, 10, decode_step), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        tokens = generate_static(tiny, prompts, greedy(10), compiled=step)
        assert tokens == generate(tiny, prompts, greedy(10))


@pytest.mark.slow
def test_frozen_step_keeps_the_weights_it_compiled_with(tiny):
    """Freezing really happened (in torch 2.13 `options={"freezing": True}` is accepted and
    ignored): after an in-place edit of a weight the frozen step still computes with the
    weights it compiled, the plain compiled step with the edited ones."""
    outs = {}
    for freeze in (True, False):
        torch._dynamo.reset()
        model = copy.deepcopy(tiny)
        step = compile_decode_step("default", freeze=freeze)
        with torch.inference_mode():
            cache, logits, pos = static_prefill(model, [[5, 6, 7]], 4)
            args = (model, cache, logits.argmax(-1)[:, None], pos[:, None])
            before = step(*args)
            model.model.layers[0].mlp.down_proj.weight.mul_(2)  # not tied to anything
            outs[freeze] = torch.equal(before, step(*args))
    assert outs == {True: True, False: False}


def test_freeze_is_refused_without_inductor():
    with pytest.raises(ValueError, match="inductor"):
        compile_decode_step(backend="eager", freeze=True)


def test_compiled_step_mutates_only_static_inputs(tiny):
    """Inductor records a CUDA graph only if every input the graph writes to is static
    (its address fixed across calls); otherwise it skips cudagraphs for "mutated inputs".
    The cache marks its K/V buffers static, so the compiled decode step qualifies. Checked
    on CPU at the place inductor checks it: the graph's mutated inputs vs its static ones."""
    from torch._functorch.aot_autograd import aot_module_simplified

    cache = KVCache(tiny.config, 1, 16)
    seen = {}

    def backend(gm, example_inputs):
        def forward_compiler(graph, inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            seen["static"] = set(meta.static_input_indices)
            seen["mutated"] = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
            return graph.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler)

    step = compile_decode_step(backend=backend)
    with torch.inference_mode():
        step(tiny, cache, torch.tensor([[1]]), torch.tensor([[3]]))
    assert len(seen["mutated"]) == 2  # K and V: the only state a decode step changes
    assert seen["mutated"] <= seen["static"], "inductor would skip CUDA graphs"
