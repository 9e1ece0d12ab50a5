"""The decoder step with ORT's GroupQueryAttention (minillm.export.onnx_gqa): one node per
layer for RoPE, the cache write and attention; minillm's logits and tokens with prompts
right-padded; the cache written in place in the bound buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from minillm import SamplingParams, generate  # noqa: E402
from minillm.export.onnx_checks import op_counts  # noqa: E402
from minillm.export.onnx_gqa import GqaCache, OrtGqaDecoder, export_gqa_step  # noqa: E402
from minillm.export.onnx_runtime import ort_session  # noqa: E402
from minillm.export.onnx_static import OrtStaticDecoder  # noqa: E402
from minillm.model import random_model  # noqa: E402


@pytest.fixture(scope="module", params=["fused", "traced"])
def gqa_path(onnx_step, request):
    """The graph as `export_gqa_step` writes it, and as traced (`fuse=False`)."""
    return onnx_step("gqa" if request.param == "fused" else "gqa-traced")


def test_one_node_per_layer_reads_and_writes_the_cache(model, gqa_path, onnx_step) -> None:
    """Each past buffer feeds one GroupQueryAttention, which outputs the present: no
    scatter, no softmax, no RoPE arithmetic left around it."""
    import onnx

    graph = onnx.load(str(gqa_path)).graph
    n, ops = model.config.num_hidden_layers, op_counts(gqa_path)
    assert ops["com.microsoft.GroupQueryAttention"] == n
    norms = ops["RMSNormalization"] + ops["com.microsoft.SkipSimplifiedLayerNormalization"]
    assert norms == 2 * n + 1
    assert not {"ScatterElements", "Softmax", "Neg", "Cos", "Sin", "Pow"} & set(ops)
    assert ops["Transpose"] <= 1  # the tied lm_head's weight, if anything
    producer = {out: node for node in graph.node for out in node.output}
    for inp in (i.name for i in graph.input if i.name.startswith("past_")):
        users = [node.op_type for node in graph.node if inp in node.input]
        assert users == ["GroupQueryAttention"], (inp, users)
    for out in (o.name for o in graph.output if o.name.startswith("present_")):
        assert producer[out].op_type == "GroupQueryAttention", out
    static = op_counts(onnx_step("static"))
    assert sum(ops.values()) < 0.4 * sum(static.values())


def test_prefill_logits_match_minillm_with_right_padding(model, gqa_path, prompts) -> None:
    """Both prompts in one right-padded batch: each row's logits at its real tokens are
    minillm's for that prompt alone."""
    decoder = OrtGqaDecoder(ort_session(gqa_path), max_len=32)
    decoder.allocate(len(prompts))
    lengths = np.array([len(p) for p in prompts])
    assert len(set(lengths)) > 1  # the padding is exercised
    ids = np.zeros((len(prompts), lengths.max()), np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    logits = decoder.step(ids, lengths - 1, int(lengths.max()))
    with torch.inference_mode():
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p]))[0].numpy()
            np.testing.assert_allclose(logits[b, : len(p)], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("batched", [False, True])
def test_gqa_gives_minillms_tokens(model, gqa_path, prompts, batched) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rows = prompts if batched else prompts[:1]
    tokens = OrtGqaDecoder(ort_session(gqa_path), max_len=48).generate(rows, params)
    assert tokens == generate(model, rows, params)


def test_sampling_matches_the_static_decoder(gqa_path, onnx_step, prompts) -> None:
    """Seeded sampling draws from the same logits in both decoders: the same tokens."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=3, ignore_eos=True)
    static = OrtStaticDecoder(ort_session(onnx_step("static")), 48)
    gqa = OrtGqaDecoder(ort_session(gqa_path), max_len=48)
    assert gqa.generate(prompts, params) == static.generate(prompts, params)


def test_the_bound_buffers_hold_the_cache(gqa_path, prompts) -> None:
    """GQA wrote each row's K/V into the preallocated buffers in place: the longer row's
    slots up to its last step are filled, and nothing after the longest row's."""
    decoder = OrtGqaDecoder(ort_session(gqa_path), max_len=40)
    decoder.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    key0 = decoder.buffers[0]
    for b, p in enumerate(prompts):
        written = len(p) + 4  # the prompt, then one slot per decode step but the last
        assert np.abs(key0[b, :, :written]).min(axis=-1).max() > 0, b
    assert not key0[:, :, max(map(len, prompts)) + 4 :].any()


def test_gqa_names_the_fixes(gqa_path, onnx_step, prompts, tmp_path, tiny_config) -> None:
    with pytest.raises(ValueError, match="max_len <= 256"):
        OrtGqaDecoder(ort_session(gqa_path), max_len=300)
    with pytest.raises(ValueError, match="larger max_len"):
        OrtGqaDecoder(ort_session(gqa_path), max_len=8).generate(
            prompts[:1], SamplingParams(max_tokens=16)
        )
    static = onnx_step("static")
    with pytest.raises(ValueError, match="export_gqa_step"):
        OrtGqaDecoder(ort_session(static), 8)
    with pytest.raises(ValueError, match="export_static_step"):
        OrtStaticDecoder(ort_session(gqa_path), 8)
    with pytest.raises(ValueError, match="float"):
        export_gqa_step(random_model(tiny_config()).to(torch.bfloat16), tmp_path / "b.onnx")
    odd = random_model(tiny_config(hidden_size=96))  # 4 heads of 24
    with pytest.raises(ValueError, match="export_static_step"):
        export_gqa_step(odd, tmp_path / "odd.onnx")  # head_dim 24
    cache = GqaCache([], torch.zeros(1), torch.zeros(()), torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="inside an ONNX export"):
        x = torch.zeros(1, 4, 1, 32)
        cache.attention(0, x, x[:, :2], x[:, :2], torch.zeros(1, 1))
    with pytest.raises(RuntimeError, match=r"allocate\(batch\) first"):
        OrtGqaDecoder(ort_session(gqa_path), max_len=8).prefill(prompts[:1])
