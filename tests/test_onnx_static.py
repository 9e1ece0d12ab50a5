"""The static-cache decoder step with IOBinding (minillm.export.onnx_static): the same
tokens as the concatenating `OrtDecoder` loop and as minillm, the cache written in place."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from minillm import SamplingParams, generate  # noqa: E402
from minillm.export.onnx import export_decoder_step  # noqa: E402
from minillm.export.onnx_checks import op_counts  # noqa: E402
from minillm.export.onnx_runtime import OrtDecoder, ort_session  # noqa: E402
from minillm.export.onnx_static import OrtStaticDecoder, export_static_step  # noqa: E402


@pytest.fixture(scope="module")
def static_path(model, tmp_path_factory):
    return export_static_step(model, tmp_path_factory.mktemp("static") / "static.onnx")


@pytest.fixture(scope="module")
def step_path(model, tmp_path_factory):
    return export_decoder_step(model, tmp_path_factory.mktemp("step") / "step.onnx")


def test_the_cache_is_scattered_not_concatenated(static_path) -> None:
    """Each past buffer is read by one ScatterElements (written in place) and at most a
    Shape; the present it outputs is that ScatterElements' result: no copy of the cache."""
    import onnx

    graph = onnx.load(str(static_path)).graph
    assert op_counts(static_path)["ScatterElements"] == 2 * 4  # K and V of 4 layers
    producer = {out: node for node in graph.node for out in node.output}
    for inp in (i.name for i in graph.input if i.name.startswith("past_")):
        users = [node.op_type for node in graph.node if inp in node.input]
        assert sorted(set(users) - {"Shape"}) == ["ScatterElements"], (inp, users)
    for out in (o.name for o in graph.output if o.name.startswith("present_")):
        assert producer[out].op_type == "ScatterElements", out


@pytest.mark.parametrize("batched", [False, True])
def test_iobinding_gives_the_plain_loops_tokens(model, static_path, step_path, prompts, batched):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rows = prompts if batched else prompts[:1]
    plain = OrtDecoder(ort_session(step_path))
    static = OrtStaticDecoder(ort_session(static_path), max_len=48)
    tokens = static.generate(rows, params)
    assert tokens == plain.generate(rows, params)
    assert tokens == generate(model, rows, params)


def test_the_bound_buffers_hold_the_cache(model, static_path, prompts) -> None:
    """After generation the K/V of every written slot sit in the preallocated numpy
    buffers (ORT wrote into them) and the slots after the last step are untouched."""
    static = OrtStaticDecoder(ort_session(static_path), max_len=40)
    static.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    written = len(prompts[0]) + 4  # the prompt, then one slot per decode step but the last
    key0 = static.buffers[0]
    assert np.abs(key0[:, :, :written]).min(axis=-1).max() > 0
    assert not key0[:, :, written:].any()


def test_static_decoder_names_the_fixes(static_path, step_path, prompts) -> None:
    with pytest.raises(ValueError, match="larger max_len"):
        OrtStaticDecoder(ort_session(static_path), max_len=8).generate(
            prompts[:1], SamplingParams(max_tokens=16)
        )
    with pytest.raises(ValueError, match="export_static_step"):
        OrtStaticDecoder(ort_session(step_path), 8)
