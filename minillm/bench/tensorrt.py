"""Chapter 04 on a GPU: eager fp16, torch.compile, torch-tensorrt and ONNX Runtime's CUDA and
TensorRT providers on the same token ids, against eager fp32 (logit error, argmax agreement,
time ratio), and the time of forwards issued on several CUDA streams. Needs an NVIDIA GPU
with torch-tensorrt and onnxruntime-gpu; the command line is `python -m benchmarks.tensorrt`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minillm.export.tensorrt import (
    ShapeProfile,
    compile_tensorrt,
    export_onnx,
    llm_profile,
    ort_cuda_fn,
    ort_gpu_session,
    require_cuda,
)
from minillm.lab.timing import time_ratios


def compare_backends(
    model: nn.Module,
    shapes: Sequence[tuple[int, int]] = ((1, 1), (1, 128), (8, 128)),
    profile: ShapeProfile | None = None,
    onnx_path: str | Path = "minillm_forward.onnx",
    repeats: int = 20,
    backends: Sequence[str] = (
        "eager fp16",
        "torch.compile fp16",
        "torch-tensorrt fp16",
        "ORT CUDA fp32",
        "ORT TensorRT fp16",
    ),
) -> dict[str, Any]:
    """GPU: every backend on the same token ids at each (batch, seq) in `shapes`: max |logit
    difference| and argmax agreement with eager fp32, and time relative to eager fp32 (A/B
    interleaved, median of paired ratios). A backend that fails to build is reported with
    its error instead of stopping the comparison."""
    require_cuda()
    max_seq = max(s for _, s in shapes)
    profile = profile or llm_profile(max_seq, max_batch=max(b for b, _ in shapes))
    base = copy.deepcopy(model).cuda().float().eval()
    vocab = model.config.vocab_size
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"eager fp32": base}
    errors: dict[str, str] = {}
    builders: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
        "eager fp16": lambda: copy.deepcopy(base).half(),
        "torch.compile fp16": lambda: torch.compile(copy.deepcopy(base).half(), dynamic=True),
        "torch-tensorrt fp16": lambda: compile_tensorrt(model, profile, "fp16"),
        "ORT CUDA fp32": lambda: ort_cuda_fn(
            ort_gpu_session(export_onnx(copy.deepcopy(model), onnx_path), "cuda"), vocab
        ),
        "ORT TensorRT fp16": lambda: ort_cuda_fn(
            ort_gpu_session(export_onnx(copy.deepcopy(model), onnx_path), "tensorrt", profile),
            vocab,
        ),
    }
    for name in backends:
        try:
            fns[name] = builders[name]()
        except Exception as e:  # report and go on: one missing engine should not hide the rest
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch, seq in shapes:
        ids = torch.randint(vocab, (batch, seq), generator=g).cuda()
        with torch.inference_mode():
            ref = base(ids).float()
            outs = {name: fn(ids).float() for name, fn in fns.items()}
            timed = {name: (lambda fn=fn, ids=ids: fn(ids)) for name, fn in fns.items()}
            ratios = time_ratios(timed, "eager fp32", repeats=repeats, warmup=3)
        for name, out in outs.items():
            rows.append(
                {
                    "backend": name,
                    "shape": (batch, seq),
                    "max_abs_diff": (out - ref).abs().max().item(),
                    "argmax_agreement": (out.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                    "time_vs_eager_fp32": ratios[name],
                }
            )
    return {"profile": profile, "rows": rows, "errors": errors, "gpu": torch.cuda.get_device_name()}


def multi_stream_ratio(
    model: nn.Module, requests: int = 8, seq: int = 1, streams: int = 2, repeats: int = 20
) -> float:
    """GPU: the time of `requests` independent forwards ([1, seq] token ids each) issued
    round-robin on `streams` CUDA streams, over the same forwards on one stream (A/B
    interleaved, median of paired ratios). Article B's "multi-stream execution", measured
    with torch's streams rather than inside a TensorRT engine: below 1.0 only where one
    request's kernels leave the GPU idle and the host issues the next ones fast enough."""
    require_cuda()
    m = copy.deepcopy(model).cuda().eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = [torch.randint(vocab, (1, seq), generator=g).cuda() for _ in range(requests)]
    side = [torch.cuda.Stream() for _ in range(streams)]

    def one_stream() -> None:
        for x in ids:
            m(x)

    def many_streams() -> None:
        main = torch.cuda.current_stream()
        for i, x in enumerate(ids):
            stream = side[i % streams]
            stream.wait_stream(main)  # the ids were written on the main stream
            with torch.cuda.stream(stream):
                m(x)
        for stream in side:
            main.wait_stream(stream)

    with torch.inference_mode():
        fns = {"one": one_stream, "many": many_streams}
        return time_ratios(fns, "one", repeats=repeats, warmup=3)["many"]
