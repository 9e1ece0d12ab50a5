"""Chapter 06's CPU peers in one run (`python -m benchmarks.peers`): minillm's batch-1 decode
in fp32 (its C matvec kernel), int8 and int4 (its quantized C kernels, `qmatvec.c`), against
llama.cpp's `llama-server` decoding f32, Q8_0 and Q4_1 GGUFs of the same weights, every
format timed in each round, with the bytes a token reads and each format's perplexity.

SmolLM2-135M-Instruct's published weights are llama.cpp's Q4_1 (linear layers) with a Q8_0
embedding, so "fp32" is that file dequantized and Q4_1's weights give fp32's perplexity by
construction. minillm's int4 is Q4_1's own format (`q4_1-g32`), which finds those weights'
grid again exactly. The int formats quantize the lm_head to int8 (one scale per row), as
the Q4_1 file's Q8_0 embedding does. Perplexity: minillm's formats through the kernels the
decode runs, their int8-rounded activations included; llama.cpp's from its weights alone
(dequantized, through minillm's fp32 model), so without the 8-bit activations its own
quantized matmuls use. Where the C kernels cannot be built, int8 and int4 fall back to
torch's kernels (int4 at the largest group size they take), and the file says so.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minillm.bench import llama_cpp, llama_server
from minillm.bench.quant import decode_step
from minillm.bench.quant_decode import group_size_for, step_bytes
from minillm.export.gguf import export_gguf
from minillm.kernels.matvec import matvec_status
from minillm.lab import time_samples
from minillm.lab.ranks import free_port
from minillm.model import Transformer, load_model, load_tokenizer
from minillm.model.layout import (
    MatVecLinear,
    decode_layout,
    matvec_applies,
    use_matvec,
    use_row_ops,
)
from minillm.model.weights import resolve_model_dir
from minillm.quant import quantize_model
from minillm.quant.linear import use_cpu_kernels
from minillm.training import factbook_ids, perplexity


def int_backend() -> str:
    """The int formats' CPU kernels: minillm's C kernels ("c") where they build, else
    torch's ("torch")."""
    return "c" if matvec_status()[0] else "torch"


def minillm_formats(base: Transformer) -> dict[str, nn.Module]:
    """fp32 through the C matvec kernel and row ops (chapter 02's decode layout where no
    compiler builds them); int8 everywhere; int4 with an int8 lm_head; both int formats on
    `int_backend`'s kernels: Q4_1's format on minillm's (with the row ops), or on torch's
    the largest group size that divides every input."""
    backend = int_backend()
    int4 = "q4_1-g32" if backend == "c" else f"int4-g{group_size_for(base)}"
    int8 = quantize_model(copy.deepcopy(base), "int8", keep=())
    int4_model = quantize_model(quantize_model(copy.deepcopy(base), int4), "int8", keep=())
    for name, model in (("int8", int8), (int4, int4_model)):
        skipped = use_cpu_kernels(model, backend)
        if skipped:
            raise RuntimeError(f"{name}: no CPU kernel for {sorted(skipped)}: {skipped}")
        if backend == "c":
            use_row_ops(model)  # the C RMSNorm and rotary embedding, as fp32's use_matvec gives
    fp32 = copy.deepcopy(base)
    fp32 = use_matvec(fp32) if matvec_applies(fp32) else decode_layout(fp32)
    return {"fp32": fp32, "int8": int8, f"int4 {int4}": int4_model}


def llama_formats(model_dir: Path, q4_1: Path, work: Path) -> dict[str, Path]:
    """The GGUFs llama-server decodes: f32 and Q8_0 exported from `model_dir`, and the Q4_1
    file those weights came from."""
    return {
        "f32": export_gguf(model_dir, work / "model-f32.gguf", "f32"),
        "Q8_0": export_gguf(model_dir, work / "model-q8_0.gguf", "q8_0"),
        "Q4_1": q4_1,
    }


