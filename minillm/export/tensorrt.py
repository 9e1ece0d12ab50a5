"""The real TensorRT path (NVIDIA GPU only): torch-tensorrt, and ONNX Runtime's TensorRT and
CUDA execution providers, each compared with eager and compiled PyTorch on the same inputs.

TensorRT builds an *engine* for a range of input shapes: an optimization profile gives each
dynamic input a min, an opt and a max shape; kernels are auto-tuned for opt and valid for
the whole range (a shape outside it is an error at run time). For an LLM the inputs are
token ids [batch, sequence], so a profile is two ranges: batch and sequence length.

The pure parts (profiles, compile settings, provider option dicts) run anywhere and are
tested on CPU; the functions that build engines check for CUDA, torch-tensorrt and
onnxruntime-gpu first and name what is missing.

API notes (torch-tensorrt 2.13, onnxruntime-gpu 1.31): torch-tensorrt's dynamo path types
explicitly (`use_explicit_typing=True` is the default and `enabled_precisions` is
deprecated): to build an fp16 engine, cast the model to fp16 first, as `compile_tensorrt`
does. Token ids are integers: an `Input(..., dtype=torch.float32)` for them, as in
article A's example, is wrong. ORT's TensorRT provider takes its profile as strings,
`"input_ids:1x1"`, one `name:AxB` per input, comma-separated.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TRT_EP, CUDA_EP, CPU_EP = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "CPUExecutionProvider",
)


# ----------------------------------------------------------------- shapes and settings


@dataclass(frozen=True)
class ShapeProfile:
    """min / opt / max shapes of one input, e.g. token ids (batch, sequence)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError(f"min/opt/max must have one rank, got {self.min, self.opt, self.max}")
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if not 1 <= lo <= mid <= hi:
                raise ValueError(
                    f"need 1 <= min <= opt <= max in every dimension, got min={self.min}, "
                    f"opt={self.opt}, max={self.max}"
                )
            if lo < hi and mid < 2:
                # torch.export traces at an example shape and specializes a size of 1.
                raise ValueError(
                    f"a dynamic dimension (min {lo} < max {hi}) needs opt >= 2, got "
                    f"opt={self.opt}: an example of size 1 freezes that axis when traced"
                )

    @property
    def dynamic_dims(self) -> list[int]:
        return [d for d, (lo, hi) in enumerate(zip(self.min, self.max, strict=True)) if lo < hi]

    def covers(self, shape: Sequence[int]) -> bool:
        """Whether an engine built for this profile accepts `shape`."""
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max, strict=True)
        )


