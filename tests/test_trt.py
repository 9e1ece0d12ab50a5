"""The TensorRT path: profiles and settings everywhere; engines only on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from minillm.export.tensorrt import (
    CPU_EP,
    CUDA_EP,
    TRT_EP,
    IdsToLogits,
    ShapeProfile,
    compile_tensorrt,
    export_program,
    gpu_status,
    llm_profile,
    ort_gpu_session,
    ort_providers,
    ort_shape_string,
    ort_trt_options,
    trt_compile_settings,
    trt_input_spec,
)

STATUS = gpu_status()
needs_cpu_only = pytest.mark.skipif(STATUS["cuda"], reason="checks the error seen without CUDA")


def test_profile_checks_its_shapes():
    p = ShapeProfile((1, 1), (2, 64), (8, 256))
    assert p.dynamic_dims == [0, 1]
    assert p.covers((1, 1)) and p.covers((8, 256)) and p.covers((3, 17))
    assert not p.covers((9, 1)) and not p.covers((1, 257)) and not p.covers((1, 1, 1))
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ShapeProfile((1, 8), (2, 4), (8, 256))
    with pytest.raises(ValueError, match="one rank"):
        ShapeProfile((1,), (2, 4), (8, 256))
    with pytest.raises(ValueError, match="opt >= 2"):
        ShapeProfile((1, 1), (1, 64), (8, 256))  # dynamic batch traced at 1
    decode = ShapeProfile((1, 1), (4, 1), (8, 1))  # a static sequence of 1 is fine
    assert decode.dynamic_dims == [0]


def test_llm_profile_spans_decode_and_prefill():
    p = llm_profile(256, max_batch=8)
    assert p.min == (1, 1) and p.max == (8, 256) and p.opt == (2, 128)
    assert llm_profile(256, opt_seq=200).opt == (2, 200)


def test_torch_tensorrt_input_spec():
    spec = trt_input_spec(llm_profile(256))
    assert spec == {
        "min_shape": [1, 1],
        "opt_shape": [2, 128],
        "max_shape": [8, 256],
        "dtype": torch.int64,
    }
    with pytest.raises(ValueError, match="integers"):
        trt_input_spec(llm_profile(256), dtype=torch.float32)


def test_compile_settings():
    s = trt_compile_settings(optimization_level=5)
    assert s["ir"] == "dynamo" and s["use_explicit_typing"] and s["optimization_level"] == 5
    assert s["workspace_size"] == 2**30
    assert "enabled_precisions" not in s  # deprecated in torch-tensorrt 2.13: cast instead
    with pytest.raises(ValueError, match="0..5"):
        trt_compile_settings(optimization_level=7)


def test_ort_tensorrt_provider_options():
    opts = ort_trt_options(llm_profile(256), cache_dir="/tmp/engines", fp16=True)
    assert opts["trt_profile_min_shapes"] == "input_ids:1x1"
    assert opts["trt_profile_opt_shapes"] == "input_ids:2x128"
    assert opts["trt_profile_max_shapes"] == "input_ids:8x256"
    assert opts["trt_fp16_enable"] is True and opts["trt_engine_cache_enable"] is True
    assert opts["trt_engine_cache_path"] == "/tmp/engines"
    two = ort_shape_string({"input_ids": (1, 8), "attention_mask": (1, 8)})
    assert two == "input_ids:1x8,attention_mask:1x8"


def test_ort_provider_lists():
    trt = ort_providers("tensorrt", llm_profile(128))
    assert [p if isinstance(p, str) else p[0] for p in trt] == [TRT_EP, CUDA_EP, CPU_EP]
    assert ort_providers("cuda")[0][0] == CUDA_EP and ort_providers("cuda")[-1] == CPU_EP
    with pytest.raises(ValueError, match="ShapeProfile"):
        ort_providers("tensorrt")
    with pytest.raises(ValueError, match="'tensorrt' or 'cuda'"):
        ort_providers("rocm")


def test_ids_to_logits_is_the_model(tiny_model):
    model = tiny_model()
    ids = torch.randint(128, (2, 9))
    with torch.inference_mode():
        assert torch.equal(IdsToLogits(model)(ids), model(ids))


@needs_cpu_only
def test_without_cuda_engines_say_what_is_missing(tmp_path, tiny_model):
    with pytest.raises(RuntimeError, match="CUDA"):
        compile_tensorrt(tiny_model(), llm_profile(64))
    with pytest.raises(RuntimeError, match="CUDA"):
        ort_gpu_session(tmp_path / "model.onnx", "tensorrt", llm_profile(64))
    with pytest.raises(ValueError, match="precision"):
        compile_tensorrt(tiny_model(), llm_profile(64), precision="int3")


@pytest.mark.skipif(
    not (STATUS["cuda"] and STATUS["torch_tensorrt"]), reason="needs CUDA and torch_tensorrt"
)
def test_torch_tensorrt_engine_matches_eager_fp16(tiny_model):
    model = tiny_model()
    engine = compile_tensorrt(model, llm_profile(64, max_batch=4))
    ref = model.cuda().half()
    for shape in [(1, 1), (2, 32), (4, 64)]:  # min, opt, max of the profile
        ids = torch.randint(128, shape).cuda()
        with torch.inference_mode():
            a, b = engine(ids).float(), ref(ids).float()
        assert (a - b).abs().max().item() < 5e-2
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.95


@pytest.mark.skipif(CUDA_EP not in STATUS["ort_providers"], reason="needs onnxruntime-gpu")
def test_ort_cuda_session_matches_eager(tmp_path, tiny_model):
    from minillm.export.tensorrt import export_onnx, ort_cuda_fn

    model = tiny_model()
    fn = ort_cuda_fn(ort_gpu_session(export_onnx(model, tmp_path / "m.onnx"), "cuda"), 128)
    ids = torch.randint(128, (2, 16)).cuda()
    with torch.inference_mode():
        assert torch.allclose(fn(ids), model.cuda()(ids), atol=1e-3)


def test_the_model_exports_with_the_profile_ranges(tiny_model):
    """What torch_tensorrt.compile does first (torch.export with dynamic dims), on CPU."""
    model = tiny_model()
    profile = ShapeProfile((1, 1), (2, 16), (4, 64))
    ep = export_program(model, profile)
    ranges = sorted((r.lower, r.upper) for r in ep.range_constraints.values())
    assert ranges == [(1, 4), (1, 64)]
    for shape in [profile.min, profile.opt, profile.max, (3, 5)]:
        ids = torch.randint(128, shape, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            assert torch.allclose(ep.module()(ids), model(ids), atol=1e-5), shape
    static = export_program(model, ShapeProfile((2, 8), (2, 8), (2, 8)))
    assert not static.range_constraints  # nothing dynamic: one fixed shape
    with pytest.raises(ValueError, match="batch, sequence"):
        export_program(model, ShapeProfile((1,), (2,), (4,)))
