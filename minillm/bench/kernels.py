"""The course's Triton kernels against their references: error and speed.

- paged decode attention (chapter 07) vs SDPA on the gathered K/V, batch 1 and 64, short
  and long contexts, with and without split-K, and a KV block-size sweep: GB/s of K/V read
  and that as a fraction of this device's copy bandwidth, measured in the same run;
- flash prefill (chapter 07) vs SDPA's flash backend at 2k tokens, with a tile sweep;
- the fused INT4 dequant-matmul (chapter 06) vs a cuBLAS bf16 matmul at decode shapes,
  with a launch-configuration sweep.

On a GPU the kernels run compiled, in bf16, at real shapes (Llama-3-8B's attention:
32 query heads, 8 kv heads, head_dim 128; SmolLM2-135M's: 9/3/64). `small=True` (and any
CPU) runs tiny fp32 shapes in Triton's interpreter: the same code paths, checked for
correctness, timings meaningless. Notebooks 06 and 07 and `make gpu-check` call these;
`python -m benchmarks.kernels` prints them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from minillm.bench.workload import SEED
from minillm.kernels.flash_prefill import flash_prefill, prefill_tiles
from minillm.kernels.int4_matmul import int4_config, int4_matmul, int4_matmul_reference
from minillm.kernels.paged_attention import (
    choose_splits,
    decode_tile,
    gather_kv,
    paged_attention,
)
from minillm.lab.timing import kernel_time_ms
from minillm.quant import quantize_int4

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128)
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64)
TINY = dict(heads=4, kv_heads=2, head_dim=16)
# Launch configurations tried besides each kernel's default (GPU only).
_PREFILL_SWEEP = [
    dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=2),
]
_INT4_SWEEP = [  # the GEMV kernel's rows per program and K splits, then the tile kernel's
    *[dict(block_n=n, split_k=k) for n in (8, 16, 32) for k in (4, 8, 16)],
    *[dict(split_k=0, block_n=n, block_k=128, num_warps=4) for n in (32, 64)],
]


def _time(fn: Callable[[], Any], small: bool) -> float:
    """kernel_time_ms, with fewer calls in the interpreter (where timing means nothing)."""
    return kernel_time_ms(fn, warmup=1, repeats=2) if small else kernel_time_ms(fn)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes per second of a device-to-device copy (read + write), this run's ceiling."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (kernel_time_ms(lambda: dst.copy_(src)) / 1e3)


def _pool(
    batch: int, ctx: int, block: int, shape: dict, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A shuffled K/V pool holding `batch` sequences of `ctx` tokens, their tables, q."""
    g = torch.Generator(device=device).manual_seed(SEED)
    width = -(-ctx // block)
    kv, d, h = shape["kv_heads"], shape["head_dim"], shape["heads"]
    k_pool = torch.randn(batch * width, block, kv, d, generator=g, device=device).to(dtype)
    v_pool = torch.randn(batch * width, block, kv, d, generator=g, device=device).to(dtype)
    tables = torch.randperm(batch * width, generator=g, device=device).view(batch, width)
    q = torch.randn(batch, h, d, generator=g, device=device).to(dtype)
    lens = torch.full((batch,), ctx, device=device)
    return q, k_pool, v_pool, tables, lens


def sdpa_on_gathered(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """The reference: gather each row's K/V contiguous, mask past its length, SDPA in fp32."""
    k, v = gather_kv(k_pool, tables).float(), gather_kv(v_pool, tables).float()
    mask = torch.arange(k.shape[2], device=q.device) < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None], k, v, attn_mask=mask[:, None, None], enable_gqa=True
    )
    return out[:, :, 0]


