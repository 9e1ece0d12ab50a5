"""IOBinding with the K/V cache as one buffer per layer, bound as both the past input and
the present output (chapter 03): what the static-cache graph (`onnx_static`) and the
GroupQueryAttention graph (`onnx_gqa`) are decoded with. Each graph feeds its own small
inputs (a decoder's `prefill` and `step`); the binding, the buffers and the sampling loop
are shared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from minillm.export.onnx_runtime import graph_metadata
from minillm.generation.loop import sample_loop
from minillm.generation.sampling import SamplingParams, make_generator


def kv_names(num_layers: int) -> list[str]:
    """key_0, value_0, key_1, ...: each layer's cache tensors, `past_` in and `present_` out."""
    return [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


class SharedBufferDecoder(ABC):
    """Generation with IOBinding on a graph whose past and present K/V are one buffer:
    `max_len` slots per row allocated once, each bound as both the past input and the
    present output of its layer. Subclasses say how a graph is fed (`prefill`)."""

    GRAPH_INPUT = ""  # the input that tells this decoder's graphs from the others
    EXPORTER = ""  # the function that exports them

    def __init__(self, session: Any, max_len: int, eos_token_id: int | None = None) -> None:
        inputs = {i.name: i for i in session.get_inputs()}
        if self.GRAPH_INPUT not in inputs:
            raise ValueError(
                f"not a graph for {type(self).__name__} (no {self.GRAPH_INPUT} input): "
                f"export it with {self.EXPORTER}"
            )
        self.session, self.max_len = session, max_len
        self.num_layers = sum(name.startswith("past_key_") for name in inputs)
        _, kv_heads, _, head_dim = inputs["past_key_0"].shape
        self.kv_shape = (int(kv_heads), int(head_dim))
        eos = (
            eos_token_id
            if eos_token_id is not None
            else graph_metadata(session).get("eos_token_id")
        )
        self.eos = eos
        self.buffers: list[np.ndarray] = []
        self.binding: Any = None

    def allocate(self, batch: int) -> None:
        """Zeroed K/V buffers for `batch` rows, bound as past and present of every layer."""
        h, d = self.kv_shape
        self.buffers = [
            np.zeros((batch, h, self.max_len, d), np.float32) for _ in range(2 * self.num_layers)
        ]
        import onnxruntime as ort

        self.binding = self.session.io_binding()
        self.binding.bind_output("logits")  # first: get_outputs() lists in binding order
        for buf, name in zip(self.buffers, kv_names(self.num_layers), strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            self.binding.bind_ortvalue_input(f"past_{name}", value)
            self.binding.bind_ortvalue_output(f"present_{name}", value)

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """One run with these small inputs bound (the cache stays bound): logits [B, T, vocab]."""
        b = self.binding
        if b is None:
            raise RuntimeError("no cache buffers bound yet: call allocate(batch) first")
        for name, value in feeds.items():
            b.bind_cpu_input(name, value)
        b.bind_output("logits")  # unallocated: ORT sizes it per run (prefill, then decode)
        self.session.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()

    @abstractmethod
    def prefill(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Run the prompts into the allocated cache; return each row's last logits
        [B, vocab] and the step the sampling loop calls with each row's new token [B]."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """As `OrtDecoder.generate` (same sampling), on the shared cache buffers."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: give at least one token per prompt")
        longest = max(len(p) for p in prompts)
        if longest + params.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({longest}) + max_tokens ({params.max_tokens}) exceeds the cache's "
                f"{self.max_len} slots: build the decoder with a larger max_len"
            )
        self.allocate(len(prompts))
        logits, step = self.prefill(prompts)
        eos = [] if self.eos is None or params.ignore_eos else self.eos
        stops = {*([eos] if isinstance(eos, int) else eos), *params.stop_token_ids}
        generators = [make_generator(params.seed) for _ in prompts]
        return sample_loop(logits, params, step, stops, generators)
