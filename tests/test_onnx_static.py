"""The static-cache decoder step with IOBinding (minillm.export.onnx_static): the same
tokens as the concatenating `OrtDecoder` loop and as minillm, the cache written in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from minillm import SamplingParams, generate  # noqa: E402
from minillm.export.onnx import export_decoder_step  # noqa: E402
from minillm.export.onnx_checks import op_counts  # noqa: E402
from minillm.export.onnx_runtime import OrtDecoder, ort_session  # noqa: E402
from minillm.export.onnx_static import OrtStaticDecoder, export_static_step  # noqa: E402


@pytest.fixture(scope="module")
def static_path(onnx_step):
    return onnx_step("static")


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


def test_opset_23_llm_ops_give_the_same_tokens_in_fewer_nodes(
    model, static_path, prompts, tmp_path
) -> None:
    """`llm_ops=True`: each RMSNorm, RoPE and attention is one opset-23 node (no ORT
    contrib op), the model is otherwise unchanged after export, and IOBinding on that graph
    gives minillm's tokens, batched with left padding too."""
    from minillm.export.onnx_static import onnx_llm_ops

    x = torch.tensor([prompts[0]])
    before = model(x)
    path = export_static_step(model, tmp_path / "ops.onnx", llm_ops=True)
    with onnx_llm_ops(model):  # the model's own ops again on the way out, even after an error
        with pytest.raises(ValueError, match="explicit mask"):
            model(x)
    assert torch.equal(model(x), before)
    n, ops = model.config.num_hidden_layers, op_counts(path)
    assert ops["RMSNormalization"] == 2 * n + 1
    assert ops["RotaryEmbedding"] == 2 * n  # q and k
    assert ops["Attention"] == n
    assert not {"Pow", "ReduceMean", "Softmax", "Neg"} & set(ops)
    assert sum(ops.values()) < 0.7 * sum(op_counts(static_path).values())
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    static = OrtStaticDecoder(ort_session(path), max_len=48)
    assert static.generate(prompts, params) == generate(model, prompts, params)


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


def _event(op: str, inputs: list, outputs: list, parameter_size: int = 0) -> dict:
    """A node event as ORT's profiler writes it (only the fields `kernel_kind` reads)."""
    shapes = [[{"float": dims} for dims in tensors] for tensors in (inputs, outputs)]
    args = {"op_name": op, "parameter_size": str(parameter_size)}
    return {"args": args | {"input_type_shape": shapes[0], "output_type_shape": shapes[1]}}


def test_kernel_kind_sorts_a_plain_step() -> None:
    from minillm.export.ort_profile import kernel_kind

    layer_k = 2 * 64 * 32 * 4  # kv_heads 2, 64 slots, head_dim 32, fp32
    slots = range(64, 70)
    kind = lambda *a, **k: kernel_kind(_event(*a, **k), layer_k, slots)  # noqa: E731
    # ORT prepacks a constant MatMul weight: the profile lists the activation alone.
    assert kind("MatMul", [[1, 1, 64]], [[1, 1, 128]]) == "weights"
    assert kind("Gather", [[1, 1]], [[1, 1, 64]], parameter_size=1 << 20) == "weights"
    assert kind("Concat", [[1, 2, 64, 32], [1, 2, 1, 32]], [[1, 2, 65, 32]]) == "cache copies"
    assert kind("Expand", [[1, 2, 1, 65, 32]], [[1, 2, 2, 65, 32]]) == "cache copies"
    assert kind("Reshape", [[1, 2, 2, 65, 32]], [[1, 4, 65, 32]]) == "other"  # a view
    assert kind("MatMul", [[1, 4, 1, 32], [1, 4, 32, 65]], [[1, 4, 1, 65]]) == "attention"
    assert kind("Softmax", [[1, 4, 1, 65]], [[1, 4, 1, 65]]) == "attention"
    assert kind("Mul", [[1, 1, 48]], [[1, 1, 48]]) == "other"  # hidden size 48: no slot axis
    assert kind("Add", [[1, 1, 128]], [[1, 1, 128]]) == "other"
    # An axis is told apart by its length alone: a hidden size among the slot counts is not.
    assert kind("Mul", [[1, 1, 64]], [[1, 1, 64]]) == "attention"
    # GroupQueryAttention reads its cos/sin tables (an initializer) and lists the whole
    # present buffer, written in place, as an output: attention, not weights or a copy.
    gqa_out = [[1, 1, 128], [1, 2, 70, 32], [1, 2, 70, 32]]
    gqa = ("GroupQueryAttention", [[1, 1, 192], [1, 2, 70, 32]], gqa_out)
    assert kind(*gqa, parameter_size=1 << 20) == "attention"


def test_the_profile_finds_the_plain_loops_copies_and_not_iobindings(
    model, step_path, static_path
) -> None:
    """ORT's profiler on both loops after a 64-token prompt: the plain loop's cache ops are
    copies (Concat: past ++ new), IOBinding's (grouped) only its in-place scatter."""
    from minillm.bench.ort_iobinding import plain_runner, static_runner
    from minillm.export.ort_profile import amdahl_bound, profiled_session, step_split

    context, steps = 64, 4
    cfg = model.config
    layer_k = cfg.num_key_value_heads * context * cfg.head_dim * 4
    splits = {}
    for name, path, runner in (
        ("plain", step_path, plain_runner),
        ("static", static_path, static_runner),
    ):
        session = profiled_session(path, prefix=path.parent / "profile")
        run = runner(session, list(range(1, context + 1)), steps)
        run(), run()
        splits[name] = step_split(session, steps, layer_k, range(context, context + steps + 1))
        assert splits[name].kinds["weights"] > 0, name  # the prepacked MatMuls were found
        assert not list(path.parent.glob("profile*.json")), "the trace file is removed"
    plain, static = splits["plain"], splits["static"]
    # Which ops are copies is structural; how long they take on this tiny model is noise
    # (timings belong to the benchmark), so no comparison of the two loops' times here.
    assert 0 < plain.copy_fraction < plain.cache_fraction < 1
    assert amdahl_bound(plain.cache_fraction) > amdahl_bound(plain.copy_fraction) > 1
    assert plain.by_op["cache copies"]["Concat"] > 0  # past ++ new
    assert list(static.by_op["cache copies"]) == ["ScatterElements"]  # in place
    with pytest.raises(ValueError, match="run the"):
        step_split(profiled_session(step_path, prefix=step_path.parent / "p"), 1, layer_k, range(1))
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        amdahl_bound(1.0)


def test_the_benchmark_names_the_graphs_it_was_not_given(model, step_path, static_path) -> None:
    """`speed_fns` times graphs exported once (`export_graphs`); a missing variant is named."""
    from minillm.bench.ort_iobinding import GQA, PLAIN, STATIC, speed_fns

    with pytest.raises(ValueError, match=f"{GQA}.*export_graphs"):
        speed_fns(model, {PLAIN: step_path, STATIC: static_path}, 8, 2, 1)