def llm_profile(
    max_seq: int, max_batch: int = 8, opt_batch: int = 2, opt_seq: int | None = None
) -> ShapeProfile:
    """Token-id profile for prefill and decode alike: batch 1..max_batch, sequence
    1..max_seq (decode steps have sequence 1), tuned at (opt_batch, opt_seq)."""
    opt_seq = opt_seq if opt_seq is not None else max(2, max_seq // 2)
    return ShapeProfile((1, 1), (opt_batch, opt_seq), (max_batch, max_seq))


def trt_input_spec(profile: ShapeProfile, dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    """Keyword arguments of `torch_tensorrt.Input` for one dynamic input."""
    if dtype.is_floating_point:
        raise ValueError(f"token ids are integers: use torch.int64 or torch.int32, not {dtype}")
    return {
        "min_shape": list(profile.min),
        "opt_shape": list(profile.opt),
        "max_shape": list(profile.max),
        "dtype": dtype,
    }


def trt_compile_settings(
    optimization_level: int = 3, min_block_size: int = 1, workspace_gib: float = 1.0
) -> dict[str, Any]:
    """Keyword arguments of `torch_tensorrt.compile` besides the model and inputs.

    `min_block_size=1` keeps even small runs of ops in TensorRT (default 5 sends them back to
    PyTorch); `optimization_level` 0-5 trades build time for tactic search (auto-tuning)."""
    if not 0 <= optimization_level <= 5:
        raise ValueError(f"optimization_level must be 0..5, got {optimization_level}")
    return {
        "ir": "dynamo",
        "use_explicit_typing": True,  # the engine runs in the dtypes of the model we pass
        "min_block_size": min_block_size,
        "optimization_level": optimization_level,
        "workspace_size": int(workspace_gib * 2**30),
    }


def ort_shape_string(shapes: dict[str, Sequence[int]]) -> str:
    """ORT TensorRT provider's shape syntax: {"input_ids": (1, 8)} -> "input_ids:1x8"."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def ort_trt_options(
    profile: ShapeProfile,
    input_name: str = "input_ids",
    fp16: bool = True,
    cache_dir: str | Path = "trt_engine_cache",
    device_id: int = 0,
) -> dict[str, Any]:
    """Provider options of ORT's TensorrtExecutionProvider: an explicit min/opt/max profile
    (otherwise ORT rebuilds the engine whenever a new shape exceeds the one it built for),
    fp16, and engine + timing caches on disk (a second session loads instead of building)."""
    return {
        "device_id": device_id,
        "trt_fp16_enable": fp16,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": True,
        "trt_profile_min_shapes": ort_shape_string({input_name: profile.min}),
        "trt_profile_opt_shapes": ort_shape_string({input_name: profile.opt}),
        "trt_profile_max_shapes": ort_shape_string({input_name: profile.max}),
    }


def ort_cuda_options(device_id: int = 0) -> dict[str, Any]:
    """Provider options of ORT's CUDAExecutionProvider (the fallback for ops TensorRT lacks)."""
    return {"device_id": device_id, "arena_extend_strategy": "kSameAsRequested"}


def ort_providers(
    kind: str, profile: ShapeProfile | None = None, fp16: bool = True, **trt_kw: Any
) -> list[Any]:
    """The `providers=` list of an InferenceSession: "tensorrt" (TensorRT, then CUDA, then
    CPU for what neither takes) or "cuda" (CUDA, then CPU)."""
    if kind == "tensorrt":
        if profile is None:
            raise ValueError("the TensorRT provider needs a ShapeProfile for dynamic inputs")
        trt = (TRT_EP, ort_trt_options(profile, fp16=fp16, **trt_kw))
        return [trt, (CUDA_EP, ort_cuda_options()), CPU_EP]
    if kind == "cuda":
        return [(CUDA_EP, ort_cuda_options()), CPU_EP]
    raise ValueError(f"unknown provider kind {kind!r}: use 'tensorrt' or 'cuda'")


# ------------------------------------------------------------------ what is available


def gpu_status() -> dict[str, Any]:
    """What this machine offers for the GPU path (nothing is imported that could fail)."""
    status: dict[str, Any] = {
        "cuda": torch.cuda.is_available(),
        "torch_tensorrt": importlib.util.find_spec("torch_tensorrt") is not None,
        "ort_providers": [],
    }
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime as ort

        status["ort_providers"] = ort.get_available_providers()
    return status


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "TensorRT needs an NVIDIA GPU with CUDA: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); run this on a GPU machine with requirements-gpu.txt"
        )


def require_torch_tensorrt() -> Any:
    """Import torch_tensorrt, or say how to get it."""
    require_cuda()
    if importlib.util.find_spec("torch_tensorrt") is None:
        raise RuntimeError(
            "torch_tensorrt is not installed: pip install torch-tensorrt==2.13.0 "
            "(GPU only, matches torch 2.13; see requirements-gpu.txt)"
        )
    import torch_tensorrt

    return torch_tensorrt


def require_ort_provider(provider: str) -> Any:
    """Import onnxruntime and check that it offers `provider`, or say what to install."""
    require_cuda()
    if importlib.util.find_spec("onnxruntime") is None:
        raise RuntimeError("onnxruntime is not installed: pip install onnxruntime-gpu==1.31.*")
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider not in available:
        raise RuntimeError(
            f"onnxruntime {ort.__version__} offers {available}, not {provider}: install "
            "onnxruntime-gpu (not onnxruntime) and, for TensorRT, the tensorrt wheel"
        )
    return ort


# ----------------------------------------------------------------- building engines


class IdsToLogits(nn.Module):
    """input_ids -> logits: the one-input function that engines are built from."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def export_program(model: nn.Module, profile: ShapeProfile) -> torch.export.ExportedProgram:
    """`torch.export` of ids -> logits with the profile's ranges as dynamic dims, traced at
    the opt shape: the first step of `torch_tensorrt.compile(ir="dynamo")`, runnable on CPU.
    A model that does not export here will not build an engine there."""
    if len(profile.min) != 2:
        raise ValueError(f"token ids are [batch, sequence]: got a rank-{len(profile.min)} profile")
    names = ("batch", "sequence")
    dims = {
        d: torch.export.Dim(names[d], min=profile.min[d], max=profile.max[d])
        for d in profile.dynamic_dims
    }
    device = next(model.parameters()).device
    example = torch.zeros(profile.opt, dtype=torch.long, device=device)
    return torch.export.export(IdsToLogits(model).eval(), (example,), dynamic_shapes=(dims,))


def compile_tensorrt(
    model: nn.Module, profile: ShapeProfile, precision: str = "fp16", **settings: Any
) -> nn.Module:
    """A torch-tensorrt engine of `model` (ids -> logits) for the shapes in `profile`, with
    the weights in `precision` (explicit typing). `settings` override trt_compile_settings."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    torch_trt = require_torch_tensorrt()
    graph = IdsToLogits(copy.deepcopy(model)).to("cuda", PRECISIONS[precision]).eval()
    inputs = [torch_trt.Input(**trt_input_spec(profile))]
    with torch.inference_mode():
        return torch_trt.compile(graph, inputs=inputs, **{**trt_compile_settings(), **settings})


def export_onnx(model: nn.Module, path: str | Path) -> Path:
    """ids -> logits as ONNX with dynamic batch and sequence (minillm.export.onnx's forward
    export; an fp32 graph: ORT's TensorRT provider lowers it to fp16 itself)."""
    from minillm.export.onnx import export_forward

    return export_forward(model.float().cpu(), path)


def ort_gpu_session(onnx_path: str | Path, kind: str, profile: ShapeProfile | None = None) -> Any:
    """An InferenceSession on ORT's TensorRT or CUDA provider. ORT silently falls back to
    the next provider when one fails to load: this checks the one asked for is in use."""
    ort = require_ort_provider(TRT_EP if kind == "tensorrt" else CUDA_EP)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), opts, providers=ort_providers(kind, profile))
    wanted = TRT_EP if kind == "tensorrt" else CUDA_EP
    if session.get_providers()[0] != wanted:
        raise RuntimeError(f"{wanted} did not load (ORT fell back to {session.get_providers()})")
    return session


def ort_cuda_fn(session: Any, vocab_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids (a CUDA tensor) -> logits (a CUDA tensor) through `session`, with IO binding:
    ids and logits stay on the GPU, as torch's backends' do, so the timing compares the
    engines, not host copies."""
    import numpy as np

    def run(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.contiguous()
        out = torch.empty((*ids.shape, vocab_size), dtype=torch.float32, device=ids.device)
        binding = session.io_binding()
        binding.bind_input("input_ids", "cuda", 0, np.int64, list(ids.shape), ids.data_ptr())
        binding.bind_output("logits", "cuda", 0, np.float32, list(out.shape), out.data_ptr())
        session.run_with_iobinding(binding)
        return out

    return run


# -------------------------------------------------------------------------- compare
