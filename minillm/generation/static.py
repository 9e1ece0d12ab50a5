"""A decode step with fixed shapes, so `torch.compile` captures it once and reuses it.

`generate` (chapter 02) lowers `cache.kv_len` to the slots filled so far, so attention
reads a [B, H, 1, n] score matrix whose n grows by one every step. To a compiler that
is a new input shape each step: torch.compile guards on it and recompiles (or, after
the first change, compiles a dynamic-shape graph that is slower to build and to run).

The fix, as in gpt-fast: keep `cache.kv_len == cache.max_len` during decode. Every
step then attends over the whole static buffer and `cache.causal_mask(positions)` hides
the slots past each row's position, so the work per step is constant and every tensor
has the same shape at every step. Positions are tensors, not Python ints, so a new
position is new data for the same graph, never a new guard. The price is attention
over empty slots: negligible while max_len is small next to the weights' size.

Prefill (the prompt, a different T) stays eager; only the per-token step is compiled.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from minillm.cache.contiguous import KVCache
from minillm.generation.cached import decode, prefill
from minillm.generation.sampling import SamplingParams
from minillm.model.transformer import Transformer

StepFn = Callable[[Transformer, KVCache, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_step(
    model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Logits [B, vocab] for one new token per row: tokens and positions are [B, 1].

    Writes the tokens' K/V into `cache` at their positions and attends over all
    `cache.max_len` slots (the causal mask hides the ones not yet written)."""
    return model(tokens, positions, cache=cache)[:, -1]


