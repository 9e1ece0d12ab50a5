"""vLLM's engine-level arguments, implemented: the engine seed, the KV pool sized from a
memory fraction (pure arithmetic checked with made-up numbers, and the CPU rule inside a
real engine), the token budget per step, model parallelism refused, and every setting
checked once, in `EngineConfig`, with a message that names the fix."""

import pytest
import torch

from minillm import load_tokenizer
from minillm.cache import PagedKVCache
from minillm.engine import LLM, Engine, EngineConfig, SamplingParams, memory

GIB, MIB = 2**30, 2**20


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def sample(engine, prompts, params):
    for p in prompts:
        engine.add_request(p, params)
    return [o.outputs[0].token_ids for o in engine.run_to_completion()]


PROMPTS = ["In the beginning", "And the LORD said", "Blessed are"]
FREE = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)


# ------------------------------------------------------------------ seed
def test_engine_seed_makes_unseeded_requests_reproducible(model, tok):
    first = sample(Engine(model, tok, seed=7), PROMPTS, FREE)
    again = sample(Engine(model, tok, seed=7), PROMPTS, FREE)
    other = sample(Engine(model, tok, seed=8), PROMPTS, FREE)
    assert first == again, "the same engine seed must give the same samples"
    assert first != other, "another engine seed should give other samples"
    assert len(set(map(tuple, first))) == len(PROMPTS), "requests share one stream"


def test_a_requests_own_seed_wins_over_the_engines(model, tok):
    own = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=42)
    outs = [sample(Engine(model, tok, seed=s), PROMPTS[:1], own)[0] for s in (None, 1, 2)]
    assert outs[0] == outs[1] == outs[2]


def test_without_an_engine_seed_unseeded_requests_vary(model, tok):
    runs = {tuple(sample(Engine(model, tok), PROMPTS[:1], FREE)[0]) for _ in range(3)}
    assert len(runs) > 1


# ------------------------------------------------------------------ dtype
def test_the_engine_runs_in_fp16(model, tok):
    """fp16 is "auto" on a T4: the engine's paged cache and sampling take it, and a request
    run alone gets `generate`'s greedy tokens on the same fp16 model. (Batched, fp16's
    rounding differs with the batch's shapes, so near-ties may break the other way: the
    batching invariance is tested in fp32.)"""
    import copy

    from minillm import generate

    half = copy.deepcopy(model).half()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in PROMPTS:
        engine = Engine(half, tok, block_size=4)
        assert engine.runner.worker.cache.k[0].dtype == torch.float16
        expected = generate(half, [tok.encode(prompt)], params)[0]
        assert sample(engine, [prompt], params) == [expected], prompt


# ------------------------------------------------------------------ pool sizing, pure
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype",
    [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8")],
)
def test_bytes_per_block_is_what_the_paged_cache_allocates(tiny_config, dtype, kv_cache_dtype):
    cfg = tiny_config()
    cache = PagedKVCache(cfg, 5, 4, dtype, kv_cache_dtype=kv_cache_dtype)
    per_block = memory.kv_bytes_per_block(cfg, 4, dtype, kv_cache_dtype)
    assert cache.nbytes == 6 * per_block  # 5 blocks and the padding block


def test_bytes_per_block_of_llama2_7b():
    cfg = type("Cfg", (), dict(num_hidden_layers=32, num_key_value_heads=32, head_dim=128))
    assert memory.kv_bytes_per_block(cfg, 16, torch.float16) == 8 * MIB  # 2*32*16*32*128*2
    int8 = memory.kv_bytes_per_block(cfg, 16, torch.float16, "int8")
    assert int8 == 2 * 32 * 16 * 32 * (128 + 4)  # codes and one fp32 scale per vector


def test_gpu_rule_subtracts_weights_activations_and_other_tensors():
    plan = memory.plan_gpu_pool(80 * GIB, 0.9, 14 * GIB, 2 * GIB, 8 * MIB, other=GIB)
    left = int(80 * GIB * 0.9) - 17 * GIB
    assert plan.blocks == left // (8 * MIB) - 1  # one block kept for padding rows
    assert plan.pool_bytes <= left
    assert "gpu_memory_utilization" in plan.describe()


def test_gpu_rule_names_the_fix_when_no_block_fits():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization.*num_blocks"):
        memory.plan_gpu_pool(16 * GIB, 0.5, 7 * GIB, GIB, 8 * MIB)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_utilization_must_be_a_fraction(fraction):
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=fraction)


