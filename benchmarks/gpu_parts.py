"""The parts of `benchmarks.gpu_check`: each takes the run (device, dtype, mode, deadline)
and returns its figures and its checks ({"name", "passed", "detail"})."""

from __future__ import annotations

import gc
import importlib.util
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from minillm import SamplingParams, generate, load_model
from minillm.bench import compile as compile_bench
from minillm.bench import kernels as kernel_bench
from minillm.engine import Engine
from minillm.generation import generate_static
from minillm.generation.static import compile_decode_step
from minillm.lab import time_ratios
from minillm.lab.timing import kernel_time_ms
from minillm.model import ModelConfig, Transformer, load_tokenizer, random_model, save_model
from minillm.model.weights import resolve_dtype
from minillm.training import first_divergence

TINY = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


class Missing(Exception):
    """A part needs a package or device this machine lacks: reported as skipped."""


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Missing(f"needs {module}")


def device_slug() -> str:
    """'NVIDIA H200' -> 'h200': the report's file name."""
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return name.split()[0].replace("/", "-") if name else "gpu"


def check(name: str, passed: bool, detail: Any = "") -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def big_model(run, seed: int = 0) -> Transformer:
    """SmolLM2-135M's shapes with random weights (real weights do not fit the 64 MiB that
    reach the GPU machine); on the CPU a tiny model with the same structure."""
    model = random_model("SmolLM2-135M" if not run.cpu else ModelConfig(**TINY), seed)
    return model.to(run.device, run.dtype)


def prompts(n: int, vocab: int, low: int = 8, high: int = 48, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (n_,), generator=g).tolist() for n_ in lens]


# ------------------------------------------------------------------------------- kernels


def kernels(run) -> dict[str, Any]:
    small = run.cpu
    copy_Bps = kernel_bench.copy_bandwidth(run.device, 2**22 if small else 2**30)
    out: dict[str, Any] = {"copy_GBps": copy_Bps / 1e9}
    if not small:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = kernel_time_ms(lambda: a @ a)
        out["bf16_matmul_TFLOPs"] = 2 * 8192**3 / ms / 1e9
    out["paged_decode"] = kernel_bench.paged_decode_rows(run.device, small, copy_Bps)
    out["flash_prefill"] = kernel_bench.flash_prefill_rows(run.device, small)
    out["int4_matmul"] = kernel_bench.int4_rows(run.device, small)
    tol = 1e-4 if small else 3e-2  # bf16 inputs, fp32 accumulation
    paged_err = max(r["max_err"] for r in out["paged_decode"])
    flash_err = max(r.get("max_err", 0.0) for r in out["flash_prefill"])
    int4_err = max(r.get("rel_err", 0.0) for r in out["int4_matmul"])
    swept = out["flash_prefill"] + out["int4_matmul"]
    out["checks"] = [
        check("paged decode == SDPA on gathered K/V (every case)", paged_err < tol, paged_err),
        check("flash prefill == SDPA flash", flash_err < tol, flash_err),
        check("int4 kernel == dequantize-then-matmul (relative)", int4_err < 2e-2, int4_err),
        check(
            "the default launch configurations compile (sweep failures are listed, not failed)",
            not any("error" in r and r["config"].startswith("default") for r in swept),
            [r["config"] for r in swept if "error" in r],
        ),
    ]
    return out


# ---------------------------------------------------------------------------------- fp8


def fp8(run) -> dict[str, Any]:
    """FP8 e4m3 weights and activations through `torch._scaled_mm` (chapter 06): the same
    product as dequantize-then-matmul on this device, and on a GPU with FP8 tensor cores
    (compute capability 8.9+) its speed vs the bf16 matmul and its error vs fp32
    (`time_scaled_mm`, which says what it skipped on an older GPU)."""
    from minillm.quant.fp8 import (
        fp8_dequantize,
        fp8_fake_quant,
        fp8_quantize,
        scaled_mm,
        time_scaled_mm,
    )

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 256, generator=g), torch.randn(128, 256, generator=g)
    codes, scale = fp8_quantize(w, "e4m3")
    got = scaled_mm(x.to(run.device), codes.to(run.device), scale.to(run.device)).cpu()
    ref = fp8_fake_quant(x, "e4m3") @ fp8_dequantize(codes, scale).T
    err = ((got - ref).norm() / ref.norm()).item()
    out: dict[str, Any] = {"scaled_mm_vs_dequantized": err}
    checks = [check("_scaled_mm == dequantize-then-matmul (e4m3, relative)", err < 1e-3, err)]
    if not run.cpu:
        out["speed"] = time_scaled_mm()
        for shape, r in out["speed"].items():
            if isinstance(r, dict):
                name = f"fp8 {shape}: within 8% of the fp32 product (relative)"
                checks.append(check(name, r["rel_error"] < 0.08, r["rel_error"]))
    out["checks"] = checks
    return out


