"""The explicit Q/DQ ONNX graph (minillm.export.qdq) with chapter 04's calibrated scales,
run on ONNX Runtime's CPU provider, against the course's own fake quantization
(`minillm.quant.calibrate.FakeQuantLinear`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from minillm.export.onnx import export_module  # noqa: E402
from minillm.export.onnx_checks import op_counts  # noqa: E402
from minillm.export.onnx_runtime import (  # noqa: E402
    QDQ_FUSIONS,
    int8_gemm_saturates,
    ort_logits_fn,
    ort_session,
    qdq_session,
)
from minillm.export.qdq import (  # noqa: E402
    QDQLinear,
    activation_scales,
    describe_gemm_inputs,
    export_qdq,
    to_fp8,
)
from minillm.quant.calibrate import (  # noqa: E402
    FakeQuantLinear,
    collect_stats,
    compute_scales,
    fake_quantize_model,
)


def test_one_qdq_linear_on_ort_is_our_fake_quant_exactly(tmp_path) -> None:
    """Inside the calibrated range the Q/DQ nodes compute exactly what FakeQuantLinear
    does: the same scales, the same rounding."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(8, 64, generator=g)
    scale = float(x.abs().max()) / 127
    path = export_module(
        QDQLinear(lin, scale), (x,), tmp_path / "l.onnx", ["x"], ["y"], dynamo=False
    )
    assert op_counts(path)["QuantizeLinear"] == 2  # the input and the weight
    got = torch.from_numpy(qdq_session(path).run(None, {"x": x.numpy()})[0])
    with torch.no_grad():
        ref = FakeQuantLinear(lin, scale)(x)
    assert torch.allclose(got, ref, atol=1e-5)


def test_which_cpus_saturate_is_read_from_the_vnni_flags() -> None:
    if not int8_gemm_saturates(""):  # not x86-64: no vpmaddubsw, nothing to read
        assert not int8_gemm_saturates("flags\t: fpu avx2")
        return
    assert int8_gemm_saturates("flags\t: fpu sse4_1 avx2 fma")
    assert int8_gemm_saturates("flags\t: avx2 avx512f avx512bw")  # AVX512 without VNNI
    for vnni in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert not int8_gemm_saturates(f"flags\t: avx2 avx512f {vnni}")


@pytest.mark.skipif(
    not int8_gemm_saturates(), reason="this CPU's int8 GEMM adds into int32 (VNNI, AMX or ARM)"
)
def test_ort_fused_int8_gemm_saturates_without_vnni_and_qdq_session_does_not(tmp_path) -> None:
    """Every input at +127 steps (u8 255 after ORT's shift) times every weight at +127:
    each pair of products is 64,770, past int16's 32,767, so `vpmaddubsw` clips it. ORT's
    fused kernel loses much of the sum; `qdq_session` runs the graph as written."""
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.5)
    x = torch.ones(4, 64)
    path = export_module(
        QDQLinear(lin, 1 / 127), (x,), tmp_path / "s.onnx", ["x"], ["y"], dynamo=False
    )
    with torch.no_grad():
        ref = FakeQuantLinear(lin, 1 / 127)(x)
    fused = ort_session(path, "all").run(None, {"x": x.numpy()})[0]
    exact = qdq_session(path, "all").run(None, {"x": x.numpy()})[0]
    assert np.allclose(exact, ref.numpy(), rtol=1e-5)
    assert np.abs(fused - ref.numpy()).max() > 0.1 * ref.abs().max().item()
    unfused = ort_session(path, "all", disabled_optimizers=QDQ_FUSIONS)
    assert np.allclose(unfused.run(None, {"x": x.numpy()})[0], exact)


