"""Chapter 02 exercises, graded against minillm's Transformer and KVCache.

`ch02` is the module under test: `solutions.ch02_kv_cache` by default,
`exercises.ch02_kv_cache` with MINILLM_IMPL=exercises (see conftest.py). Every
test name starts with `test_ch02_<exercise>` so that `-k ch02` selects the
chapter and `-k "ch02 and sliding_window"` one exercise.

The references: a cached model must give the logits the same model gives without a
cache, on the whole sequence at once, with the mask that defines the attention
(banded for a sliding window, causal otherwise).
"""

from __future__ import annotations

import pytest
import torch

from minillm.cache import KVCache
from minillm.model import ModelConfig, Transformer

ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Transformer(cfg).eval()


def random_ids(batch: int, length: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    worst = (actual - expected).abs().amax(dim=(0, 2))  # per position
    bad = (worst > ATOL).nonzero().flatten().tolist()
    assert not bad, (
        f"{what}: logits differ from the reference at positions {bad[:10]} "
        f"(max |diff| {worst.max():.3g})"
    )


# --- kv_cache_bytes -------------------------------------------------------------------------

LLAMA_3_8B = {  # meta-llama/Meta-Llama-3-8B config.json (the keys that matter)
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
LLAMA_2_7B = {  # no num_key_value_heads: multi-head attention
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 32000,
}
QWEN3_0_6B = {  # head_dim 128 although hidden_size / heads = 64
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def test_ch02_kv_cache_bytes_llama_3_8b_is_128_kib_per_token(ch02):
    per_token = ch02.kv_cache_bytes(LLAMA_3_8B, 1, 1, torch.bfloat16)
    assert per_token == 128 * 1024, (
        f"Llama-3-8B in bf16 caches 2 * 32 layers * 8 kv heads * 128 * 2 bytes = 128 KiB per "
        f"token, got {per_token} bytes (GQA: use num_key_value_heads, not num_attention_heads)"
    )
    assert ch02.kv_cache_bytes(LLAMA_3_8B, 8192, 1, torch.bfloat16) == 2**30  # 1 GiB
    assert ch02.kv_cache_bytes(LLAMA_3_8B, 8192, 4, torch.float32) == 8 * 2**30
    assert isinstance(per_token, int)


def test_ch02_kv_cache_bytes_without_kv_heads_is_multi_head(ch02):
    got = ch02.kv_cache_bytes(LLAMA_2_7B, 1, 1, torch.float16)
    assert got == 512 * 1024, f"Llama-2-7B (MHA, 32 kv heads) is 512 KiB per token, got {got}"


def test_ch02_kv_cache_bytes_uses_explicit_head_dim(ch02):
    got = ch02.kv_cache_bytes(QWEN3_0_6B, 1, 1, torch.bfloat16)
    assert got == 2 * 28 * 8 * 128 * 2, (
        f"got {got}: this config sets head_dim = 128, not hidden_size / heads = 64; "
        "use config['head_dim'] when present"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_attention_heads=4, num_key_value_heads=2),
        dict(num_attention_heads=4, num_key_value_heads=4),
        dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24),
    ],
    ids=["gqa", "mha", "mqa-head-dim"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ch02_kv_cache_bytes_matches_minillm_allocation(ch02, kwargs, dtype):
    cfg = ModelConfig(hidden_size=64, num_hidden_layers=3, **kwargs)
    cache = KVCache(cfg, batch_size=5, max_len=37, dtype=dtype)
    got = ch02.kv_cache_bytes(cfg.to_hf(), 37, 5, dtype)
    assert got == cache.nbytes, (
        f"expected {cache.nbytes} bytes (what minillm's KVCache allocates for 5 rows of 37 "
        f"tokens in {dtype}), got {got}: K and V, every layer, kv head, position and row"
    )


# --- SlidingWindowCache ---------------------------------------------------------------------


def banded_mask(length: int, window: int) -> torch.Tensor:
    """bool [1, 1, L, L]: query i sees keys i - window + 1 .. i (the definition)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return ((j <= i) & (j > i - window))[None, None]


def window_cache(ch02, model: Transformer, batch: int, window: int, dtype=torch.float32):
    cfg = model.config
    return ch02.SlidingWindowCache(
        cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, window, dtype
    )


@torch.no_grad()
def run_in_chunks(model: Transformer, cache, ids: torch.Tensor, chunks: list[int], start=0):
    """Feed ids [B, L] at positions start.. through the cache in steps of the given sizes;
    all logits [B, L, V]."""
    assert sum(chunks) == ids.shape[1]
    out, done = [], 0
    for n in chunks:
        positions = torch.arange(start + done, start + done + n).expand(ids.shape[0], -1)
        out.append(model(ids[:, done : done + n], positions, cache=cache))
        done += n
    return torch.cat(out, dim=1)


def prefill_then_decode(prompt_len: int, length: int) -> list[int]:
    return [prompt_len] + [1] * (length - prompt_len)


@pytest.mark.parametrize(
    "window, prompt_len",
    [(8, 5), (8, 8), (8, 1), (6, 20), (1, 3), (2, 4)],
    ids=["prompt<window", "prompt=window", "decode-only", "prompt>window", "window1", "window2"],
)
def test_ch02_sliding_window_decode_matches_banded_dense_forward(ch02, model, window, prompt_len):
    """Prefill, then one token per step: each step's logits = the dense banded forward's."""
    ids = random_ids(2, 30, seed=window * 100 + prompt_len)
    with torch.no_grad():
        expected = model(ids, mask=banded_mask(30, window))
    cache = window_cache(ch02, model, 2, window)
    got = run_in_chunks(model, cache, ids, prefill_then_decode(prompt_len, 30))
    assert_logits_close(got, expected, f"window={window}, prompt of {prompt_len}")


@pytest.mark.parametrize(
    "chunks",
    [[3, 11, 1, 7, 1, 1, 4, 2], [13, 13, 1, 1, 2], [30]],
    ids=["mixed", "longer-than-window", "one-step"],
)
def test_ch02_sliding_window_chunks_of_any_size_match_banded_dense_forward(ch02, model, chunks):
    """A prompt processed in chunks (chunked prefill), some longer than the window."""
    window = 5
    ids = random_ids(2, 30, seed=7)
    with torch.no_grad():
        expected = model(ids, mask=banded_mask(30, window))
    got = run_in_chunks(model, window_cache(ch02, model, 2, window), ids, chunks)
    assert_logits_close(got, expected, f"window={window}, chunks {chunks}")


def test_ch02_sliding_window_is_not_full_attention(ch02, model):
    """Sanity of the reference itself: with a window, old tokens stop mattering."""
    window = 4
    ids = random_ids(1, 20, seed=8)
    other = ids.clone()
    other[0, :10] = (other[0, :10] + 1) % 128  # change only tokens far behind position 19
    got = [
        run_in_chunks(model, window_cache(ch02, model, 1, window), x, [3, 9, 8])
        for x in (ids, other)
    ]
    # With 2 layers, information travels back at most 2 * (window - 1) = 6 positions.
    torch.testing.assert_close(got[0][:, 19], got[1][:, 19], atol=ATOL, rtol=0)
    assert (got[0][:, 9] - got[1][:, 9]).abs().max() > 1e-2


def test_ch02_sliding_window_wide_window_equals_full_attention(ch02, model):
    """window >= length: the plain causal model, uncached and with minillm's KVCache."""
    ids = random_ids(2, 24, seed=9)
    chunks = prefill_then_decode(6, 24)
    with torch.no_grad():
        uncached = model(ids)
    dense_cache = KVCache(model.config, 2, 24)
    full = run_in_chunks(model, dense_cache, ids, chunks)
    assert_logits_close(full, uncached, "minillm KVCache (reference check)")
    for window in (24, 64):
        got = run_in_chunks(model, window_cache(ch02, model, 2, window), ids, chunks)
        assert_logits_close(got, uncached, f"window={window} >= 24 tokens")


def tensor_bytes(obj) -> int:
    """Bytes of every tensor an object holds in its attributes (lists/dicts included)."""
    seen, total = set(), 0
    stack = list(vars(obj).values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return total


def test_ch02_sliding_window_memory_is_independent_of_length(ch02, model):
    cfg, window = model.config, 8
    cache = window_cache(ch02, model, 2, window)
    expected = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * window * cfg.head_dim * 4
    assert cache.nbytes == expected, (
        f"nbytes = {cache.nbytes}: expected 2 (K, V) x layers x batch x kv_heads x window x "
        f"head_dim x 4 bytes = {expected}"
    )
    ids = random_ids(2, 100, seed=10)
    run_in_chunks(model, cache, ids[:, :20], prefill_then_decode(12, 20))
    after_20 = tensor_bytes(cache)
    run_in_chunks(model, cache, ids[:, 20:], [1] * 5 + [15] * 5, start=20)
    assert cache.nbytes == expected
    assert tensor_bytes(cache) == after_20, (
        f"the cache holds {tensor_bytes(cache)} bytes of tensors after 100 tokens but "
        f"{after_20} after 20: a sliding-window cache must not grow with the sequence"
    )
    assert after_20 < 2 * expected, "the cache holds much more than its K and V buffers"
    half = window_cache(ch02, model, 2, window, torch.bfloat16)
    assert half.nbytes == expected // 2, "a bf16 cache takes half the bytes of an fp32 one"


def test_ch02_sliding_window_long_run_matches_banded_dense_forward(ch02, model):
    """Many laps of the ring: 48 tokens through a window of 7."""
    ids = random_ids(1, 48, seed=11)
    with torch.no_grad():
        expected = model(ids, mask=banded_mask(48, 7))
    got = run_in_chunks(model, window_cache(ch02, model, 1, 7), ids, [10] + [1] * 38)
    assert_logits_close(got, expected, "48 tokens, window=7")


def test_ch02_sliding_window_rejects_window_below_one(ch02, model):
    with pytest.raises(ValueError):
        window_cache(ch02, model, 1, 0)


# --- fork_cache -----------------------------------------------------------------------------


@torch.no_grad()
def uncached_last_logits(model: Transformer, seq: list[int], n: int) -> torch.Tensor:
    """The logits of the last n positions of one sequence, run whole without a cache."""
    return model(torch.tensor([seq]))[0, -n:]


@torch.no_grad()
def decode(model: Transformer, cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Feed tokens [B, n] one per step from position `start`; logits [B, n, V]."""
    out = []
    for i in range(tokens.shape[1]):
        pos = torch.full((tokens.shape[0], 1), start + i)
        out.append(model(tokens[:, i : i + 1], pos, cache=cache))
    return torch.cat(out, dim=1)


def test_ch02_fork_cache_one_prompt_into_n_samples(ch02, model):
    """Prefill once, fork into 3 rows, decode different tokens: each row = its own sequence."""
    prompt = random_ids(1, 7, seed=12)
    cache = KVCache(model.config, 1, 16)
    with torch.no_grad():
        model(prompt, cache=cache)
    forked = ch02.fork_cache(cache, [0, 0, 0])
    assert type(forked) is type(cache), "fork_cache must return the same kind of cache"
    assert forked.k.shape[1] == 3 and forked.v.shape[1] == 3, "batch is dim 1 of k and v"
    tokens = random_ids(3, 4, seed=13)
    got = decode(model, forked, tokens, start=7)
    for row in range(3):
        seq = prompt[0].tolist() + tokens[row].tolist()
        assert_logits_close(
            got[row : row + 1], uncached_last_logits(model, seq, 4)[None], f"forked row {row}"
        )


@pytest.mark.parametrize("parents", [[2, 0, 2, 1], [3, 3], [1, 0, 3, 2, 0, 1]])
def test_ch02_fork_cache_reorders_rows_with_repeats(ch02, model, parents):
    """Beam search: keep some beams twice, drop others, continue each from its parent."""
    prompts = random_ids(4, 9, seed=14)
    cache = KVCache(model.config, 4, 16)
    with torch.no_grad():
        model(prompts, cache=cache)
    forked = ch02.fork_cache(cache, torch.tensor(parents))
    tokens = random_ids(len(parents), 3, seed=15)
    got = decode(model, forked, tokens, start=9)
    for row, parent in enumerate(parents):
        seq = prompts[parent].tolist() + tokens[row].tolist()
        assert_logits_close(
            got[row : row + 1],
            uncached_last_logits(model, seq, 3)[None],
            f"row {row} of the fork (parent row {parent})",
        )


def test_ch02_fork_cache_leaves_the_original_untouched(ch02, model):
    """The rows must own their memory: decoding into the fork cannot write the original."""
    prompts = random_ids(2, 6, seed=16)
    cache = KVCache(model.config, 2, 12)
    with torch.no_grad():
        model(prompts, cache=cache)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    kv_len = cache.kv_len
    for parents in ([0, 1], [1, 1, 1]):
        forked = ch02.fork_cache(cache, parents)
        assert forked is not cache
        decode(model, forked, random_ids(len(parents), 3, seed=17), start=6)
        assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before), (
            f"fork_cache(cache, {parents}) shares memory with the original: decoding into the "
            "fork changed it (copy with index_select / advanced indexing, not a view)"
        )
        assert cache.k.shape[1] == 2 and cache.kv_len == kv_len
        assert forked.kv_len == kv_len and forked.max_len == cache.max_len
    # And the original still decodes its own continuation correctly.
    tokens = random_ids(2, 2, seed=18)
    got = decode(model, cache, tokens, start=6)
    for row in range(2):
        seq = prompts[row].tolist() + tokens[row].tolist()
        assert_logits_close(
            got[row : row + 1], uncached_last_logits(model, seq, 2)[None], f"original row {row}"
        )


def test_ch02_fork_cache_rejects_bad_rows(ch02, model):
    cache = KVCache(model.config, 2, 8)
    for bad in ([2], [0, -1], []):
        with pytest.raises(ValueError):
            ch02.fork_cache(cache, bad)


# --- cache_update ---------------------------------------------------------------------------


def loop_update(cache_k, cache_v, k, v, positions) -> None:
    """The definition, one token at a time."""
    for b in range(k.shape[0]):
        for t in range(k.shape[2]):
            cache_k[b, :, positions[b, t]] = k[b, :, t].to(cache_k.dtype)
            cache_v[b, :, positions[b, t]] = v[b, :, t].to(cache_v.dtype)


@pytest.mark.parametrize(
    "positions",
    [[[0, 1, 2, 3], [0, 1, 2, 3]], [[5], [2]], [[7, 8], [3, 4]], [[9], [0]]],
    ids=["prefill", "decode", "chunk", "first-and-last-slot"],
)
def test_ch02_cache_update_writes_each_row_at_its_positions(ch02, positions):
    positions = torch.tensor(positions)
    b, t = positions.shape
    k = torch.randn(b, 2, t, 8, generator=torch.Generator().manual_seed(20))
    v = torch.randn(b, 2, t, 8, generator=torch.Generator().manual_seed(21))
    cache_k, cache_v = torch.full((b, 2, 10, 8), float("nan")), torch.full((b, 2, 10, 8), -7.0)
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    k_ptr = cache_k.data_ptr()
    ch02.cache_update(cache_k, cache_v, k, v, positions)
    loop_update(ref_k, ref_v, k, v, positions)
    assert cache_k.data_ptr() == k_ptr, "write into the buffers (in place), do not rebind them"
    torch.testing.assert_close(
        cache_k, ref_k, equal_nan=True, msg="K: slot positions[b, t] of row b"
    )
    torch.testing.assert_close(cache_v, ref_v, msg="V: slot positions[b, t] of row b")


def test_ch02_cache_update_writes_through_a_layer_view_in_the_caches_dtype(ch02):
    """`KVCache.k[layer]` is a view: writing into it must change the cache; bf16 storage."""
    cache_k = torch.zeros(3, 1, 2, 6, 4, dtype=torch.bfloat16)  # [layers, B, KV, max_len, d]
    cache_v = torch.zeros(3, 1, 2, 6, 4, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    ch02.cache_update(cache_k[1], cache_v[1], k, v, torch.tensor([[2, 3]]))
    assert cache_k.dtype == torch.bfloat16
    torch.testing.assert_close(cache_k[1, :, :, 2:4], k.to(torch.bfloat16))
    torch.testing.assert_close(cache_v[1, :, :, 2:4], v.to(torch.bfloat16))
    assert not cache_k[0].any() and not cache_k[2].any(), "other layers untouched"
    assert not cache_k[1, :, :, [0, 1, 4, 5]].any(), "other slots untouched"


class UpdateCache(KVCache):
    """minillm's KVCache with the learner's cache_update in its update."""

    def __init__(self, fn, *args) -> None:
        super().__init__(*args)
        self.fn = fn

    def update(self, layer, k, v, positions):
        self.fn(self.k[layer], self.v[layer], k, v, positions)
        return self.k[layer, :, :, : self.kv_len], self.v[layer, :, :, : self.kv_len]


def test_ch02_cache_update_drives_the_model(ch02, model):
    """Prefill two prompts of different lengths, then decode: logits = the uncached model's."""
    prompts = [random_ids(1, 6, seed=22)[0].tolist(), random_ids(1, 3, seed=23)[0].tolist()]
    steps = random_ids(2, 4, seed=24)
    cache = UpdateCache(ch02.cache_update, model.config, 2, 12)
    ids = torch.zeros(2, 6, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    got = []
    with torch.no_grad():
        cache.kv_len = 6
        prefill = model(ids, cache=cache)
        lengths = torch.tensor([6, 3])
        for i in range(steps.shape[1]):
            cache.kv_len = int(lengths.max()) + i + 1
            got.append(model(steps[:, i : i + 1], (lengths + i)[:, None], cache=cache)[:, -1])
    got = torch.stack(got, dim=1)  # [2, 4, vocab]
    for b, p in enumerate(prompts):
        want = uncached_last_logits(model, p + steps[b].tolist(), 4 + len(p))
        assert_logits_close(prefill[b : b + 1, : len(p)], want[None, : len(p)], f"prefill row {b}")
        assert_logits_close(got[b : b + 1], want[None, len(p) :], f"decode row {b}")


# --- decode_step ----------------------------------------------------------------------------


@torch.no_grad()
def prefill_rows(model: Transformer, prompts: list[list[int]], max_len: int):
    """minillm's prefill: prompts right-padded in one batch; (cache, last logits, lengths)."""
    cache = KVCache(model.config, len(prompts), max_len)
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    cache.kv_len = longest
    lengths = torch.tensor([len(p) for p in prompts])
    logits = model(ids, cache=cache)[torch.arange(len(prompts)), lengths - 1]
    return cache, logits, lengths


def test_ch02_decode_step_greedy_matches_the_uncached_model(ch02, model):
    """Three prompts of different lengths, 8 greedy steps: every step's logits and tokens
    equal a full forward over each row's whole sequence."""
    prompts = [random_ids(1, n, seed=30 + n)[0].tolist() for n in (5, 9, 2)]
    cache, logits, lengths = prefill_rows(model, prompts, 9 + 8)
    seqs = [list(p) for p in prompts]
    for step in range(8):
        tokens = logits.argmax(-1)
        for b in range(3):
            seqs[b].append(int(tokens[b]))
        positions = lengths + step
        before = positions.clone()
        logits = ch02.decode_step(model, cache, tokens, positions)
        assert logits.shape == (3, model.config.vocab_size), (
            f"logits {tuple(logits.shape)}: one row of vocab logits per sequence, [B, vocab]"
        )
        assert torch.equal(positions, before), "do not change the positions you are given"
        for b in range(3):
            want = uncached_last_logits(model, seqs[b], 1)
            assert_logits_close(logits[b : b + 1, None], want[None], f"step {step}, row {b}")


def test_ch02_decode_step_reads_only_the_filled_slots(ch02, model):
    """kv_len: the longest row's slots so far, this token's included, not max_len."""
    cache, logits, lengths = prefill_rows(model, [[1, 2, 3, 4], [5, 6]], 32)
    ch02.decode_step(model, cache, logits.argmax(-1), lengths)
    assert cache.kv_len == 5, (
        f"cache.kv_len = {cache.kv_len} after a step at positions {lengths.tolist()}: "
        "set it to max(positions) + 1 (attention reads that many slots)"
    )


def test_ch02_decode_step_records_no_autograd_graph(ch02, model):
    cache, logits, lengths = prefill_rows(model, [[1, 2, 3]], 8)
    out = ch02.decode_step(model, cache, logits.argmax(-1), lengths)
    assert not out.requires_grad, "run the step under torch.inference_mode()"