# --------------------------------------------------------------------------- CUDA graphs


def _graph_mode(run) -> dict[str, Any]:
    """reduce-overhead (inductor + CUDA graphs) on a GPU; the eager backend on a CPU, where
    there are no CUDA graphs and inductor's C++ compile would only cost CI time."""
    return {"mode": "default", "backend": "eager"} if run.cpu else {"mode": "reduce-overhead"}


def cuda_graphs(run) -> dict[str, Any]:
    """Same tokens: checked in fp32, where both paths round alike. In bf16 inductor keeps a
    fused chain of elementwise ops in fp32 where eager rounds to bf16 after each op, so a
    logit within a rounding step of the next can swap and greedy tokens diverge from there:
    reported as agreement, not required (the first GPU run saw bf16 tokens differ)."""
    out: dict[str, Any] = {}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for dtype in dict.fromkeys([torch.float32, run.dtype]):
        bundled = load_model(device=run.device, dtype=dtype)
        work = prompts(4, bundled.config.vocab_size, seed=1)
        torch._dynamo.reset()
        step = compile_decode_step(**_graph_mode(run))
        eager_tokens = generate_static(bundled, work, params, compiled=False)
        graph_tokens = generate_static(bundled, work, params, compiled=step)
        out[f"bundled {dtype}"] = {
            "identical": eager_tokens == graph_tokens,
            "first_divergence": [
                first_divergence(a, b) for a, b in zip(eager_tokens, graph_tokens, strict=True)
            ],
        }
    same = out[f"bundled {torch.float32}"]["identical"]
    model = big_model(run)
    out["speedup"] = {
        f"batch {b}": compile_bench.step_modes(
            model, prompts(b, 4000, seed=b), 64, {"graph": _graph_mode(run)}, 5 if run.cpu else 30
        )["graph"]
        for b in (1, 8)
    }
    counters = torch._dynamo.utils.counters["inductor"]
    out["cudagraph_counters"] = {k: v for k, v in counters.items() if "cudagraph" in k}
    out["checks"] = [
        check("CUDA-graph step gives the eager step's greedy tokens (bundled, fp32)", same),
        check(
            "no CUDA-graph skips",
            run.cpu or not any("skip" in k for k in out["cudagraph_counters"]),
            out["cudagraph_counters"],
        ),
    ]
    return out


# -------------------------------------------------------------------------------- engine


def _engine_tokens(model, work, params, num_blocks: int) -> list[list[int]]:
    engine = Engine(model, load_tokenizer(), num_blocks=num_blocks, max_num_seqs=len(work))
    for ids in work:
        engine.add_request(ids, params)
    return [out.outputs[0].token_ids for out in engine.run_to_completion()]


