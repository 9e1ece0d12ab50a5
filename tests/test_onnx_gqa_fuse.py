"""GenAI's two fusions on our GroupQueryAttention graph (minillm.export.onnx_gqa_fuse):
packed q, k, v and Add + RMSNorm as one node; the same logits and tokens as the traced
graph and minillm, with and without projection biases; anything else refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")

from minillm import SamplingParams, generate  # noqa: E402
from minillm.export.onnx_checks import op_counts  # noqa: E402
from minillm.export.onnx_gqa import OrtGqaDecoder, export_gqa_step  # noqa: E402
from minillm.export.onnx_gqa_fuse import fuse_gqa_graph  # noqa: E402
from minillm.export.onnx_runtime import ort_session  # noqa: E402


def _prefill(path, prompts) -> np.ndarray:
    """Logits [B, T, vocab] of the prompts right-padded in one batch."""
    decoder = OrtGqaDecoder(ort_session(path), max_len=32)
    decoder.allocate(len(prompts))
    lengths = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), lengths.max()), np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return decoder.step(ids, lengths - 1, int(lengths.max()))


def test_the_fused_graph_has_genais_shape(model, onnx_step) -> None:
    """Per layer: one q/k/v product feeding the node packed, two SkipSimplified norms; no
    Reshape and no residual Add left."""
    traced = onnx_step("gqa-traced")
    proto = onnx.load(str(traced))
    done = fuse_gqa_graph(proto)
    cfg, n = model.config, model.config.num_hidden_layers
    assert done == {"packed qkv": n, "skip norm": 2 * n}
    ops, before = op_counts(proto), op_counts(traced)
    assert ops["MatMul"] == before["MatMul"] - 2 * n == 5 * n + 1  # q, k, v -> qkv
    assert ops["com.microsoft.SkipSimplifiedLayerNormalization"] == 2 * n
    assert ops["RMSNormalization"] == 1  # the first layer's: no residual before it
    assert not {"Reshape", "Add", "Concat", "Shape"} & set(ops)
    weights = {t.name: t for t in proto.graph.initializer}
    producer = {out: node for node in proto.graph.node for out in node.output}
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    for node in (n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        assert list(node.input[1:3]) == ["", ""]
        qkv = producer[node.input[0]]
        assert qkv.op_type == "MatMul" and weights[qkv.input[1]].dims == [cfg.hidden_size, width]
    with pytest.raises(ValueError, match="already takes q, k, v packed"):
        fuse_gqa_graph(proto)


def test_fused_logits_are_the_traced_graphs(onnx_step, prompts) -> None:
    fused = _prefill(onnx_step("gqa"), prompts)
    traced = _prefill(onnx_step("gqa-traced"), prompts)
    for b, p in enumerate(prompts):  # the padded positions' logits are not meant to agree
        np.testing.assert_allclose(fused[b, : len(p)], traced[b, : len(p)], atol=1e-4, rtol=0)


def test_projection_biases_are_packed(tiny_model, tmp_path) -> None:
    """Qwen2-style q, k, v biases go into one packed bias: minillm's logits and tokens."""
    model, prompts = tiny_model(qkv_bias=True), [[5, 17, 99, 3, 64], [7, 8]]
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()  # visible in the logits if a bias were dropped or misplaced
    path = export_gqa_step(model, tmp_path / "bias.onnx")
    assert op_counts(path)["Add"] == model.config.num_hidden_layers  # one packed bias each
    logits = _prefill(path, prompts)
    with torch.inference_mode():
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p]))[0].numpy()
            np.testing.assert_allclose(logits[b, : len(p)], ref, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    decoder = OrtGqaDecoder(ort_session(path), max_len=32)
    assert decoder.generate(prompts, params) == generate(model, prompts, params)


def test_other_graphs_are_refused(onnx_step) -> None:
    static = onnx.load(str(onnx_step("static")))
    with pytest.raises(ValueError, match="no GroupQueryAttention node"):
        fuse_gqa_graph(static)
    proto = onnx.load(str(onnx_step("gqa-traced")))
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    gqa.input[1] = gqa.input[3]  # k read from the past buffer: not a projection
    with pytest.raises(ValueError, match="not a projection"):
        fuse_gqa_graph(proto)
