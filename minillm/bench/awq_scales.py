"""Chapter 06's choice of AWQ's default scale family, made on training text only (`python -m
benchmarks.awq_scales`): activation scales (the paper's) against duo scales (AutoAWQ's),
each fitted on `calibration_batches` and scored on those tokens and on other training
pieces the fit never saw, never on the held-out text `quant_methods` scores."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minillm.bench.quant_methods import recovered
from minillm.quant import quantize_model
from minillm.quant.awq import SCALES, awq_quantize_model
from minillm.quant.calibrate import calibration_batches
from minillm.training.data import load_kjv, split_corpus

SEQ, N_SEQS = 256, 16


def other_training_pieces(tokenizer: Any, n: int = N_SEQS, seq_len: int = SEQ) -> torch.Tensor:
    """[n, seq_len] token ids from the training text, each piece starting halfway between
    two of `calibration_batches`' pieces (same spacing): training text the fit never saw."""
    train, _ = split_corpus(load_kjv())
    piece = seq_len * 8  # characters, as calibration_batches
    step = (len(train) - piece) // n
    rows = []
    for k in range(n):
        start = k * step + step // 2
        ids = tokenizer.encode(train[start : start + piece], add_special_tokens=False)
        if len(ids) < seq_len:
            raise ValueError(f"training piece {k} has {len(ids)} < {seq_len} tokens")
        rows.append(torch.tensor(ids[:seq_len]))
    return torch.stack(rows)


@torch.inference_mode()
def perplexity_of(model: nn.Module, ids: torch.Tensor, batch: int = 4) -> float:
    """Perplexity of each row's tokens 1.. given the ones before (no window crosses rows)."""
    nll = 0.0
    for i in range(0, len(ids), batch):
        x = ids[i : i + batch]
        logits = model(x[:, :-1]).float()
        nll += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    return math.exp(nll / (len(ids) * (ids.shape[1] - 1)))


def compare_families(base: nn.Module, tokenizer: Any, scheme: str) -> dict[str, Any]:
    """Perplexity of fp32, round-to-nearest and AWQ with each scale family (`SCALES`) on the
    fitted and the unseen training text, printed as each model is scored, and the share of
    round-to-nearest's perplexity loss each family wins back on each text."""
    batches = calibration_batches(tokenizer, n_batches=4, batch_size=4, seq_len=SEQ)
    texts = {"fitted": torch.cat(batches), "unseen": other_training_pieces(tokenizer)}
    builds: dict[str, Callable[[nn.Module], nn.Module]] = {
        "fp32": lambda m: m,
        "RTN": lambda m: quantize_model(m, scheme),
    }
    for family in SCALES:
        builds[f"AWQ {family}"] = lambda m, f=family: awq_quantize_model(
            m, batches, scheme, scales=f
        )
    ppl: dict[str, dict[str, float]] = {}
    for label, build in builds.items():
        model = build(copy.deepcopy(base))
        ppl[label] = {text: perplexity_of(model, ids) for text, ids in texts.items()}
        print(f"  {label:<10}" + "".join(f"{t} {p:8.3f}   " for t, p in ppl[label].items()))
    by_text = {t: {label: {"ppl": p[t]} for label, p in ppl.items()} for t in texts}
    gains = {
        f"AWQ {f}": {t: recovered(by_text[t], f"AWQ {f}", "RTN") for t in texts} for f in SCALES
    }
    return {"perplexity": ppl, "recovered": gains}