@pytest.mark.parametrize("method", ["max", "percentile"])
def test_qdq_model_on_ort_is_close_to_our_fake_quant(model, tmp_path, method) -> None:
    """Whole model: where activations pass a threshold (later layers see the int8 model's
    activations, calibration saw fp32's; percentile clips by design) ONNX saturates at
    -128 steps and we at -127, so the two drift apart, far less than either from fp32."""
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(1, model.config.vocab_size, (2, 64), generator=g)]
    stats = collect_stats(model, calib, bins=256)
    scales = compute_scales(stats, method, 99.0)
    path = export_qdq(model, scales, tmp_path / "qdq.onnx")
    ops = op_counts(path)
    # one Q/DQ pair per weight, one per activation tensor (q/k/v read one tensor, as do
    # gate/up: calibration and the exporter both see a single tensor there)
    tensors = len({id(s) for s in stats.values()})
    assert ops["QuantizeLinear"] == ops["DequantizeLinear"] == len(scales) + tensors
    ids = torch.randint(1, model.config.vocab_size, (2, 40), generator=g)
    with torch.inference_mode():
        ref, fp32 = fake_quantize_model(model, scales)(ids), model(ids)
    for level in ("disable", "all"):  # "all": ORT fuses the Q/DQ around MatMuls
        got = ort_logits_fn(qdq_session(path, level))(ids)
        assert (got - ref).norm() < 0.5 * (ref - fp32).norm(), level
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9, level


def test_the_graph_holds_our_scales_and_shows_the_qdq_pattern(model, tmp_path) -> None:
    """What the notebook prints: each activation tensor's scale is in the graph as we
    calibrated it (float32), and a GEMM's inputs are Q -> DQ on both sides."""
    import onnx

    g = torch.Generator().manual_seed(2)
    stats = collect_stats(model, [torch.randint(1, 4096, (2, 32), generator=g)], bins=256)
    scales = compute_scales(stats, "percentile", 99.0)
    proto = onnx.load(export_qdq(model, scales, tmp_path / "qdq.onnx"))
    per_tensor = {id(stats[name]): scale for name, scale in scales.items()}
    ours = sorted(np.float32(s).item() for s in per_tensor.values())
    assert sorted(activation_scales(proto)) == ours
    lines = describe_gemm_inputs(proto, "/model/layers.0/self_attn/q_proj/MatMul")
    kinds = [line.split()[1] for line in lines[1:]]
    assert kinds[:2] == kinds[4:6] == ["DequantizeLinear", "QuantizeLinear"]
    assert kinds[3] == "Transpose" and "per tensor" in lines[1] and "per output channel" in lines[5]
    assert lines[-1].endswith("q_proj.weight [128, 128] (fp32)")
    with pytest.raises(KeyError, match="MatMul nodes are named like"):
        describe_gemm_inputs(proto, "q_proj")


def test_the_fp8_graph_is_our_fp8_fake_quant(tmp_path) -> None:
    """to_fp8 keeps each threshold and changes the type: one linear on ORT equals
    minillm.quant.fp8's e4m3 fake quantization (input per tensor, weight per channel)."""
    import onnx

    from minillm.quant.fp8 import fp8_fake_quant

    g = torch.Generator().manual_seed(3)
    lin, x = nn.Linear(64, 32, bias=False), torch.randn(8, 64, generator=g) * 4
    int8 = export_module(
        QDQLinear(lin, float(x.abs().max()) / 127).requires_grad_(False),
        (x,),
        tmp_path / "int8.onnx",
        ["x"],
        ["y"],
        dynamo=False,
    )
    path = tmp_path / "fp8.onnx"
    onnx.save(to_fp8(onnx.load(int8)), path)
    got = torch.from_numpy(ort_session(path).run(None, {"x": x.numpy()})[0])
    with torch.no_grad():
        ref = fp8_fake_quant(x, "e4m3") @ fp8_fake_quant(lin.weight, "e4m3", per_row=True).T
        int8_out = torch.from_numpy(ort_session(int8).run(None, {"x": x.numpy()})[0])
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, int8_out, atol=1e-3), "still int8: the type did not change"
