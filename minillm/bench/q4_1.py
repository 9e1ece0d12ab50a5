"""Chapter 06's Q4_1 caveat (`python -m benchmarks.quant --q4-1`): SmolLM2-135M-Instruct's
published weights went through llama.cpp's Q4_1, so re-quantizing them to a 4-bit g32
format lands near Q4_1's own grid and says little about what 4 bits cost a model. Each
scheme is measured against the dequantized fp32 as the reference."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from minillm.model import Transformer, load_model, load_tokenizer
from minillm.quant.linear import QuantLinear
from minillm.training import factbook_ids, held_out_ids, next_token_agreement, perplexity

Q4_1_SCHEMES = ["q4_1-g32", "int4-g32", "int4sym-g32", "nf4-g32", "int4-g64", "nf4-g64", "int8"]


def requantized_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """One weight matrix through `scheme` and back ('q4_1-g32': llama.cpp's Q4_1 again;
    our `int4-g32` differs in one way: its zero point is an integer code, so that 0 is
    exact, where Q4_1's minimum is any fp16 value)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return QuantLinear(lin, scheme).dequantized_weight()


def requantized(model: Transformer, scheme: str) -> Transformer:
    """A copy of `model` whose linear weights (the LM head / tied embedding kept, as
    `quantize_model` does) went through `scheme` and back: the fp32 weights the quantized
    layers compute with (fake quantization; same numbers as QuantLinear's forward)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in out.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
                mod.weight.copy_(requantized_weight(mod.weight, scheme))
    return out


def q4_1_caveat(
    windows: int = 8, window: int = 512, schemes: list[str] | None = None
) -> dict[str, Any]:
    """SmolLM2-135M-Instruct ships as Q4_1 (`load_model("smollm2")` dequantizes it to fp32),
    so its weights already sit on a 4-bit grid of 32-weight blocks. Re-quantizing them to a
    4-bit g32 format measures how close that format is to Q4_1's grid, not what 4 bits cost
    a model: every scheme here is measured against the dequantized fp32 (the reference), on
    held-out perplexity (CIA World Factbook and KJV, `windows` x `window` tokens each), next-
    token agreement with the reference, and the weights themselves (share left unchanged,
    relative RMS error). The Q8_0 embedding, never on a 4-bit grid, is the control: the
    same scheme's weight error on it is what 4 bits cost weights that are not."""
    ref, tok = load_model("smollm2"), load_tokenizer("smollm2")
    corpora = {"factbook": factbook_ids(tok), "kjv": held_out_ids(tok)}
    kw = {"window": window, "max_windows": windows}
    base = {c: perplexity(ref, ids, **kw) for c, ids in corpora.items()}
    emb = ref.model.embed_tokens.weight.detach()
    rows = [{"scheme": "fp32 (Q4_1 dequantized)", **{f"ppl_{c}": v for c, v in base.items()}}]
    for scheme in schemes or Q4_1_SCHEMES:
        model = requantized(ref, scheme)
        row: dict[str, Any] = {"scheme": scheme}
        before, after = [], []
        for name, mod in ref.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
                before.append(mod.weight.detach().flatten())
                after.append(model.get_submodule(name).weight.detach().flatten())
        w, w2 = torch.cat(before), torch.cat(after)
        row["unchanged"] = (w2 == w).double().mean().item()
        row["rel_rms"] = ((w2 - w).norm() / w.norm()).item()
        ctrl = requantized_weight(emb, scheme)
        row["control_rel_rms"] = ((ctrl - emb).norm() / emb.norm()).item()
        for c, ids in corpora.items():
            row[f"ppl_{c}"] = perplexity(model, ids, **kw)
            row[f"d_{c}"] = row[f"ppl_{c}"] / base[c] - 1
        row["agreement"] = next_token_agreement(ref, model, corpora["factbook"], **kw)
        rows.append(row)
    return {"windows": windows, "window": window, "rows": rows}


def print_q4_1(r: dict[str, Any]) -> None:
    """The table of `q4_1_caveat`'s rows: weight error, then perplexity and agreement."""
    print(
        f"{'scheme':<24}{'unchanged':>10}{'rel RMS':>9}{'(Q8_0 emb)':>11}"
        f"{'Factbook':>10}{'d':>8}{'KJV':>8}{'d':>8}{'agree':>7}"
    )
    for row in r["rows"]:
        if "rel_rms" not in row:
            print(f"{row['scheme']:<24}{'':>30}{row['ppl_factbook']:>10.2f}{'':>8}", end="")
            print(f"{row['ppl_kjv']:>8.2f}")
            continue
        print(
            f"{row['scheme']:<24}{row['unchanged']:>10.1%}{row['rel_rms']:>9.4f}"
            f"{row['control_rel_rms']:>11.4f}{row['ppl_factbook']:>10.2f}"
            f"{100 * row['d_factbook']:>+7.2f}%{row['ppl_kjv']:>8.2f}{100 * row['d_kjv']:>+7.2f}%"
            f"{row['agreement']:>7.3f}"
        )