def naive_decode_step(
    model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The step `generate` takes, written as one function: shrink kv_len to the slots
    filled so far, then run the model. Reading the longest position into a Python int
    is a graph break, and the shape it sets changes every step."""
    cache.kv_len = int(positions.max()) + 1
    return model(tokens, positions, cache=cache)[:, -1]


def compile_frozen(
    fn: Callable[..., Any], mode: str = "max-autotune-no-cudagraphs", **kwargs: Any
) -> Callable[..., Any]:
    """`torch.compile(fn, mode=mode, **kwargs)` (inductor) with the weights frozen: every
    call, and so the compile and any recompile, runs with inductor's `freezing` on (and
    without the timing table max-autotune prints for each matmul it tunes). Call it under
    `torch.inference_mode()` or `no_grad`: freezing applies only without autograd.

    Why a wrapper and not `torch.compile(options={"freezing": True})`: in torch 2.13 that
    option, passed per call, is accepted and has no effect (the weights stay graph inputs;
    measured: the same GEMV speed as eager); freezing is read from the global config."""
    compiled = torch.compile(fn, mode=mode, **kwargs)
    quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}

    def run(*args: Any) -> Any:
        with torch._inductor.config.patch(freezing=True, **quiet):
            return compiled(*args)

    return run


def compile_decode_step(
    mode: str | None = "default",
    fullgraph: bool = True,
    backend: Any = "inductor",
    dynamic: bool | None = False,
    step: StepFn = decode_step,
    freeze: bool = False,
) -> StepFn:
    """`step` compiled with torch.compile (mode=None: `step` itself, eager).

    Modes (inductor backend):
      - "default": fuse elementwise ops into generated kernels (C++/OpenMP on CPU,
        Triton on GPU); matmuls stay library calls (oneDNN/MKL, cuBLAS).
      - "reduce-overhead": on CUDA also records the step as a CUDA graph, replaying
        all kernels with one launch; on CPU there are no CUDA graphs, so it is the
        same as "default".
      - "max-autotune-no-cudagraphs": benchmark alternative kernels (matmul templates,
        tile sizes) at compile time and keep the fastest; much longer compile. On CPU
        it can pick C++ GEMM templates over the library call.
    `fullgraph=True` turns any graph break into an error rather than a silent split.
    `dynamic=False` compiles for exact shapes (a new shape: a recompile). `backend` may
    be "eager"/"aot_eager" or a callable (e.g. `CompileCounter`) to study capture
    without paying for code generation; `mode` then must be "default".

    `freeze=True` (inductor only; the first call must run under `torch.inference_mode()`
    or `no_grad`) treats the model's weights as constants of the graph (inductor's
    "freezing"): it may re-lay them out once at compile time, keeping a second copy, and
    must not see them change afterwards (compile again after quantizing or loading new
    weights). What it buys on a CPU: with "max-autotune-no-cudagraphs", inductor can then
    benchmark its own C++ GEMM template against the MKL call and keep the winner. For a
    decode step (one row times each weight: a matrix-vector product) the template, fed
    weights it packed itself, streams them much faster than MKL reads PyTorch's layout
    (`benchmarks/kv_cache.py` part (d) measures both on SmolLM2). See `compile_frozen`.
    """
    if mode is None:
        return step
    kwargs: dict[str, Any] = dict(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
    if freeze:
        if backend != "inductor":
            raise ValueError(f"freeze=True is an inductor option, got backend={backend!r}")
        return compile_frozen(step, mode, fullgraph=fullgraph, dynamic=dynamic)
    if mode != "default":
        kwargs["mode"] = mode
    return torch.compile(step, **kwargs)


class CompileCounter:
    """A torch.compile backend that counts the graphs dynamo hands it (a first
    compile, each recompile and each piece of a broken graph), then runs them with
    `backend` ("eager": as captured; "inductor": generated code). To see *why* a
    recompile happened (which guard failed): `torch._logging.set_logs(recompiles=True)`
    or the environment variable TORCH_LOGS=recompiles."""

    def __init__(self, backend: str = "eager") -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.graphs += 1
        return self.backend(gm, example_inputs)


_RECOMPILES = "torch._dynamo.guards.__recompiles"  # the logger behind TORCH_LOGS=recompiles


@contextmanager
def recorded_recompiles() -> Iterator[list[str]]:
    """Collect why dynamo recompiled, one line per recompile, instead of printing its log.

    `torch._logging.set_logs(recompiles=True)` prints a multi-line record per recompile
    (the failed guards, then the user stack). Here each record becomes one line: the first
    guard that failed and where the guarded value was read, e.g. `cache.kv_len == 17 (read
    in minillm/cache/contiguous.py:93 in causal_mask)`. Nothing reaches stderr, and the
    logging levels in force before are restored after."""
    reasons: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(_first_guard(record.getMessage()))

    dynamo = logging.getLogger("torch._dynamo")
    level, logger, handler = dynamo.level, logging.getLogger(_RECOMPILES), _Keep()
    torch._logging.set_logs(recompiles=True)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        torch._logging.set_logs()  # back to torch's defaults, then to the caller's level
        dynamo.setLevel(level)


def _first_guard(message: str) -> str:
    """`cache.kv_len == 17 (read in minillm/...:93 in causal_mask)` from a recompile record."""
    for line in message.splitlines():
        m = re.match(r"\s*- \d+/\d+: (.*)", line)
        if m:
            guard, _, source = m.group(1).partition("#")
            where = source.rsplit("#", 1)[-1].strip()
            where = where[where.find("minillm/") :] if "minillm/" in where else where
            return f"{guard.strip()} (read in {where})" if where else guard.strip()
    return message.splitlines()[0] if message else ""


@dataclass
class Explained:
    """What dynamo captured from one call: graphs, and why it split between them."""

    graph_count: int
    graph_break_count: int
    break_reasons: list[str]
    op_count: int


def explain_step(step: StepFn, *args: Any) -> Explained:
    """Run `step(*args)` under `torch._dynamo.explain` and summarize what it captured."""
    out = torch._dynamo.explain(step)(*args)
    return Explained(
        graph_count=out.graph_count,
        graph_break_count=out.graph_break_count,
        break_reasons=[r.reason.splitlines()[0] for r in out.break_reasons],
        op_count=out.op_count,
    )


@torch.inference_mode()
def generate_static(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    compiled: bool | StepFn = True,
    mode: str | None = "default",
) -> list[list[int]]:
    """`generate` with an eager prefill and a fixed-shape decode step.

    `compiled`: True compiles `decode_step` with `mode` (a new compile per call: pass
    the result of `compile_decode_step` to reuse one), False runs it eagerly, and a
    callable is used as the step."""
    if callable(compiled):
        step = compiled
    else:
        step = compile_decode_step(mode if compiled else None)
    cache, logits, positions = prefill(model, prompts, params.max_tokens)
    cache.kv_len = cache.max_len  # from here on: fixed shapes
    return decode(model, cache, logits, positions, params, step, prompts=prompts)
