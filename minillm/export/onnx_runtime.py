"""Run exported graphs with ONNX Runtime (chapter 03): sessions at each optimisation
level, a logits function for the evaluators, a generation loop over the decoder-step graph
(`OrtDecoder`), and ORT's dynamic int8 quantization.

The graphs come from `minillm.export.onnx`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.export.onnx import step_names
from minillm.export.quiet import quiet
from minillm.generation.loop import sample_loop
from minillm.generation.sampling import SamplingParams, make_generator
from minillm.lab import cpuinfo_fields

LEVELS = ("disable", "basic", "extended", "all")  # ORT graph optimisation levels, in order
# The graph transformers that turn Q/DQ pairs around a MatMul into ORT's int8 kernels.
QDQ_FUSIONS = ("QDQS8ToU8Transformer", "QDQSelectorActionTransformer")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products into int32


def int8_gemm_saturates(cpuinfo: str | None = None) -> bool:
    """Whether ORT's fused int8 GEMMs can come out wrong on this CPU.

    On x86-64 without VNNI (AVX2, or AVX512 without VNNI) MLAS multiplies u8 activations
    (ORT shifts int8 ones by 128) by s8 weights with `vpmaddubsw`, which adds each pair of
    products into int16 and saturates: 255 * 127 * 2 > 32767, so a GEMM whose inputs and
    weights are both large loses part of its sum. VNNI's `vpdpbusd`, AMX and ARM's dot
    products add into int32. Read from `cpuinfo` (default /proc/cpuinfo); an x86 CPU whose
    flags cannot be read is taken to have no VNNI, the common case."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    fields = cpuinfo_fields(cpuinfo)
    if fields is None:
        return True
    return not set(fields.get("flags", "").split()) & set(VNNI_FLAGS)


def qdq_session(path: str | Path | bytes, level: str = "all", threads: int = 1) -> Any:
    """A session that computes what a Q/DQ graph means (quantize, dequantize, fp32 matmul)
    on any CPU: where `int8_gemm_saturates`, ORT's Q/DQ fusions into int8 kernels are
    switched off (the rest of `level` still runs); elsewhere ORT runs its int8 kernels,
    which then compute the same numbers up to fp32 rounding."""
    off = QDQ_FUSIONS if int8_gemm_saturates() else ()
    return ort_session(path, level, threads, disabled_optimizers=off)


def ort_session(
    path: str | Path | bytes,
    level: str = "all",
    threads: int = 1,
    optimized_path: str | Path | None = None,
    disabled_optimizers: Sequence[str] = (),
) -> Any:
    """A CPU InferenceSession of the graph at `path` (or its serialized bytes) at graph
    optimisation `level` (disable / basic / extended / all), `threads` intra-op threads;
    `optimized_path` saves the optimised graph."""
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if level not in levels:
        raise ValueError(f"level={level!r}: use one of {', '.join(LEVELS)}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[level]
    opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    opts.log_severity_level = 3  # errors only
    if optimized_path is not None:
        opts.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(
        path if isinstance(path, bytes) else str(path),
        opts,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(disabled_optimizers),
    )


def ort_logits_fn(session: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [B, T] -> logits [B, T, vocab] through a session of either graph (a decoder
    step runs as a prefill: empty past, no padding), for `minillm.training.evaluate.perplexity`
    / `next_token_agreement`."""
    is_step = any(i.name == "attention_mask" for i in session.get_inputs())
    decoder = OrtDecoder(session) if is_step else None

    def logits(ids: torch.Tensor) -> torch.Tensor:
        x = ids.cpu().numpy().astype(np.int64)
        if decoder is None:
            return torch.from_numpy(session.run(["logits"], {"input_ids": x})[0])
        mask = np.ones_like(x)
        out, _ = decoder.step(x, mask.cumsum(1) - 1, mask, decoder.empty_past(len(x)))
        return torch.from_numpy(out)

    return logits


def graph_metadata(session: Any) -> dict[str, Any]:
    """The `minillm.*` entries `add_metadata` stored in the graph (eos_token_id, ...)."""
    import ast

    props = session.get_modelmeta().custom_metadata_map
    return {
        k.removeprefix("minillm."): ast.literal_eval(v)
        for k, v in props.items()
        if k.startswith("minillm.")
    }


class OrtDecoder:
    """Generation on ONNX Runtime with a decoder-step graph: the K/V tensors live in
    numpy arrays the loop carries from one `run` to the next.

    Prompts of different lengths are left-padded: every row's last prompt token sits
    in the last slot, padding slots are masked by `attention_mask`, and each row's
    positions count only its real tokens, so row b sees exactly what it would alone."""

    def __init__(self, session: Any, eos_token_id: int | list[int] | None = None) -> None:
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.num_layers = sum(name.startswith("past_key_") for name in inputs)
        if "attention_mask" not in inputs or self.num_layers == 0:
            raise ValueError(
                "not a decoder-step graph (needs attention_mask and past_key_i inputs): "
                "export it with export_decoder_step"
            )
        _, kv_heads, _, head_dim = inputs["past_key_0"].shape
        self.kv_heads, self.head_dim = int(kv_heads), int(head_dim)
        meta = graph_metadata(session)
        self.eos = eos_token_id if eos_token_id is not None else meta.get("eos_token_id")
        self.max_positions = meta.get("max_position_embeddings")
        self.dtype = np.float16 if "float16" in inputs["past_key_0"].type else np.float32

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """Past K/V with 0 slots for every layer (key, value, key, value, ...)."""
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return [np.zeros(shape, self.dtype) for _ in range(2 * self.num_layers)]

    def step(
        self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One graph run: logits [B, T, vocab] and the presents (next step's pasts)."""
        names, _ = step_names(self.num_layers)
        feed = dict(zip(names, [ids, positions, mask, *past], strict=True))
        logits, *presents = self.session.run(None, feed)
        return logits, presents

    def prefill(
        self, prompts: list[list[int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """Left-pad and run the prompts: (last logits [B, vocab], next positions [B],
        attention mask [B, longest], presents)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: give at least one token per prompt")
        longest = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), longest), np.int64)
        mask = np.zeros((len(prompts), longest), np.int64)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p) :], mask[b, longest - len(p) :] = p, 1
        positions = np.maximum(mask.cumsum(1) - 1, 0)
        logits, past = self.step(ids, positions, mask, self.empty_past(len(prompts)))
        return logits[:, -1], positions[:, -1] + 1, mask, past

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generated ids per prompt, as `minillm.generation.cached` samples them: greedy, or each
        row from its own RNG seeded with `params.seed`; stops at EOS / stop tokens."""
        longest = max((len(p) for p in prompts), default=0)
        if self.max_positions is not None and longest + params.max_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({longest} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_positions} positions"
            )
        logits, positions, mask, past = self.prefill(prompts)
        eos = [] if self.eos is None or params.ignore_eos else self.eos
        stops = {*([eos] if isinstance(eos, int) else eos), *params.stop_token_ids}
        generators = [make_generator(params.seed) for _ in prompts]

        def step(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal mask, past, positions
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
            step_logits, past = self.step(tokens.numpy()[:, None], positions[:, None], mask, past)
            positions = positions + 1
            return torch.from_numpy(step_logits[:, -1])

        first = torch.from_numpy(logits)
        return sample_loop(first, params, step, stops, generators, prompts=prompts)


def quantize_int8(src: str | Path, dst: str | Path, per_channel: bool = False) -> Path:
    """ORT dynamic quantization: MatMul weights stored as int8 (per tensor, or per output
    channel), activations quantized on the fly at each call. Returns `dst`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=per_channel)
    return Path(dst)