def paged_decode_rows(device: torch.device, small: bool, copy_Bps: float) -> list[dict]:
    """Paged decode: error vs SDPA on gathered K/V, and GB/s of K/V read."""
    dtype = torch.float32 if small else torch.bfloat16
    if small:
        cases = [(2, 40, 8, TINY, s, {}) for s in (1, 2, None)] + [
            (2, 40, 8, TINY, 2, {"tile": 32})
        ]
    else:
        cases = [
            (64, 2048, 16, LLAMA3_8B, 1),
            (64, 2048, 16, LLAMA3_8B, None),
            (64, 256, 16, LLAMA3_8B, None),
            (1, 8192, 16, LLAMA3_8B, 1),
            (1, 8192, 16, LLAMA3_8B, None),
            (1, 256, 16, LLAMA3_8B, None),
            (8, 1024, 16, SMOLLM2, None),
            *[(64, 2048, bs, LLAMA3_8B, None) for bs in (8, 32, 64)],  # block-size sweep
        ]
        cases = [(*c, {}) for c in cases] + [  # launch sweep: tokens per tile, warps
            (b, ctx, 16, LLAMA3_8B, None, dict(tile=t, num_warps=w))
            for b, ctx in ((64, 2048), (1, 8192))
            for t in (32, 64, 128)
            for w in (4, 8)
        ]
    rows = []
    for batch, ctx, block, shape, splits, launch in cases:
        q, k_pool, v_pool, tables, lens = _pool(batch, ctx, block, shape, dtype, device)
        used = splits or choose_splits(batch, shape["kv_heads"], tables.shape[1], q.device)
        out = paged_attention(q, k_pool, v_pool, tables, lens, None, splits, **launch)
        err = (out.float() - sdpa_on_gathered(q, k_pool, v_pool, tables, lens)).abs().max()
        args = (q, k_pool, v_pool, tables, lens, None, splits)
        ms = _time(lambda args=args, kw=launch: paged_attention(*args, **kw), small)
        kv_bytes = 2 * batch * ctx * shape["kv_heads"] * shape["head_dim"] * dtype.itemsize
        rows.append(
            {
                "kernel": "paged decode",
                "batch": batch,
                "context": ctx,
                "block_size": block,
                "heads": f"{shape['heads']}/{shape['kv_heads']}x{shape['head_dim']}",
                "splits": used,
                "launch": str(launch or decode_tile(shape["head_dim"], q.device)),
                "max_err": err.item(),
                "ms": ms,
                "GBps": kv_bytes / ms / 1e6,
                "frac_of_copy": kv_bytes / (ms / 1e3) / copy_Bps,
            }
        )
    return rows