def gguf_bytes(path: Path) -> int:
    """Bytes a decoded token reads from a GGUF: every tensor once (the embedding is the
    tied output matrix, read whole; its one looked-up row is noise)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def format_perplexity(model: nn.Module, ids: torch.Tensor, windows: int) -> float:
    """Perplexity of `model` on `windows` windows of 256 tokens of `ids`."""
    with torch.inference_mode():
        return perplexity(model, ids, 256, max_windows=windows)


def run(
    name: str = "smollm2",
    context: int = 64,
    rounds: int = 5,
    repeats: int = 10,
    windows: int = 8,
    work: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every format of `name` (a `load_model` name with a packaged GGUF) timed in each of
    `rounds` rounds: minillm's decode step at `context` tokens (`repeats` calls, the median),
    then llama-server's decode of `context` tokens after `context // 2` (its own
    `predicted_per_second`), one thread each; then each format's perplexity on `windows`
    Factbook windows. Needs llama-server (`python -m benchmarks.llama_server`)."""
    from minillm.model.named import MODELS

    if llama_server.find_binary() is None:
        raise SystemExit(f"llama-server is not built: run {llama_server.BUILD_COMMAND}")
    work = Path(work or ".")
    base = load_model(name)
    cfg = base.config
    ours = minillm_formats(base)
    uses_matvec = isinstance(ours["fp32"].lm_head, MatVecLinear)
    ggufs = llama_formats(resolve_model_dir(name), MODELS[name].gguf_path(), work)
    steps = {fmt: decode_step(m, cfg, context) for fmt, m in ours.items()}
    prompt = torch.randint(
        0, cfg.vocab_size, (context // 2,), generator=torch.Generator().manual_seed(0)
    )
    servers = {
        fmt: (
            port := free_port(),
            llama_server.start(
                path, port, 1, threads=torch.get_num_threads(), ctx_per_slot=2 * context
            ),
        )
        for fmt, path in ggufs.items()
    }
    speed: dict[str, list[float]] = {f"minillm {f}": [] for f in ours}
    speed |= {f"llama.cpp {f}": [] for f in ggufs}
    try:
        for port, _ in servers.values():  # warm-up, and the greedy decode works
            llama_cpp.decode_once(port, prompt.tolist(), context)
        for r in range(rounds):
            progress(f"round {r + 1}/{rounds}")
            samples = time_samples(steps, repeats=repeats, warmup=1)
            for fmt, s in samples.items():
                speed[f"minillm {fmt}"].append(1 / statistics.median(s))
            for fmt, (port, _) in servers.items():
                speed[f"llama.cpp {fmt}"].append(
                    llama_cpp.decode_once(port, prompt.tolist(), context)
                )
    finally:
        llama_cpp.stop([proc for _, proc in servers.values()])
    progress("perplexity")
    ids = factbook_ids(load_tokenizer(name))
    ppl = {f"minillm {f}": format_perplexity(m, ids, windows) for f, m in ours.items()}
    ppl |= {
        f"llama.cpp {f}": format_perplexity(load_model(p), ids, windows) for f, p in ggufs.items()
    }
    size = {f"minillm {f}": step_bytes(m) for f, m in ours.items()}
    size |= {f"llama.cpp {f}": gguf_bytes(p) for f, p in ggufs.items()}
    fp32 = ppl["minillm fp32"]
    return {
        "model": name,
        "context": context,
        "rounds": rounds,
        "windows": windows,
        "fp32_path": "C matvec kernel" if uses_matvec else "decode layout",
        "int_kernels": {"c": "minillm's C kernels", "torch": "torch's CPU kernels"}[int_backend()],
        "formats": {
            k: {
                "tokens_per_s": v,
                "bytes_per_token": size[k],
                "perplexity": ppl[k],
                "ppl_delta": ppl[k] / fp32 - 1,
            }
            for k, v in speed.items()
        },
    }


PAIRS = (("fp32", "f32"), ("int8", "Q8_0"), ("int4", "Q4_1"))


def pair_ratios(result: dict[str, Any]) -> dict[str, list[float]]:
    """Per round, minillm's tok/s over llama.cpp's for each pair of formats (fp32 / f32,
    int8 / Q8_0, int4 / Q4_1): the two ran in the same round."""
    f = result["formats"]
    out = {}
    for ours, theirs in PAIRS:
        (key,) = [k for k in f if k.startswith(f"minillm {ours}")]
        a, b = f[key]["tokens_per_s"], f[f"llama.cpp {theirs}"]["tokens_per_s"]
        out[f"{key.removeprefix('minillm ')} / {theirs}"] = [
            x / y for x, y in zip(a, b, strict=True)
        ]
    return out


def print_result(result: dict[str, Any]) -> None:
    """One line per format, then minillm / llama.cpp per pair over the rounds."""
    print(
        f"\nbatch-1 decode at {result['context']} tokens, {result['rounds']} rounds, 1 thread; "
        f"perplexity on {result['windows']} Factbook windows of 256 tokens"
    )
    print(f"minillm fp32 runs its linear layers through the {result['fp32_path']}", end="")
    print(f", int8 and int4 through {result['int_kernels']}")
    print(f"{'format':<22}{'tok/s (rounds)':>18}{'MB a token':>12}{'perplexity':>12}{'vs fp32':>9}")
    for name, r in result["formats"].items():
        tps = r["tokens_per_s"]
        print(
            f"{name:<22}{f'{min(tps):.1f}-{max(tps):.1f}':>18}{r['bytes_per_token'] / 1e6:>12.1f}"
            f"{r['perplexity']:>12.2f}{round(r['ppl_delta'], 3) or 0.0:>+9.1%}"
        )
    for pair, ratios in pair_ratios(result).items():
        print(
            f"  minillm {pair}: {min(ratios):.2f}-{max(ratios):.2f}x "
            f"(median {statistics.median(ratios):.2f}x)"
        )
