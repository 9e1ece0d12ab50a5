"""The C matrix-vector kernel against F.linear: the same products (to float rounding) at
every shape it takes, the same greedy tokens through a whole model, tied weights still
tied, and every input it does not take handed back to F.linear unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams, generate, load_model
from minillm.kernels import matvec as mv
from minillm.model.layout import MatVecLinear, decode_layout, matvec_applies, use_matvec

ok, why = mv.matvec_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C kernel here: {why}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out_in", [(1, 1), (7, 13), (192, 576), (576, 1536), (33, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_matvec_matches_linear(rows, out_in, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_in[0])
    out, inner = out_in
    w = torch.randn(out, inner, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    x = torch.randn(rows, 1, inner, generator=g)  # [rows, T=1, in]: a decode step's shape
    y = mv.matvec(x, w, b)
    assert y.shape == (rows, 1, out)
    # the kernel sums in SIMD lanes, BLAS in its own order: a few ulps of sqrt(in)-sized sums
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4 * inner**0.5, rtol=1e-5)


def test_matvec_refuses_what_it_does_not_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="use F.linear"):
        mv.matvec(torch.randn(mv.MAX_ROWS + 1, 16), w)  # more rows than MAX_ROWS
    with pytest.raises(ValueError, match="use F.linear"):
        mv.matvec(torch.randn(1, 16, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="use F.linear"):
        mv.matvec(torch.randn(1, 8), w.t())  # a transposed (non-contiguous) weight
    assert not mv.fits(torch.randn(1, 16, requires_grad=True), w)
    assert mv.try_matvec(torch.randn(1, 16, dtype=torch.float64), w.double()) is None


def test_use_matvec_keeps_tokens_ties_and_state(model, prompts):
    fast = use_matvec(decode_layout(copy.deepcopy(model)))  # from chapter 02's layout too
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is MatVecLinear for m in linears)
    assert all(m.weight.is_contiguous() for m in linears)
    layers = fast.model.layers
    assert all(layer.self_attn.qkv is None and layer.mlp.gate_up is None for layer in layers)
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # still tied
    for name, w in model.state_dict().items():
        assert torch.equal(w, fast.state_dict()[name]), name
    with torch.inference_mode():
        ids = torch.tensor([prompts[1]])
        torch.testing.assert_close(fast(ids), model(ids))  # a prompt: F.linear, as before
        step = fast(ids[:, :1])  # one row: the kernel
        torch.testing.assert_close(step, model(ids[:, :1]), atol=2e-5, rtol=2e-6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert generate(fast, prompts, params) == generate(model, prompts, params)
    assert matvec_applies(fast) and not matvec_applies(copy.deepcopy(model).half())


def test_matvec_linear_trains_through_f_linear():
    layer = use_matvec(torch.nn.Sequential(torch.nn.Linear(4, 3)))[0]
    x = torch.randn(1, 4)
    layer(x).sum().backward()  # a gradient wanted: F.linear, which has a backward
    assert layer.weight.grad is not None


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    mv.library.cache_clear()
    try:
        assert mv.matvec_status() == (
            False,
            f"CC={tmp_path / 'no-such-cc'} is not a program "
            "here: point CC at a C compiler, or unset it",
        )
        assert mv.try_matvec(torch.randn(1, 4), torch.randn(3, 4)) is None
        with pytest.raises(RuntimeError, match="cannot run here"):
            use_matvec(load_model())
    finally:
        monkeypatch.undo()
        mv.library.cache_clear()


def test_the_engine_decodes_batches_through_the_kernel(model, prompts):
    """LLM() on a CPU in fp32 runs its decode steps (here 1 to 8 rows, more in a prompt
    chunk, which F.linear takes) through the kernel, with the tokens each prompt gets
    alone from `generate` on the model as loaded."""
    a, b, c = prompts
    workload = [b, c, a, b + a, a + c, c + a, b * 2, a * 2]
    llm = LLM(max_num_seqs=8)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is MatVecLinear for m in linears)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload], params, use_tqdm=False)
    alone = [generate(model, [p], params)[0] for p in workload]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_an_unwritable_cache_is_named(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder would go
    monkeypatch.setenv("MINILLM_CACHE", str(blocked))
    mv.library.cache_clear()
    try:
        ok, why = mv.matvec_status()
        assert not ok and "set MINILLM_CACHE to a folder this user can write" in why
    finally:
        monkeypatch.undo()
        mv.library.cache_clear()
