"""In-process backends (transformers eager and compiled, ONNX Runtime, TensorRT, the minillm
engine), the names of server engines, and `make_backend` for every spec."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.bench.metrics import Trace
from minillm.bench.workload import Request

IN_PROCESS = ["hf", "hf-compile", "ort", "tensorrt", "minillm"]
SERVERS = {  # engines that run as a server: how to start one and point the harness at it
    "vllm": "vllm serve MODEL --port 8000, then openai:http://127.0.0.1:8000/v1",
    "sglang": "python -m sglang.launch_server --model-path MODEL --port 30000, then "
    "openai:http://127.0.0.1:30000/v1",
    "tgi": "docker run ghcr.io/huggingface/text-generation-inference --model-id MODEL "
    "(port 80 mapped to 8080), then openai-chat:http://127.0.0.1:8080/v1",
    "llama.cpp": "python -m minillm.export.gguf MODEL.gguf; python -m llama_cpp.server --model "
    "MODEL.gguf --port 8080 --interrupt_requests False, then openai-text:http://127.0.0.1:8080/v1",
}
ALL = [*IN_PROCESS, *SERVERS]
OPENAI_PREFIXES = ("openai:", "openai-text:", "openai-chat:")  # token ids, text, chat
CONTEXT = 2048  # hf-compile's static cache: the longest request (prompt + output) it takes
POOL_TOKENS = 16384  # the engine's KV pool: e.g. 8 requests of 2048 tokens, 32 of 512
OPT_IN = {
    "hf-compile": "opt-in (compiling takes tens of seconds to minutes on a CPU): "
    "name it in --backends"
}


class Unavailable(Exception):
    """This backend cannot run here; the message says why and what would make it run."""


class Backend:
    """Loads a model, then runs requests one at a time reporting each token's arrival.

    A subclass defines `run_one(req, on_token) -> tokens` (greedy, calling on_token as each
    token exists) for the one-at-a-time `run_all` below, or overrides `run_all` itself."""

    concurrent = False  # True: run_all serves several requests at once
    measures_memory = True

    def __init__(self, spec: str, model_path: str | None, device: str, threads: int) -> None:
        self.spec, self.model_path, self.device, self.threads = spec, model_path, device, threads

    def load(self) -> None:
        """Build what the backend needs (model, session, connection); raise Unavailable."""

    def run_all(self, requests: list[Request], concurrency: int, bar: Any) -> list[Trace]:
        traces = []
        for req in requests:
            trace = Trace(time.perf_counter())
            stamp = trace.token_times.append
            trace.tokens = self.run_one(req, lambda stamp=stamp: stamp(time.perf_counter()))
            trace.end, trace.num_tokens = time.perf_counter(), len(trace.tokens)
            traces.append(trace)
            bar.update()
        return traces


class _TimedStreamer:
    """transformers streamer: skips the prompt, calls on_token for each generated token."""

    def __init__(self, on_token: Callable[[], None]) -> None:
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.on_token()
        self.prompt_seen = True

    def end(self) -> None:
        pass


class HFBackend(Backend):
    """transformers `generate`, eager; `hf-compile`: a static cache of the full context and a
    compiled forward, warmed up on three prompt lengths in `load` (so `load_s` includes the
    compiles: the first shape, then dynamo's recompiles with dynamic lengths)."""

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, StaticCache

        from minillm.model.weights import resolve_model_dir

        path = resolve_model_dir(self.model_path)  # None: bundled; a name such as smollm2
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model = self.model.to(self.device).eval()
        self.cache = None
        if self.spec == "hf-compile":
            context = min(self.model.config.max_position_embeddings, CONTEXT)
            self.cache = StaticCache(config=self.model.config, max_cache_len=context)
            self.model.forward = torch.compile(self.model.forward)
            for n in (2, 3, 4):
                self.run_one(Request(list(range(1, n + 1)), 2), lambda: None)

    @torch.inference_mode()
    def run_one(self, req: Request, on_token: Callable[[], None]) -> list[int]:
        ids = torch.tensor([req.prompt_ids], device=self.device)
        if self.cache is not None:
            self.cache.reset()  # one cache, fixed shapes: no recompiles between requests
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=req.max_tokens,
            min_new_tokens=req.max_tokens,  # EOS ignored
            do_sample=False,
            streamer=_TimedStreamer(on_token),
            pad_token_id=0,
            past_key_values=self.cache,
        )
        return out[0, ids.shape[1] :].tolist()


