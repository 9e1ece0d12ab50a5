"""Decode attention at long context: what one decode step's attention costs per byte of
K/V it reads, from a short context to the model's longest, in the two ways a grouped-query
cache can be read.

- `grouped_sdpa` (the caches' default): each kv head's group of query heads is folded into
  that head's rows, so a step reads each layer's K and V once;
- `masked_sdpa` (PyTorch's `enable_gqa`): the kernel attends query head by query head, and
  each kv head's K/V is streamed once per query head it serves;
- where it runs (fp32 on a CPU with a C compiler), the cache's own C step
  (`minillm.kernels.rowops.decode_attention`): each K/V row read once per kv head too, with
  no mask, index writes or SDPA call around it.

At each context n, one round times, in turn: the attention of every layer over n cached
tokens in each form, the whole decode step in each form, and a read of a buffer larger
than any CPU cache (the read bandwidth, at that moment of a shared machine). The K/V are
random (speed does not depend on the values); the step is the model's, batch 1.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.bench.kv_costs import kv_bytes_per_token, random_ids
from minillm.cache import KVCache
from minillm.cache.protocol import SdpaFn, grouped_sdpa, masked_sdpa
from minillm.kernels import rowops
from minillm.kernels.matvec import matvec_status
from minillm.lab import time_samples
from minillm.model import Transformer

FORMS: dict[str, SdpaFn] = {"grouped": grouped_sdpa, "per query head": masked_sdpa}
C_FORM = "C kernel"  # the cache's one-token step in C: its own form, not an SdpaFn
READ = "read"


def forms_for(model: Transformer) -> list[str]:
    """The forms this model is timed in: both SDPA forms, and the C step where it runs."""
    weight = model.lm_head.weight
    c_runs = matvec_status()[0] and weight.dtype == torch.float32 and weight.is_cpu
    return [*FORMS, *([C_FORM] if c_runs else [])]


def filled_cache(model: Transformer, n: int, seed: int = 0) -> KVCache:
    """A batch-1 cache of n slots, every slot holding random K/V (no prefill: at 8k tokens
    a prefill is minutes on one thread, and the step's speed does not depend on them)."""
    weight = model.lm_head.weight
    cache = KVCache(model.config, 1, n, weight.dtype, weight.device)
    cache.decode_kernel = False  # each step picks its form (`step_fn`)
    g = torch.Generator(device=weight.device).manual_seed(seed)
    for buffer in (cache.k, cache.v):
        buffer.normal_(generator=g)
    return cache


def attention_fn(model: Transformer, cache: KVCache, form: str) -> Callable[[], Any]:
    """Every layer's decode attention over the cache's slots, alone: one query row
    [1, heads, 1, head_dim] a layer, as a step computes it (the C form writes the step's
    K/V at the last slot too, as it does in a step)."""
    c = model.config
    weight = model.lm_head.weight
    n = cache.kv_len
    q = torch.randn(c.num_hidden_layers, 1, c.num_attention_heads, 1, c.head_dim)
    q = q.to(device=weight.device, dtype=weight.dtype)
    pos = torch.tensor([[n - 1]], device=weight.device)
    mask = cache.causal_mask(pos)
    new = cache.k[:, :, :, n - 1 : n].clone()  # this step's K/V: what the last slot holds

    @torch.inference_mode()
    def run() -> None:
        for layer in range(c.num_hidden_layers):
            k, v = cache.k[layer], cache.v[layer]
            if form == C_FORM:
                rowops.decode_attention(k, v, q[layer], new[layer], new[layer], pos, n)
            else:
                FORMS[form](q[layer], k[:, :, :n], v[:, :, :n], mask)

    return run


def step_fn(model: Transformer, cache: KVCache, form: str) -> Callable[[], Any]:
    """The model's decode step at the cache's last slot, attending in `form`."""
    n = cache.kv_len
    token = random_ids(model, 1)
    pos = torch.tensor([[n - 1]], device=token.device)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        # this cache's attention form (SdpaCache's extension point), or its own C step
        cache.sdpa, cache.decode_kernel = FORMS.get(form, grouped_sdpa), form == C_FORM
        return model(token, pos, cache=cache)[:, -1]

    return run


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def attention_sweep(
    model: Transformer,
    lengths: Sequence[int],
    repeats: int = 10,
    warmup: int = 2,
    read_bytes: int = 512 * 2**20,
    progress: bool = False,
) -> dict[str, Any]:
    """For each context n in `lengths`: each form's attention and decode step (`forms_for`),
    and the read bandwidth, timed in turn (`time_samples`), `repeats` rounds. Per form and
    n: seconds (median, min, max over rounds), K/V bytes read, the attention's share of the read
    bandwidth measured in the same round (median and range of the per-round ratio), and
    per doubling of n how much the attention's time grew against its bytes (2x)."""
    c = model.config
    elt = model.lm_head.weight.element_size()
    per_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, elt)
    src = torch.empty(read_bytes // 4, device=model.lm_head.weight.device).uniform_()
    rows: list[dict[str, Any]] = []
    items: Any = lengths
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(lengths, desc="context", leave=False)
    forms = forms_for(model)
    for n in items:
        cache = filled_cache(model, n)
        fns: dict[str, Callable[[], Any]] = {READ: src.sum}
        for name in forms:
            fns[f"{name} attention"] = attention_fn(model, cache, name)
            fns[f"{name} step"] = step_fn(model, cache, name)
        with torch.inference_mode():  # the forms compute the same step, up to the order
            first, *rest = (fns[f"{name} step"]().float() for name in forms)  # of fp32 sums
        for other in rest:
            torch.testing.assert_close(other, first, atol=1e-3, rtol=1e-3)
        samples = time_samples(fns, repeats=repeats, warmup=warmup)
        kv = per_token * n
        row: dict[str, Any] = {"context": n, "kv_bytes": kv, "read_s": _spread(samples[READ])}
        for name in forms:
            attn = samples[f"{name} attention"]
            share = [(kv / t) / (src.nbytes / r) for t, r in zip(attn, samples[READ], strict=True)]
            row[name] = {
                "attention_s": _spread(attn),
                "step_s": _spread(samples[f"{name} step"]),
                "fraction_of_read_bandwidth": _spread(share),
            }
        first, second = (samples[f"{name} step"] for name in FORMS)
        row["step_ratio"] = _spread([b / a for a, b in zip(first, second, strict=True)])
        rows.append(row)
        del cache
    for name in forms:  # growth of the median attention time per doubling, over 2x bytes
        for prev, row in zip(rows, rows[1:], strict=False):
            grew = row[name]["attention_s"]["median"] / prev[name]["attention_s"]["median"]
            row[name]["growth_over_bytes"] = grew / (row["kv_bytes"] / prev["kv_bytes"])
    return {
        "forms": {
            name: FORMS[name].__name__ if name in FORMS else "rowops.decode_attention"
            for name in forms
        },
        "kv_bytes_per_token": per_token,
        "read_bytes": src.nbytes,
        "repeats": repeats,
        "rows": rows,
    }


def print_sweep(sweep: dict[str, Any]) -> None:
    """One line per context: each form's attention and step (median ms), its share of the
    read bandwidth, and the step ratio per query head / grouped."""
    names = list(sweep["forms"])
    print(
        f"{'context':>8}{'K/V MiB':>9}"
        + "".join(f"{name + ' attn ms':>26}{'of read bw':>12}{'step ms':>10}" for name in names)
        + f"{'step ratio':>12}"
    )
    for row in sweep["rows"]:
        line = f"{row['context']:>8}{row['kv_bytes'] / 2**20:>9.1f}"
        for name in names:
            r = row[name]
            line += (
                f"{1e3 * r['attention_s']['median']:>26.2f}"
                f"{r['fraction_of_read_bandwidth']['median']:>12.0%}"
                f"{1e3 * r['step_s']['median']:>10.1f}"
            )
        line += f"{row['step_ratio']['median']:>11.2f}x"
        print(line)