def _throughput(
    model, concurrency: int, out_tokens: int, run, decode_mode: str | None = None
) -> dict[str, float]:
    n = max(4, concurrency)
    work = prompts(n, min(model.config.vocab_size, 4000), 16, 64, seed=concurrency)
    need_blocks = sum(-(-(len(p) + out_tokens) // 16) for p in work[:concurrency]) + 16
    engine = Engine(model, load_tokenizer(), num_blocks=need_blocks, max_num_seqs=concurrency,
                    decode_mode=decode_mode)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    engine.add_request(work[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.run_to_completion()  # warm-up: kernels compiled, allocator warm
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    for ids in work:
        engine.add_request(ids, params)
    engine.run_to_completion()
    if not run.cpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "requests": n,
        "output_tok_s": n * out_tokens / wall,
        "ms_per_step": 1e3 * wall / (engine.num_steps - steps0),
    }


def engine(run) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    checks = []
    models = {"bundled": lambda dt: load_model(device=run.device, dtype=dt)}
    models["SmolLM2-135M shape"] = lambda dt: big_model(run).to(dt)
    for name, make in models.items():
        row: dict[str, Any] = {}
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for dtype in dict.fromkeys([torch.float32, run.dtype]):
            model = make(dtype)
            work = prompts(6, min(model.config.vocab_size, 4000), seed=2)
            got = _engine_tokens(model, work, params, num_blocks=64)
            ref = [generate(model, [p], params)[0] for p in work]
            agree = [first_divergence(g, r) for g, r in zip(got, ref, strict=True)]
            row[str(dtype)] = {"identical": got == ref, "first_divergence": agree}
        fp32 = row[str(torch.float32)]
        checks.append(check(f"engine == generate, fp32 ({name})", fp32["identical"], fp32))
        model = make(run.dtype)
        levels = (1, 4) if run.cpu else (1, 32, 128)
        row["throughput"] = {
            f"{c} in flight": _throughput(model, c, 8 if run.cpu else 64, run) for c in levels
        }
        # the decode fast path (CUDA graphs on a GPU; on a CPU both runs are eager)
        row["throughput_eager_steps"] = {
            f"{c} in flight": _throughput(model, c, 8 if run.cpu else 64, run, "eager")
            for c in levels[:2]
        }
        out["models"][name] = row
        del model
    out["checks"] = checks
    return out


# ------------------------------------------------------------------ minillm vs transformers


def hf_generate(run) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    model = big_model(run).float()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(run.device).eval()
    work = prompts(2, 4000, seed=3)
    new = 16 if run.cpu else 32
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ours = [generate(model, [p], params)[0] for p in work]

    def hf_tokens(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], device=run.device)
        y = hf.generate(x, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None)
        return y[0, len(ids) :].tolist()

    with torch.inference_mode():
        theirs = [hf_tokens(p, new) for p in work]
    out["same_tokens_fp32"] = ours == theirs
    model, hf = model.to(run.dtype), hf.to(run.dtype)
    timed_new = 16 if run.cpu else 128
    params = SamplingParams(temperature=0, max_tokens=timed_new, ignore_eos=True)
    with torch.inference_mode():
        ratios = time_ratios(
            {
                "minillm": lambda: generate(model, [work[0]], params),
                "transformers": lambda: hf_tokens(work[0], timed_new),
            },
            baseline="minillm",
            repeats=2 if run.cpu else 5,
            warmup=1,
        )
    out["hf_time_vs_minillm"] = ratios["transformers"]
    out["checks"] = [check("minillm == transformers generate, fp32", out["same_tokens_fp32"])]
    return out


# ------------------------------------------------------------------------------ notebooks


def notebooks(run) -> dict[str, Any]:
    """The notebooks' GPU-only cells call these same functions; here they run, or say what
    they need."""
    from minillm.bench import batching
    from minillm.bench import tensorrt as trt_bench
    from minillm.engine import LLM

    out: dict[str, Any] = {}
    checks = []
    # The KV pool is sized from a memory fraction (profiled on a GPU); half, not vLLM's 0.9,
    # and released after, so that the checks below still have the GPU's memory.
    llm = LLM(dtype="auto", device=str(run.device), gpu_memory_utilization=0.5)
    outputs = llm.generate(["And God said,"], SamplingParams(temperature=0, max_tokens=8))
    dtype = str(llm.engine.model.lm_head.weight.dtype)
    plan = llm.engine.pool_plan
    out["08 LLM API"] = {"dtype": dtype, "text": outputs[0].outputs[0].text}
    out["08 LLM API"]["kv_pool"] = plan.describe() if plan is not None else None
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    want = "" if run.cpu else str(resolve_dtype("auto", run.device))  # bf16 from sm80, else fp16
    label = f"08: LLM(dtype='auto') runs in {want or 'the GPU default'}"
    checks.append(check(label, run.cpu or dtype == want))

    def compare(*backends: str) -> dict[str, Any]:
        return trt_bench.compare_backends(load_model(), backends=backends)

    cells: list[tuple[str, Callable[[], Any], str]] = [
        (
            "04 eager fp16 / torch.compile vs fp32",
            lambda: compare("eager fp16", "torch.compile fp16"),
            "cuda",
        ),
        ("04 torch-tensorrt engine", lambda: compare("torch-tensorrt fp16"), "torch_tensorrt"),
        (
            "04 ORT CUDA / TensorRT providers",
            lambda: compare("ORT CUDA fp32", "ORT TensorRT fp16"),
            "onnxruntime-gpu",
        ),
        ("06 bitsandbytes NF4 matmul", lambda: kernel_bench.nf4_rows(run.device), "bitsandbytes"),
        ("08 vLLM vs minillm, bf16", batching.vllm_compare, "vllm"),
    ]
    for label, fn, needs in cells:
        try:
            if run.cpu:
                raise Missing("needs CUDA")
            if needs == "onnxruntime-gpu":
                import onnxruntime

                if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                    raise Missing("needs onnxruntime-gpu")
            elif needs != "cuda":
                need(needs)
            out[label] = {"status": "ok", "result": fn()}
        except Missing as err:
            out[label] = {"status": "skipped", "reason": str(err)}
    out["checks"] = checks
    return out
