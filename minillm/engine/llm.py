"""vLLM's offline API on minillm: `LLM(model=None).generate(prompts, SamplingParams(...))`.

Code written for vLLM's basic usage runs by changing the import:

    from minillm import LLM, SamplingParams
    llm = LLM()  # the bundled model; or LLM(model="path/or/hub-id")
    for out in llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20)):
        print(out.prompt, out.outputs[0].text, out.outputs[0].finish_reason)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import Engine, final_only
from minillm.engine.outputs import RequestOutput
from minillm.engine.parallel import PipelineParallel, TensorParallel
from minillm.generation.sampling import SamplingParams
from minillm.model.layout import matvec_applies, use_matvec
from minillm.model.tokenizer import Tokenizer
from minillm.model.weights import (
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)

Prompt = str | list[int] | dict


class LLM:
    """A model and an engine; `generate` runs a list of prompts to completion.

    vLLM's engine-level arguments do what they do there; every keyword beyond the first
    seven is an `EngineConfig` setting (`minillm.engine.config`, vLLM's names accepted),
    checked before the weights load:

    - `seed`: the engine's RNG; requests without a seed of their own draw one from it in
      arrival order, so the same prompts give the same samples run after run (a request's
      own `SamplingParams(seed=...)` still wins). None: unseeded requests differ each run.
    - `gpu_memory_utilization`: the KV pool is sized from this fraction of memory, after the
      weights and a profiled forward of `max_num_batched_tokens` tokens
      (`minillm.engine.memory`; on a CPU a documented rule). `num_blocks` (or vLLM's
      `num_gpu_blocks_override`) sets the pool's size instead.
    - `max_num_batched_tokens`: the scheduler's token budget per step; `max_num_seqs`: the
      most sequences running at once.
    - `tensor_parallel_size`: the model is split across that many processes (ranks),
      each holding 1/N of every layer (`minillm.engine.parallel`); the tokens are the same.
    - `pipeline_parallel_size`: the layers are split across that many processes, each
      holding consecutive layers, with that many steps in flight. One of the two sizes may
      be above 1. Call `close()` to stop the ranks.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        seed: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        **settings: Any,
    ) -> None:
        config = EngineConfig.of(
            seed=seed, gpu_memory_utilization=gpu_memory_utilization, **settings
        )
        self.model_name = model or "minillm-bundled"
        self.tokenizer = load_tokenizer(model)
        # dtype "auto": bf16 (T4: fp16) on a GPU, fp32 on a CPU (vLLM reads the checkpoint)
        self.engine = build_engine(
            model, dtype, device or "auto", self.tokenizer, config,
            tensor_parallel_size, pipeline_parallel_size,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the parallel ranks (nothing to do on one device)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order. A prompt is a string, a
        list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]} as in vLLM."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one "
                "per prompt"
            )
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(_unwrap(prompt), final_only(sp)))
        except ValueError:  # one bad prompt: queue none of them
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        start, n_in, n_out = time.perf_counter(), 0, 0
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                            f"output: {n_out / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        finally:
            bar.close()
            for request_id in ids:  # interrupted: leave nothing queued
                if request_id not in done:
                    self.engine.abort(request_id)
        return [done[r] for r in ids]


def build_engine(
    model: str | None,
    dtype: str | torch.dtype,
    device: str,
    tokenizer: Tokenizer,
    config: EngineConfig,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> Engine:
    """An engine over the whole checkpoint on one device, or over rank 0's part with the
    ranks holding the others (a size above 1; they stop if the engine fails to start)."""
    sizes = {"tensor": tensor_parallel_size, "pipeline": pipeline_parallel_size}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}_parallel_size={size!r} must be an integer >= 1")
    if tensor_parallel_size > 1 and pipeline_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} with pipeline_parallel_size="
            f"{pipeline_parallel_size}: minillm splits a model one way at a time, so set one "
            "of them to 1"
        )
    if tensor_parallel_size == pipeline_parallel_size == 1:
        loaded = load_model(model, dtype=dtype, device=device)
        if matvec_applies(loaded):  # fp32 on a CPU: decode steps through the C kernel
            use_matvec(loaded)
        return Engine(loaded, tokenizer, config)
    on = resolve_device(device)
    model_dir = resolve_model_dir(model)
    kind = TensorParallel if tensor_parallel_size > 1 else PipelineParallel
    size = max(tensor_parallel_size, pipeline_parallel_size)
    parallel = kind(model_dir, size, resolve_dtype(dtype, on), on.type)
    try:
        return Engine(parallel.model, tokenizer, config, parallel=parallel)
    except BaseException:
        parallel.close()
        raise


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return prompt
