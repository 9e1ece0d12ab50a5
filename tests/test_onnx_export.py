"""ONNX export and ONNX Runtime (chapter 03): graphs valid, axes dynamic, ORT logits
within 1e-4 of PyTorch at every step, identical tokens, pitfalls named."""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.export.onnx import (
    UnsupportedOpError,
    export_decoder_step,
    export_forward,
    export_module,
)
from minillm.export.onnx_checks import FrozenAxisError, check_onnx, graph_shapes, op_counts
from minillm.export.onnx_runtime import (
    LEVELS,
    OrtDecoder,
    ort_logits_fn,
    ort_session,
    quantize_int8,
)
from minillm.generation.cached import eager_decode_step, prefill

TOL = 1e-4


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def forward_path(model, onnx_dir):
    return export_forward(model, onnx_dir / "forward.onnx")


@pytest.fixture(scope="module")
def step_path(model, onnx_dir):
    return export_decoder_step(model, onnx_dir / "step.onnx")


@pytest.fixture(scope="module")
def decoder(step_path):
    return OrtDecoder(ort_session(step_path))


def test_forward_graph_is_valid_with_named_dynamic_axes(forward_path):
    shapes = graph_shapes(check_onnx(forward_path))
    assert shapes["input_ids"] == ["batch", "sequence"]
    assert shapes["logits"] == ["batch", "sequence", 4096]


@pytest.mark.parametrize("level", LEVELS)
def test_forward_matches_pytorch_at_every_level(model, forward_path, level):
    run = ort_logits_fn(ort_session(forward_path, level))
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (1, 7), (3, 17), (2, 64)]:  # batch and sequence unlike the example
        ids = torch.randint(0, model.config.vocab_size, shape, generator=g)
        with torch.inference_mode():
            expected = model(ids)
        assert run(ids).shape == expected.shape
        torch.testing.assert_close(run(ids), expected, atol=TOL, rtol=0)


def test_legacy_exporter_matches_too(model, onnx_dir):
    path = export_forward(model, onnx_dir / "legacy.onnx", dynamo=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.inference_mode():
        expected = model(ids)
    torch.testing.assert_close(ort_logits_fn(ort_session(path))(ids), expected, atol=TOL, rtol=0)


def test_step_graph_has_past_and_present_per_layer(model, step_path):
    shapes = graph_shapes(check_onnx(step_path))
    cfg = model.config
    kv = [cfg.num_key_value_heads, cfg.head_dim]
    for i in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            assert shapes[f"past_{kind}_{i}"] == ["batch", kv[0], "past_sequence", kv[1]]
            assert shapes[f"present_{kind}_{i}"][0] == "batch"
    assert shapes["attention_mask"] == ["batch", "total_sequence"]


def test_step_logits_match_pytorch_at_every_step(model, decoder, prompts):
    """Prompts of 3, 9 and 2 tokens: minillm right-pads them into its cache, ORT left-pads;
    each row's logits agree at the prefill and at each of 32 decode steps."""
    steps = 32
    logits, positions, mask, past = decoder.prefill(prompts)
    with torch.inference_mode():
        cache, ref, ref_pos = prefill(model, prompts, steps + 1)
        torch.testing.assert_close(torch.from_numpy(logits), ref, atol=TOL, rtol=0)
        assert positions.tolist() == ref_pos.tolist()
        for _ in range(steps):
            tokens = torch.from_numpy(logits).argmax(-1)
            ref = eager_decode_step(model, cache, tokens[:, None], ref_pos[:, None])
            mask = torch.cat([torch.from_numpy(mask), torch.ones(len(prompts), 1)], 1).long()
            mask = mask.numpy()
            step, past = decoder.step(tokens.numpy()[:, None], positions[:, None], mask, past)
            logits, positions, ref_pos = step[:, -1], positions + 1, ref_pos + 1
            torch.testing.assert_close(torch.from_numpy(logits), ref, atol=TOL, rtol=0)
    assert past[0].shape[2] == max(map(len, prompts)) + steps  # presents grew one per step


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_tokens_identical_to_minillm(model, decoder, prompts, batched):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    groups = [prompts] if batched else [[p] for p in prompts]
    for group in groups:
        ours = decoder.generate(group, params)
        assert ours == generate(model, group, params)
        assert all(len(row) == 40 for row in ours)


def test_sampled_tokens_identical_to_minillm(model, decoder, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=32, seed=7)
    assert decoder.generate(prompts, params) == generate(model, prompts, params)


def test_generate_stops_at_eos_like_minillm(model, decoder, prompts):
    params = SamplingParams(temperature=0, max_tokens=48)
    first = generate(model, prompts[:1], SamplingParams(temperature=0, max_tokens=8))[0]
    stop = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[first[4]])
    for p in (params, stop):
        assert decoder.generate(prompts, p) == generate(model, prompts, p)
    assert len(decoder.generate(prompts[:1], stop)[0]) <= 5


