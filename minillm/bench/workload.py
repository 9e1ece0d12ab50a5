"""Benchmark workloads: seeded (prompt ids, output length) requests, named or given as JSON."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 0
WORKLOADS = {
    "tiny": {"n": 3, "prompt_len": [4, 12], "output_median": 6, "output_clip": [2, 8]},
    "small": {"n": 16, "output_median": 24, "output_clip": [4, 64]},
    "serving": {"n": 128},  # benchmarks/serving.py's workload
}


@dataclass
class Request:
    """One request: prompt ids (and their text, for text-only servers), output length."""

    prompt_ids: list[int]
    max_tokens: int
    prompt_text: str = ""


def make_workload(
    tokenizer: Any,
    n: int = 128,
    seed: int = SEED,
    prompt_len: tuple[int, int] | list[int] = (8, 64),
    output_median: float = 32,
    output_sigma: float = 0.8,
    output_clip: tuple[int, int] | list[int] = (4, 160),
) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, seeded: prompts of uniform length in `prompt_len`
    cut from held-out text, output lengths log-normal (median, sigma) clipped to `output_clip`."""
    from minillm.training.evaluate import held_out_ids

    rng = random.Random(seed)
    text = held_out_ids(tokenizer).tolist()
    work = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(len(text) - length)
        out = round(math.exp(rng.gauss(math.log(output_median), output_sigma)))
        work.append((text[start : start + length], min(max(out, output_clip[0]), output_clip[1])))
    return work


def load_workload(spec: str | dict, tokenizer: Any) -> tuple[dict, list[Request]]:
    """(description, requests) from a name in WORKLOADS, a JSON string or a .json path."""
    if isinstance(spec, str) and spec in WORKLOADS:
        desc = {"name": spec, **WORKLOADS[spec]}
    elif isinstance(spec, dict):
        desc = dict(spec)
    elif spec.endswith(".json") and Path(spec).is_file():
        desc = json.loads(Path(spec).read_text())
    else:
        try:
            desc = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(
                f"workload {spec!r}: use one of {', '.join(WORKLOADS)}, a JSON object or a "
                '.json file, e.g. \'{"n": 8, "output_median": 16}\'' + ""
            ) from None
    if "prompts" in desc:
        ids = [tokenizer.encode(p) for p in desc["prompts"]]
        work = [(p, int(desc.get("max_tokens", 16))) for p in ids]
    else:
        known = {"n", "seed", "prompt_len", "output_median", "output_sigma", "output_clip"}
        if unknown := set(desc) - known - {"name"}:
            raise ValueError(f"unknown workload keys {sorted(unknown)}: use {sorted(known)}")
        work = make_workload(tokenizer, **{k: v for k, v in desc.items() if k in known})
    return desc, [Request(p, n, tokenizer.decode(p)) for p, n in work]
