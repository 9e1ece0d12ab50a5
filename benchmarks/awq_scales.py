"""Chapter 06 benchmark: AWQ's two scale families, compared on training text only.

    python -m benchmarks.awq_scales [--model smollm2] [--group G] [--threads N]
                                    [--json out.json]

`minillm.quant.awq` searches either activation scales s = mean|x|^alpha (the paper's) or
duo scales mean|x|^alpha / mean|w_hat|^(1 - alpha) (AutoAWQ's). Which one is the default
is a modelling choice, so it is made here on KJV *training* text, never on the held-out
text `quant_methods` scores: both families are fitted on `calibration_batches` (4 x 4 x
256 tokens, as `quant_methods`), and the perplexity of fp32, round-to-nearest and each
AWQ model is measured on those fitted tokens and on as many other training pieces, each
halfway between two calibration pieces (text the search never saw). The figure of merit
is the share of round-to-nearest's perplexity loss each family wins back.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.quant_decode import group_size_for
from minillm import load_model, load_tokenizer
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--group", type=int, default=None, help="int4 group size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = None if args.model == "bundled" else args.model
    base, tok = load_model(name), load_tokenizer(name)
    scheme = f"int4-g{args.group or group_size_for(base)}"
    batches = calibration_batches(tok, n_batches=4, batch_size=4, seq_len=SEQ)
    texts = {"fitted": torch.cat(batches), "unseen": other_training_pieces(tok)}
    builds = {"fp32": lambda m: m, "RTN": lambda m: quantize_model(m, scheme)}
    for family in SCALES:
        builds[f"AWQ {family}"] = lambda m, f=family: awq_quantize_model(
            m, batches, scheme, scales=f
        )
    ppl: dict[str, dict[str, float]] = {}
    for label, build in builds.items():
        model = build(copy.deepcopy(base))
        ppl[label] = {text: perplexity_of(model, ids) for text, ids in texts.items()}
        print(f"  {label:<10}" + "".join(f"{t} {p:8.3f}   " for t, p in ppl[label].items()))
    recovered = {
        f"AWQ {f}": {
            t: (ppl["RTN"][t] - ppl[f"AWQ {f}"][t]) / (ppl["RTN"][t] - ppl["fp32"][t])
            for t in texts
        }
        for f in SCALES
    }
    result = {"model": args.model, "scheme": scheme, "perplexity": ppl, "recovered": recovered}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    parts = [
        f"{k} recovers {v['fitted']:.0%} (fitted) / {v['unseen']:.0%} (unseen training text)"
        for k, v in recovered.items()
    ]
    print(f"SUMMARY awq_scales {args.model} {scheme}: " + "; ".join(parts))
    return result


if __name__ == "__main__":
    main()