def test_cpu_rule_caps_bytes_and_blocks():
    plan = memory.plan_cpu_pool(10 * GIB, 0.5, MIB, cap_blocks=10**6)
    assert plan.budget == memory.CPU_POOL_CAP and plan.blocks == memory.CPU_POOL_CAP // MIB
    small = memory.plan_cpu_pool(100 * MIB, 0.5, MIB, cap_blocks=10**6)
    assert small.blocks == 50
    assert memory.plan_cpu_pool(10 * GIB, 0.5, MIB, cap_blocks=64).blocks == 64
    with pytest.raises(ValueError, match="pass num_blocks"):
        memory.plan_cpu_pool(MIB, 0.5, MIB, cap_blocks=64)


# ------------------------------------------------------------------ pool sizing, in an engine
def test_engine_sizes_its_pool_from_the_memory_fraction(model, tok, monkeypatch):
    per_block = memory.kv_bytes_per_block(model.config, 16, torch.float32)
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: 100 * per_block)
    engine = Engine(model, tok, gpu_memory_utilization=0.5)
    assert engine.manager.num_blocks == 50 == engine.pool_plan.blocks
    assert engine.runner.worker.cache.nbytes == 51 * per_block
    assert Engine(model, tok, num_blocks=7, gpu_memory_utilization=0.5).manager.num_blocks == 7
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: per_block)
    with pytest.raises(ValueError, match="no KV block fits"):
        Engine(model, tok, gpu_memory_utilization=0.5)


def test_llm_passes_its_knobs_to_the_engine(monkeypatch):
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: 2 * GIB)
    llm = LLM(max_num_batched_tokens=16, max_num_seqs=4, seed=3, device="cpu")
    engine = llm.engine
    assert engine.scheduler.max_num_batched_tokens == 16 and engine.scheduler.max_num_seqs == 4
    assert engine.pool_plan is not None and engine.manager.num_blocks == engine.pool_plan.blocks
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: steps.append(schedule(*args)) or steps[-1]
    llm.generate(["x " * 40, "In the beginning"], FREE, use_tqdm=False)
    assert max(b.num_tokens for b in steps if b) == 16  # the budget, filled, never exceeded
    fixed = LLM(num_gpu_blocks_override=9, device="cpu")
    assert fixed.engine.manager.num_blocks == 9 and fixed.engine.pool_plan is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles CUDA memory")
def test_cuda_profile_reads_a_positive_peak(model):
    gpu = model.to("cuda")
    total, other, peak = memory.profile_cuda(gpu, 512, 8)
    assert total > 0 and peak > 0 and other >= 0
    model.to("cpu")


def test_serve_cli_passes_the_knobs_to_the_engine(monkeypatch):
    from minillm import cli
    from minillm.serving import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda **kwargs: seen.update(kwargs))
    argv = ["serve", "--gpu-memory-utilization", "0.5", "--seed", "3"]
    cli.main([*argv, "--max-num-batched-tokens", "64"])
    config = seen["config"]
    assert config.gpu_memory_utilization == 0.5 and config.seed == 3
    assert config.max_num_batched_tokens == 64


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens=-1"),
        ({"block_size": 0}, "block_size=0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1"),
        ({"preemption_mode": "drop"}, "use 'recompute' or 'swap'"),
        ({"decode_mode": "graph"}, "decode_mode='graph'"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype='int4'"),
        ({"max_logprobs": -1}, "max_logprobs=-1"),
        ({"max_num_seq": 8}, "unknown engine setting(s) ['max_num_seq']"),
    ],
)
def test_a_bad_setting_is_refused_once_with_the_fix(settings, says):
    with pytest.raises(ValueError) as err:
        EngineConfig.of(**settings)
    assert says in str(err.value)


def test_llm_engine_and_serve_share_one_config(model, tok):
    """vLLM's names map onto ours; an Engine takes a config or its settings, not both; LLM
    checks its settings before it loads any weights."""
    config = EngineConfig.of(num_gpu_blocks_override=9, enable_prefix_caching=False)
    assert (config.num_blocks, config.prefix_cache) == (9, False)
    engine = Engine(model, tok, config)
    assert engine.config is config and engine.manager.num_blocks == 9
    assert Engine(model, tok, num_blocks=9).config == config.__class__(num_blocks=9)
    with pytest.raises(ValueError, match="not both"):
        Engine(model, tok, config, max_num_seqs=2)
    with pytest.raises(ValueError, match="unknown engine setting"):
        LLM(model="/nonexistent/checkpoint", max_num_seq=2)  # refused before loading