def flash_prefill_rows(device: torch.device, small: bool) -> list[dict]:
    """Flash prefill vs SDPA's flash backend (K/V heads repeated outside the timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.float32 if small else torch.bfloat16
    T = 40 if small else 2048
    shapes = [TINY] if small else [LLAMA3_8B, SMOLLM2]
    backend = SDPBackend.MATH if small else SDPBackend.FLASH_ATTENTION
    rows = []
    for shape in shapes:
        g = torch.Generator(device=device).manual_seed(SEED)
        h, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        q = torch.randn(1, h, T, d, generator=g, device=device).to(dtype)
        k, v = (torch.randn(1, kv, T, d, generator=g, device=device).to(dtype) for _ in "kv")
        k_rep, v_rep = (x.repeat_interleave(h // kv, 1) for x in (k, v))
        with sdpa_kernel(backend):
            ref = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
            sdpa_ms = _time(
                lambda q=q, k=k_rep, v=v_rep: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True
                ),
                small,
            )
        tiles = [{}] if small else [{}, *_PREFILL_SWEEP]
        for tile in tiles:
            label = "default " + str(prefill_tiles(d, q.device)) if not tile else str(tile)
            try:
                out = flash_prefill(q, k, v, **tile)
                ms = _time(lambda t=tile, q=q, k=k, v=v: flash_prefill(q, k, v, **t), small)
            except Exception as err:  # a tile too big for shared memory: report, go on
                rows.append({"kernel": "flash prefill", "config": label, "error": str(err)[:200]})
                continue
            flops = 2 * h * T * T * d  # causal: half of 4 * h * T^2 * d
            rows.append(
                {
                    "kernel": "flash prefill",
                    "tokens": T,
                    "heads": f"{h}/{kv}x{d}",
                    "config": label,
                    "max_err": (out.float() - ref.float()).abs().max().item(),
                    "ms": ms,
                    "sdpa_flash_ms": sdpa_ms,
                    "time_vs_sdpa": ms / sdpa_ms,
                    "TFLOPs": flops / ms / 1e9,
                }
            )
    return rows


def int4_rows(device: torch.device, small: bool) -> list[dict]:
    """INT4 fused kernel vs the bf16 weight through cuBLAS (x @ W^T) at decode shapes."""
    dtype = torch.float32 if small else torch.bfloat16
    shapes = [(1, 48, 128, 32)] if small else [(1, 4096, 4096, 128), (16, 4096, 4096, 128)]
    shapes += [] if small else [(1, 1536, 576, 64), (1, 576, 1536, 64)]  # SmolLM2's MLP
    rows = []
    for m, n, k, group in shapes:
        g = torch.Generator(device=device).manual_seed(SEED)
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        qw = quantize_int4(w, group)
        w16 = w.to(dtype)
        ref = int4_matmul_reference(x.float(), qw)
        dense_ms = _time(lambda w16=w16, x=x: x @ w16.T, small)
        sweep = [{}] if small or n != 4096 else [{}, *_INT4_SWEEP]
        for cfg in sweep:
            label = "default " + str(int4_config(m, n, group, x.device)) if not cfg else str(cfg)
            try:
                out = int4_matmul(x, qw, **cfg)
                ms = _time(lambda cfg=cfg, x=x, qw=qw: int4_matmul(x, qw, **cfg), small)
            except Exception as err:  # an invalid combination (block_k > group): report it
                rows.append({"kernel": "int4 matmul", "config": label, "error": str(err)[:200]})
                continue
            rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            rows.append(
                {
                    "kernel": "int4 matmul",
                    "shape": f"M={m} N={n} K={k} g{group}",
                    "config": label,
                    "rel_err": rel,
                    "ms": ms,
                    "dense_ms": dense_ms,
                    "speedup_vs_dense": dense_ms / ms,
                    "weight_GBps": qw.nbytes / ms / 1e6,
                }
            )
    return rows


def nf4_rows(device: torch.device) -> list[dict]:
    """bitsandbytes' NF4 `matmul_4bit` vs the bf16 weight through cuBLAS (GPU only), the
    library counterpart of our INT4 kernel in chapter 06."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f

    rows = []
    for m, n, k in [(1, 4096, 4096), (16, 4096, 4096)]:
        g = torch.Generator(device=device).manual_seed(SEED)
        w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        q4, state = bnb_f.quantize_4bit(w, quant_type="nf4", blocksize=64)
        dense_ms = kernel_time_ms(lambda w=w, x=x: x @ w.T)
        ms = kernel_time_ms(lambda q4=q4, st=state, x=x: bnb.matmul_4bit(x, q4.t(), st))
        rows.append(
            {"kernel": "bnb nf4", "shape": f"M={m} N={n} K={k}", "ms": ms, "dense_ms": dense_ms}
        )
    return rows


def run(small: bool | None = None) -> dict[str, Any]:
    """Every kernel table; `small` defaults to True without CUDA."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type != "cuda" if small is None else small
    copy_Bps = copy_bandwidth(device, 2**22 if small else 2**30)
    parts: dict[str, Callable[[], list[dict]]] = {
        "paged_decode": lambda: paged_decode_rows(device, small, copy_Bps),
        "flash_prefill": lambda: flash_prefill_rows(device, small),
        "int4_matmul": lambda: int4_rows(device, small),
    }
    out: dict[str, Any] = {"device": str(device), "small": small, "copy_GBps": copy_Bps / 1e9}
    for name, part in parts.items():
        out[name] = part()
    return out
