"""ONNX Runtime GenAI (`onnxruntime-genai`, PyPI), the production reference for chapter 03:
Microsoft's model builder turns a Hugging Face directory into an ONNX graph with ORT's own
fused ops (GroupQueryAttention, MatMulNBits for int4, SkipSimplifiedLayerNorm), and its
generator runs the loop in C++ with the K/V cache shared between past and present
(`past_present_share_buffer`), which is what `OrtStaticDecoder` builds by hand.

Optional: every entry point says how to install it when it is missing. 0.18.0 installs
against this course's onnxruntime 1.32 (it needs onnxruntime >= 1.31) without pulling any
other package: `pip install onnxruntime-genai==0.18.0`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

INSTALL = "pip install onnxruntime-genai==0.18.0"
PRECISIONS = ("fp32", "fp16", "int4")


def genai_missing() -> str | None:
    """Why ORT GenAI cannot be used here (None: it can)."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return f"onnxruntime-genai is not installed: {INSTALL}"
    return None


def _og() -> Any:
    reason = genai_missing()
    if reason is not None:
        raise ModuleNotFoundError(reason)
    import onnxruntime_genai

    return onnxruntime_genai


def build_genai_model(
    hf_dir: str | Path, out_dir: str | Path, precision: str = "fp32", cache_dir: str | Path = ""
) -> Path:
    """Run ORT GenAI's model builder on a Hugging Face checkpoint directory for the CPU:
    'fp32', or 'int4' (MatMulNBits: block-wise int4 weights, ORT's own kernel)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    _og()
    out_dir = Path(out_dir)
    cache = Path(cache_dir) if cache_dir else out_dir / "cache"
    hf = str(Path(hf_dir).resolve())
    # The builder's documented interface is its command line (its Python entry point
    # expects options pre-parsed by CLI helpers). Same interpreter, same import path.
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf, "-i", hf]
    cmd += ["-o", str(out_dir), "-p", precision, "-e", "cpu", "-c", str(cache)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ORT GenAI's model builder failed on {hf}:\n{done.stderr[-2000:]}")
    return out_dir


class GenaiDecoder:
    """An ORT GenAI model driven with token ids (the course's tokenizer stays in charge)."""

    def __init__(self, model_dir: str | Path, threads: int = 1) -> None:
        """`threads`: ORT's intra-op threads, set here as every minillm session sets them
        (the builder's config leaves it to ORT's default, which depends on the machine)."""
        og = _og()
        config = og.Config(str(model_dir))
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.og, self.model = og, og.Model(config)

    def generator(self, ids: list[int], max_length: int) -> Any:
        """A greedy generator that has read the prompt `ids`."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.asarray([ids], dtype=np.int32))
        return gen

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt (one generator per prompt), EOS not ignored
        (GenAI stops at the config's eos_token_id)."""
        out = []
        for ids in prompts:
            gen = self.generator(ids, len(ids) + max_tokens)
            while not gen.is_done():
                gen.generate_next_token()
            out.append([int(t) for t in gen.get_sequence(0)[len(ids) :]])
        return out

    def logits_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """ids [B, T] -> logits [B, T, vocab] (the prefill's logits of every row), for
        `minillm.training.evaluate.perplexity`."""

        def logits(ids: torch.Tensor) -> torch.Tensor:
            rows = []
            for row in ids.tolist():
                gen = self.generator(row, len(row))
                rows.append(torch.from_numpy(np.array(gen.get_output("logits"))[0]))
            return torch.stack(rows).float()

        return logits