class OrtBackend(Backend):
    """Chapter 03: the decoder-step ONNX graph on ONNX Runtime (CPU provider), batch 1."""

    def load(self) -> None:
        from minillm.export.onnx import export_decoder_step
        from minillm.export.onnx_runtime import OrtDecoder, ort_session
        from minillm.model.weights import load_model

        if self.device != "cpu":
            raise Unavailable("the harness runs ORT on its CPU provider: use --device cpu")
        self.tmp = tempfile.TemporaryDirectory()
        path = export_decoder_step(load_model(self.model_path), Path(self.tmp.name) / "step.onnx")
        self.decoder = OrtDecoder(ort_session(path, threads=self.threads))

    def run_one(self, req: Request, on_token: Callable[[], None]) -> list[int]:
        d = self.decoder
        logits, positions, mask, past = d.prefill([req.prompt_ids])
        out: list[int] = []
        while True:
            token = int(logits[0].argmax())
            out.append(token)
            on_token()
            if len(out) == req.max_tokens:
                return out
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            step, past = d.step(np.array([[token]]), positions[:, None], mask, past)
            logits, positions = step[:, -1], positions + 1


def greedy_without_cache(
    forward: Callable[[torch.Tensor], torch.Tensor],
    req: Request,
    on_token: Callable[[], None],
    device: str,
) -> list[int]:
    """Greedy tokens from a forward of ids [1, T] -> logits [1, T, vocab] with no KV cache:
    every token re-runs the whole sequence (what an engine of the plain forward can do)."""
    ids = torch.tensor([req.prompt_ids], device=device)
    out: list[int] = []
    for _ in range(req.max_tokens):
        token = forward(ids)[0, -1].argmax()
        out.append(int(token))
        on_token()
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return out


class TensorRTBackend(Backend):
    """Chapter 04's torch-tensorrt fp16 engine of the plain forward (NVIDIA only), profile
    batch 1, sequence 1..context. It has no KV cache, so every token re-runs the sequence:
    it measures the engine's kernels, not cache management (TensorRT-LLM adds that)."""

    def load(self) -> None:
        if not torch.cuda.is_available():
            raise Unavailable("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        from minillm.export.tensorrt import compile_tensorrt, llm_profile, require_torch_tensorrt
        from minillm.model.weights import load_model

        try:
            require_torch_tensorrt()
        except (RuntimeError, ImportError) as err:
            raise Unavailable(str(err)) from None
        model = load_model(self.model_path)
        context = model.config.max_position_embeddings
        self.forward = compile_tensorrt(model, llm_profile(context, max_batch=1, opt_batch=1))

    @torch.inference_mode()
    def run_one(self, req: Request, on_token: Callable[[], None]) -> list[int]:
        return greedy_without_cache(self.forward, req, on_token, "cuda")


class EngineBackend(Backend):
    """Chapter 08's continuous-batching engine, in process, as `python -m minillm serve
    --num-blocks 1024` runs it: its KV pool holds `POOL_TOKENS` tokens (the engine's default,
    32 sequences of the full context, would be 11 GiB of fp32 K/V for SmolLM2's 8k context,
    allocated up front)."""

    concurrent = True

    def load(self) -> None:
        from minillm.engine import Engine
        from minillm.model.weights import load_model, load_tokenizer

        model = load_model(self.model_path, device=self.device)
        blocks = POOL_TOKENS // 16  # blocks of 16 tokens
        self.engine = Engine(model, load_tokenizer(self.model_path), num_blocks=blocks)

    def run_all(self, requests: list[Request], concurrency: int, bar: Any) -> list[Trace]:
        from minillm.engine import SamplingParams

        engine, pending, done = self.engine, list(enumerate(requests)), {}
        running: dict[str, int] = {}
        while pending or running:
            while pending and len(running) < concurrency:
                i, req = pending.pop(0)
                params = SamplingParams(
                    temperature=0,
                    max_tokens=req.max_tokens,
                    ignore_eos=True,
                    output_kind="final_only",  # the metrics carry the token times
                )
                running[engine.add_request(req.prompt_ids, params)] = i
            for out in engine.step():
                if out.finished:
                    m, toks = out.metrics, out.outputs[0].token_ids
                    trace = Trace(m.arrival_time, list(m.token_times), m.finished_time)
                    trace.num_tokens, trace.tokens = len(toks), list(toks)
                    done[running.pop(out.request_id)] = trace
                    bar.update()
        return [done[i] for i in range(len(requests))]