def test_decoder_refuses_bad_input(forward_path, decoder):
    with pytest.raises(ValueError, match="export_decoder_step"):
        OrtDecoder(ort_session(forward_path))
    with pytest.raises(ValueError, match="context"):
        decoder.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=400))
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([[1], []], SamplingParams(temperature=0, max_tokens=4))


def test_examples_of_size_one_still_export_dynamic_axes(onnx_dir, tiny_model):
    """torch 2.13 keeps a size-1 example axis dynamic (older versions froze it); if a
    later version freezes it again, check_onnx inside export_* raises FrozenAxisError."""
    tiny = tiny_model(num_hidden_layers=1)
    one = torch.zeros(1, 1, dtype=torch.long)
    fwd = export_forward(tiny, onnx_dir / "tiny.onnx", example_ids=one)
    ids = torch.randint(0, 64, (3, 5))
    with torch.inference_mode():
        expected = tiny(ids)
    torch.testing.assert_close(ort_logits_fn(ort_session(fwd))(ids), expected, atol=TOL, rtol=0)
    step = export_decoder_step(tiny, onnx_dir / "tiny_step.onnx", batch=1, seq=1, past=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert OrtDecoder(ort_session(step)).generate(prompts, params) == generate(
        tiny, prompts, params
    )


def test_check_onnx_names_an_axis_the_exporter_froze(onnx_dir):
    """Exported straight through torch.onnx with a [2, 1] example and no dynamic shapes:
    check_onnx finds the fixed axis."""
    lin = torch.nn.Linear(4, 3)
    path = export_module(lin, (torch.randn(2, 1, 4),), onnx_dir / "lin.onnx", ["x"], ["y"])
    assert graph_shapes(check_onnx(path))["x"] == [2, 1, 4]
    with pytest.raises(FrozenAxisError, match=r"x dim 1 \(sequence\) is fixed at 1"):
        check_onnx(path, dynamic={"x": {1: "sequence"}})


def test_unsupported_op_is_named_with_the_fix(onnx_dir):
    class Median(torch.nn.Module):
        def forward(self, x):
            return x - x.median(dim=-1, keepdim=True).values

    with pytest.raises(UnsupportedOpError, match=r"aten\.median\.dim.*custom_translation_table"):
        export_module(Median(), (torch.randn(2, 5),), onnx_dir / "m.onnx", ["x"], ["y"])


def test_ort_optimisations_fuse_nodes_without_changing_results(model, forward_path, onnx_dir):
    counts = {}
    for level in ("disable", "extended"):
        out = onnx_dir / f"forward_{level}.onnx"
        ort_session(forward_path, level, optimized_path=out)
        counts[level] = op_counts(out)
    assert counts["disable"] == op_counts(forward_path)  # level "disable" changes nothing
    fused = [op for op in counts["extended"] if op.startswith("com.microsoft.")]
    assert fused, "ORT's extended level used no contrib (fused) op"
    assert sum(counts["extended"].values()) < sum(counts["disable"].values())


def test_int8_quantized_graph_is_smaller_and_close(model, forward_path, onnx_dir):
    from minillm.training import next_token_agreement

    path = quantize_int8(forward_path, onnx_dir / "int8.onnx")
    assert "DynamicQuantizeLinear" in op_counts(path) or "MatMulInteger" in op_counts(path)
    assert path.stat().st_size < 0.5 * forward_path.stat().st_size
    ids = torch.randint(0, model.config.vocab_size, (2 * 64 + 1,), generator=torch.Generator())
    fp32 = ort_logits_fn(ort_session(forward_path))
    int8 = ort_logits_fn(ort_session(path))
    assert next_token_agreement(fp32, int8, ids, window=64) > 0.8
