"""Tensor parallelism: N ranks (gloo processes on this CPU) compute what one device does.

Logits within 1e-4 of the unsplit model, on the bundled model and on a shape that divides as
real models do (TinyLlama's 32 query heads over 4 KV heads, fewer layers); greedy tokens on
that shape, samples, logprobs and prefix hits as one rank's; each rank's share of weights
and cache; the shared-memory collectives. What both splits must do (tokens when batched,
preempted or chunked, dead and hung ranks, serve over env://) is test_parallel_engines.py.
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.bench.http_load import free_port
from minillm.engine.parallel import TensorParallel
from minillm.engine.worker import CacheSettings, Step, Worker
from minillm.model.parallel import check_divides, shard_config
from minillm.model.shapes import write_random_checkpoint
from minillm.model.weights import BUNDLED_DIR, load_config, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["In the beginning", "And the LORD said unto Moses, Speak", "Blessed are the", "Amen"]


@pytest.fixture(scope="module")
def tinyllama_dir(tmp_path_factory):
    """TinyLlama-1.1B's head layout (32 heads, 4 KV heads, width 2048, MLP 5632) with one
    layer and the bundled tokenizer's 4096-token vocabulary, in several safetensors files
    with an index (each rank finds its tensors through it)."""
    out = tmp_path_factory.mktemp("tinyllama")
    overrides = {"num_hidden_layers": 1, "vocab_size": 4096, "max_position_embeddings": 256}
    return write_random_checkpoint(
        "TinyLlama-1.1B", out, dtype=torch.float16, max_shard_bytes=2**25, **overrides
    )


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def step_logits(model_dir, size: int) -> torch.Tensor:
    """One prefill step of two prompts' chunks and a decode row, on `size` ranks."""
    model = load_model(model_dir) if size == 1 else None
    ranks = None if size == 1 else TensorParallel(model_dir, size, torch.float32, "cpu")
    model = model if ranks is None else ranks.model
    settings = CacheSettings(num_blocks=16, block_size=4)
    worker = Worker(model, settings)
    run = worker if ranks is None else ranks.attach(worker, settings)
    try:
        prompt = [5, 17, 300, 41, 9, 88, 1000, 7, 3]
        first = Step(prompt[:6], list(range(6)), [5], [], [([0, 1], 6)])
        second = Step(  # a decode row (block 2) and a chunk continuing the first prompt
            [12, *prompt[6:]], [0, 6, 7, 8], [0, 1, 2, 3], [[2]], [([0, 1, 3], 3)]
        )
        return torch.cat([run.execute(first), run.execute(second)])
    finally:
        run.close()


@pytest.mark.parametrize("size", [2, 4])
def test_split_logits_match_the_whole_model(size):
    """4 ranks of the bundled model's 2 KV heads: each KV head replicated on two ranks."""
    whole = step_logits(BUNDLED_DIR, 1)
    split = step_logits(BUNDLED_DIR, size)
    assert split.shape == whole.shape
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=0)


def test_split_logits_match_on_tinyllama_heads(tinyllama_dir):
    torch.testing.assert_close(
        step_logits(tinyllama_dir, 2), step_logits(tinyllama_dir, 1), atol=1e-4, rtol=0
    )


def test_a_vocabulary_that_does_not_divide_is_padded(tmp_path):
    model_dir = write_random_checkpoint(load_config(BUNDLED_DIR), tmp_path, vocab_size=4095)
    whole, split = step_logits(model_dir, 1), step_logits(model_dir, 2)
    assert split.shape[-1] == 4095
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=0)


def test_greedy_tokens_identical_on_tinyllama_heads(tinyllama_dir):
    expected = tokens(LLM(str(tinyllama_dir), device="cpu"))
    two = LLM(str(tinyllama_dir), device="cpu", tensor_parallel_size=2)
    try:
        assert tokens(two) == expected
    finally:
        two.close()


def test_sizes_that_do_not_divide_are_refused_with_the_sizes_that_do():
    cfg = load_config(BUNDLED_DIR)  # 4 heads, 2 KV heads, MLP 384
    with pytest.raises(ValueError, match=r"does not divide num_attention_heads=4.*\[1, 2, 4\]"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ValueError, match=">= 1"):
        check_divides(cfg, 0)
    assert shard_config(cfg, 4).num_key_value_heads == 1  # replicated, not zero


def _collectives(rank: int, size: int, port: int, path: str, out) -> None:
    import torch.distributed as dist

    from minillm.model.parallel import SharedMemoryCollectives

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    comm = SharedMemoryCollectives(path, rank, size, timeout_s=10)
    results = []
    for shape, dtype in [
        ((3, 5), torch.float32),
        ((7,), torch.bfloat16),
        ((2**21,), torch.float32),
    ]:
        x = torch.full(shape, float(rank + 1), dtype=dtype)  # the last is past a slot
        comm.all_reduce(x)
        parts = comm.all_gather(torch.arange(4.0) + 10 * rank)
        results.append((x.unique().tolist(), x.dtype, [p.tolist() for p in parts]))
    out.put((rank, results))
    dist.destroy_process_group()


def test_shared_memory_collectives_sum_and_gather_in_rank_order(tmp_path):
    from minillm.model.parallel import SharedMemoryCollectives

    size, path, ctx = 3, str(tmp_path / "shm"), torch.multiprocessing.get_context("spawn")
    SharedMemoryCollectives.create(path, size)
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collectives, args=(r, size, port, path, out)) for r in range(size)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(10)
    gathered = [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]]
    for rank in range(size):
        for (values, dtype, parts), want in zip(
            got[rank], [torch.float32, torch.bfloat16, torch.float32], strict=True
        ):
            assert values == [6.0] and dtype == want  # 1 + 2 + 3, in the tensor's own dtype
            assert parts == gathered


def test_a_recorded_decode_mode_is_refused_and_the_ranks_stop():
    with pytest.raises(ValueError, match="use 'eager' or 'static'"):
        LLM(device="cpu", tensor_parallel_size=2, decode_mode="compile")


def test_samples_logprobs_and_shared_prefixes_match_one_rank():
    """n > 1 (forked sequences sharing their prompt's blocks), seeded sampling, logprobs and
    prompt logprobs (logit rows past the sampled ones) and a prefix-cache hit, on 2 ranks."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, logprobs=2)
    params_p = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    long = "And the LORD said unto Moses, Speak unto the children of Israel, and say unto them, "
    prompts = [long * 3, "And the LORD said unto"]  # the first fills whole KV blocks

    def run(llm: LLM):
        a = llm.generate(prompts, params, use_tqdm=False)
        b = llm.generate(prompts[:1], params_p, use_tqdm=False)[0]
        texts = [[c.token_ids for c in o.outputs] for o in a]
        logprobs = [c.cumulative_logprob for o in a for c in o.outputs]
        prompt = [max(d.values(), key=lambda x: x.logprob).logprob for d in b.prompt_logprobs[1:]]
        again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]  # its blocks are cached
        return texts, logprobs, prompt, again.num_cached_tokens

    expected = run(LLM(device="cpu"))
    two = LLM(device="cpu", tensor_parallel_size=2)
    try:
        got = run(two)
    finally:
        two.close()
    assert got[0] == expected[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(got[2]), torch.tensor(expected[2]), atol=1e-4, rtol=0)
    assert got[3] == expected[3] > 0  # the second call hit the prefix cache on both


def test_each_rank_holds_its_share_of_the_weights_and_the_cache(tinyllama_dir):
    whole = load_model(tinyllama_dir)
    llm = LLM(str(tinyllama_dir), device="cpu", tensor_parallel_size=2, num_blocks=8)
    try:
        shard, cache = llm.engine.model, llm.engine.runner.worker.cache

        def linear(model) -> int:  # the norms are replicated: count the split matrices
            return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))

        assert linear(shard.model.layers) * 2 == linear(whole.model.layers)
        vocab_rows = shard.model.embed_tokens.weight.shape[0]
        assert vocab_rows * 2 == whole.config.vocab_size
        assert cache.k.shape[3] == 2  # 4 KV heads over 2 ranks
    finally:
        llm.close()
