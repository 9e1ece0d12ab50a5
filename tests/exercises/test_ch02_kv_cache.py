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

from exercises.feedback import assert_close, worst
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


def assert_logits_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, hint: str = ""
) -> None:
    hint = f"; hint: {hint}" if hint else ""
    assert actual.shape == expected.shape, (
        f"{what}: expected logits of shape {tuple(expected.shape)}, got {tuple(actual.shape)}{hint}"
    )
    per_position = (actual - expected).abs().amax(dim=(0, 2))
    bad = (per_position > ATOL).nonzero().flatten().tolist()
    assert not bad, (
        f"{what}: expected the reference's logits, got logits that differ at positions "
        f"{bad[:10]} (max |diff| {per_position.max():.3g}, {ATOL} allowed){hint}"
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
        f"kv_cache_bytes(Llama-3-8B, 1 token, batch 1, bf16): expected {128 * 1024} bytes "
        f"(2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB), got {per_token} bytes; hint: "
        "2 for K and V, and GQA: use num_key_value_heads, not num_attention_heads"
    )
    got = ch02.kv_cache_bytes(LLAMA_3_8B, 8192, 1, torch.bfloat16)
    assert got == 2**30, (  # 1 GiB
        f"kv_cache_bytes(Llama-3-8B, 8192 tokens, batch 1, bf16): expected {2**30} bytes "
        f"(1 GiB), got {got}; hint: the bytes of one token times the number of tokens"
    )
    got = ch02.kv_cache_bytes(LLAMA_3_8B, 8192, 4, torch.float32)
    assert got == 8 * 2**30, (
        f"kv_cache_bytes(Llama-3-8B, 8192 tokens, batch 4, fp32): expected {8 * 2**30} bytes "
        f"(8 GiB), got {got}; hint: bytes per element from the dtype (dtype.itemsize: 4 for "
        "fp32), and times the batch"
    )
    assert isinstance(per_token, int), (
        f"kv_cache_bytes(Llama-3-8B, 1 token, batch 1, bf16): expected an int, got "
        f"{type(per_token).__name__} {per_token!r}; hint: bytes are whole numbers: multiply "
        "ints (dtype.itemsize, // for head_dim), do not divide with /"
    )


def test_ch02_kv_cache_bytes_without_kv_heads_is_multi_head(ch02):
    got = ch02.kv_cache_bytes(LLAMA_2_7B, 1, 1, torch.float16)
    assert got == 512 * 1024, (
        f"kv_cache_bytes(Llama-2-7B, 1 token, batch 1, fp16): expected {512 * 1024} bytes "
        f"(512 KiB: multi-head, 32 kv heads), got {got}; hint: this config has no "
        "num_key_value_heads: then every query head has its own kv head"
    )


def test_ch02_kv_cache_bytes_uses_explicit_head_dim(ch02):
    got = ch02.kv_cache_bytes(QWEN3_0_6B, 1, 1, torch.bfloat16)
    assert got == 2 * 28 * 8 * 128 * 2, (
        f"kv_cache_bytes(Qwen3-0.6B, 1 token, batch 1, bf16): expected {2 * 28 * 8 * 128 * 2} "
        f"bytes, got {got}; hint: this config sets head_dim = 128, not hidden_size / heads = "
        "64: use config['head_dim'] when present"
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
        f"kv_cache_bytes(3 layers, hidden 64, {kwargs}, 37 tokens, batch 5, {dtype}): "
        f"expected {cache.nbytes} bytes (what minillm's KVCache allocates), got {got}; hint: "
        "K and V, every layer, kv head, position and row; head_dim from the config if it has one"
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
    assert sum(chunks) == ids.shape[1], f"test set-up: chunks {chunks} != {ids.shape[1]} tokens"
    out, done = [], 0
    for n in chunks:
        positions = torch.arange(start + done, start + done + n).expand(ids.shape[0], -1)
        out.append(model(ids[:, done : done + n], positions, cache=cache))
        done += n
    return torch.cat(out, dim=1)


def prefill_then_decode(prompt_len: int, length: int) -> list[int]:
    return [prompt_len] + [1] * (length - prompt_len)


WINDOW_HINT = (
    "query at position p sees positions p - window + 1 .. p: attend over the ring as it was "
    "plus this step's tokens, masking slots by the position each one holds (slot = p % window)"
)


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
    assert_logits_close(
        got,
        expected,
        f"SlidingWindowCache(window={window}), a prompt of {prompt_len} then 1 token a step, "
        "vs the banded dense forward",
        WINDOW_HINT,
    )


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
    assert_logits_close(
        got,
        expected,
        f"SlidingWindowCache(window={window}) fed in chunks {chunks} vs the banded dense forward",
        "read the ring before writing it: a chunk longer than the window needs its own early "
        "tokens, then only its last window tokens are stored",
    )


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
    assert_close(
        got[0][:, 19],
        got[1][:, 19],
        "SlidingWindowCache(window=4): logits at position 19 after a change to tokens 0..9",
        "position 19 must not see positions older than 19 - window + 1: mask ring slots by "
        "the position they hold, and empty slots too",
        atol=ATOL,
        rtol=0,
    )
    moved = (got[0][:, 9] - got[1][:, 9]).abs().max()
    assert moved > 1e-2, (
        f"SlidingWindowCache(window=4): expected position 9's logits to change with tokens "
        f"0..9, got max |diff| {float(moved):.3g}; hint: a query must see its own token and "
        "the window - 1 before it"
    )


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
        assert_logits_close(
            got,
            uncached,
            f"SlidingWindowCache(window={window}) over 24 tokens vs the plain causal model",
            "with window >= length no token leaves the band: every earlier position is seen",
        )


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
    case = (
        f"SlidingWindowCache({cfg.num_hidden_layers} layers, batch 2, "
        f"{cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}, window {window}, fp32)"
    )
    assert cache.nbytes == expected, (
        f"{case}.nbytes: expected {expected}, got {cache.nbytes}; hint: 2 (K, V) x layers x "
        "batch x kv_heads x window x head_dim x 4 bytes"
    )
    ids = random_ids(2, 100, seed=10)
    run_in_chunks(model, cache, ids[:, :20], prefill_then_decode(12, 20))
    after_20 = tensor_bytes(cache)
    run_in_chunks(model, cache, ids[:, 20:], [1] * 5 + [15] * 5, start=20)
    assert cache.nbytes == expected, (
        f"{case}.nbytes after 100 tokens: expected {expected} (as at the start), got "
        f"{cache.nbytes}; hint: K and V keep their window slots: never reallocate them"
    )
    assert tensor_bytes(cache) == after_20, (
        f"{case}: expected its tensors to hold {after_20} bytes after 100 tokens (as after "
        f"20), got {tensor_bytes(cache)}; hint: a sliding-window cache must not grow: write "
        "into the ring's slots, never keep a torch.cat of old and new K/V"
    )
    assert after_20 < 2 * expected, (
        f"{case}: expected its tensors to take about {expected} bytes (K and V), got "
        f"{after_20} after 20 tokens; hint: keep K and V [layers, batch, kv_heads, window, "
        "head_dim] and at most a small table of the position in each slot"
    )
    half = window_cache(ch02, model, 2, window, torch.bfloat16)
    assert half.nbytes == expected // 2, (
        f"{case} in bf16: expected nbytes {expected // 2} (half of fp32's), got {half.nbytes}; "
        "hint: allocate K and V in the dtype argument and count bytes from the tensors"
    )


def test_ch02_sliding_window_long_run_matches_banded_dense_forward(ch02, model):
    """Many laps of the ring: 48 tokens through a window of 7."""
    ids = random_ids(1, 48, seed=11)
    with torch.no_grad():
        expected = model(ids, mask=banded_mask(48, 7))
    got = run_in_chunks(model, window_cache(ch02, model, 1, 7), ids, [10] + [1] * 38)
    assert_logits_close(
        got,
        expected,
        "SlidingWindowCache(window=7), a prompt of 10 then 38 steps (laps of the ring), vs the "
        "banded dense forward",
        "slot = position % window; track which position each slot holds, so that overwritten "
        "and too-old slots are masked",
    )


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
    case = "fork_cache(KVCache of 1 row, [0, 0, 0])"
    assert type(forked) is type(cache), (
        f"{case}: expected a {type(cache).__name__}, got a {type(forked).__name__}; hint: "
        "return the same kind of cache (a copy of the object, with new k and v)"
    )
    for name in ("k", "v"):
        shape = tuple(getattr(forked, name).shape)
        assert shape[1] == 3, (
            f"{case}: expected {name} with 3 rows on dim 1, got {name} of shape {shape}; "
            "hint: the cache's k and v are [layers, batch, kv_heads, max_len, head_dim]: "
            "select rows along dim 1"
        )
    tokens = random_ids(3, 4, seed=13)
    got = decode(model, forked, tokens, start=7)
    for row in range(3):
        seq = prompt[0].tolist() + tokens[row].tolist()
        assert_logits_close(
            got[row : row + 1],
            uncached_last_logits(model, seq, 4)[None],
            f"{case}: row {row} decoding 4 tokens of its own vs its sequence without a cache",
            "row i of the fork must be a full copy of row parent_rows[i], every layer, with "
            "kv_len and the rest of the cache's state carried over",
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
            f"fork_cache(cache of 4 rows, {parents}): row {row} (parent row {parent}) decoding "
            "vs its sequence without a cache",
            "row i of the fork is row parent_rows[i] of the cache, in that order; a repeated "
            "parent gives two independent copies",
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
        case = f"fork_cache(cache of 2 rows, {parents})"
        assert forked is not cache, (
            f"{case}: expected a new cache, got the original object back; hint: copy the "
            "cache (copy.copy) and give the copy its own k and v"
        )
        decode(model, forked, random_ids(len(parents), 3, seed=17), start=6)
        for name, before in (("k", k_before), ("v", v_before)):
            after = getattr(cache, name)
            assert torch.equal(after, before), (
                f"{case}: decoding into the fork changed the original's {name}: "
                f"{worst(after, before)}; hint: the fork shares memory with the original: "
                "copy with index_select / advanced indexing, not a view or the same tensor"
            )
        assert cache.k.shape[1] == 2, (
            f"{case}: expected the original to keep 2 rows, got k of shape "
            f"{tuple(cache.k.shape)}; hint: set the new k and v on the copy, not on `cache`"
        )
        assert cache.kv_len == kv_len, (
            f"{case}: expected the original's kv_len to stay {kv_len}, got {cache.kv_len}; "
            "hint: change attributes on the copy only"
        )
        assert forked.kv_len == kv_len, (
            f"{case}: expected the fork's kv_len {kv_len} (the original's), got "
            f"{forked.kv_len}; hint: the fork continues where the original is: keep its state"
        )
        assert forked.max_len == cache.max_len, (
            f"{case}: expected the fork's max_len {cache.max_len}, got {forked.max_len}; "
            "hint: copy every row's max_len slots, not only the filled ones"
        )
    # And the original still decodes its own continuation correctly.
    tokens = random_ids(2, 2, seed=18)
    got = decode(model, cache, tokens, start=6)
    for row in range(2):
        seq = prompts[row].tolist() + tokens[row].tolist()
        assert_logits_close(
            got[row : row + 1],
            uncached_last_logits(model, seq, 2)[None],
            f"the original cache after two fork_cache calls: row {row} decoding vs its "
            "sequence without a cache",
            "the forks must own their memory, so that nothing written into them reaches the "
            "original",
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
    case = f"cache_update(positions {positions.tolist()})"
    assert cache_k.data_ptr() == k_ptr, (
        f"{case}: expected cache_k to keep its memory, got new storage; hint: write into the "
        "buffers in place (cache_k[...] = ...), do not replace them"
    )
    hint = (
        "token t of row b goes to slot positions[b, t] of row b, all kv heads; no other slot "
        "changes (advanced indexing [rows, :, positions] puts the indexed dims first)"
    )
    assert_close(cache_k, ref_k, f"{case}: cache_k", hint, equal_nan=True)
    assert_close(cache_v, ref_v, f"{case}: cache_v", hint)


def test_ch02_cache_update_writes_through_a_layer_view_in_the_caches_dtype(ch02):
    """`KVCache.k[layer]` is a view: writing into it must change the cache; bf16 storage."""
    cache_k = torch.zeros(3, 1, 2, 6, 4, dtype=torch.bfloat16)  # [layers, B, KV, max_len, d]
    cache_v = torch.zeros(3, 1, 2, 6, 4, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    ch02.cache_update(cache_k[1], cache_v[1], k, v, torch.tensor([[2, 3]]))
    case = "cache_update(layer 1's view of a bf16 cache [3, 1, 2, 6, 4], positions [[2, 3]])"
    assert cache_k.dtype == torch.bfloat16, (
        f"{case}: expected the cache to stay torch.bfloat16, got {cache_k.dtype}; hint: "
        "write into the view in place, never replace the cache's storage"
    )
    hint = "write into the view passed in, in place, casting k and v with .to(cache_k.dtype)"
    assert_close(cache_k[1, :, :, 2:4], k.to(torch.bfloat16), f"{case}: K slots 2, 3", hint)
    assert_close(cache_v[1, :, :, 2:4], v.to(torch.bfloat16), f"{case}: V slots 2, 3", hint)
    for layer in (0, 2):
        assert not cache_k[layer].any(), (
            f"{case}: expected layer {layer} untouched (all 0), got "
            f"{int(cache_k[layer].count_nonzero())} nonzero values; hint: write only into the "
            "[B, KV, max_len, d] view you are given"
        )
    others = cache_k[1, :, :, [0, 1, 4, 5]]
    assert not others.any(), (
        f"{case}: expected slots 0, 1, 4, 5 untouched (all 0), got "
        f"{int(others.count_nonzero())} nonzero values; hint: token t goes to slot "
        "positions[b, t] only"
    )


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
        hint = "each row writes its tokens at its own positions (row b, slot positions[b, t])"
        assert_logits_close(
            prefill[b : b + 1, : len(p)],
            want[None, : len(p)],
            f"KVCache with your cache_update: prefill of row {b} ({len(p)} tokens) vs uncached",
            hint,
        )
        assert_logits_close(
            got[b : b + 1],
            want[None, len(p) :],
            f"KVCache with your cache_update: 4 decode steps of row {b} (from position "
            f"{len(p)}) vs uncached",
            hint,
        )


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
        case = f"decode_step(3 rows at positions {before.tolist()}, greedy step {step})"
        assert logits.shape == (3, model.config.vocab_size), (
            f"{case}: expected logits of shape {(3, model.config.vocab_size)}, got "
            f"{tuple(logits.shape)}; hint: the model returns [B, 1, vocab] for one token per "
            "row: return that position's logits, [B, vocab]"
        )
        assert torch.equal(positions, before), (
            f"{case}: expected the positions tensor unchanged, got {positions.tolist()}; hint: "
            "do not change the positions you are given (no in-place += on them)"
        )
        for b in range(3):
            want = uncached_last_logits(model, seqs[b], 1)
            assert_logits_close(
                logits[b : b + 1, None],
                want[None],
                f"{case}: row {b} vs the uncached model on its whole sequence",
                "feed tokens [B, 1] at positions [B, 1], each row's own, with cache.kv_len = "
                "the slots filled so far, this token's included",
            )


def test_ch02_decode_step_reads_only_the_filled_slots(ch02, model):
    """kv_len: the longest row's slots so far, this token's included, not max_len."""
    cache, logits, lengths = prefill_rows(model, [[1, 2, 3, 4], [5, 6]], 32)
    ch02.decode_step(model, cache, logits.argmax(-1), lengths)
    assert cache.kv_len == 5, (
        f"decode_step(2 rows at positions {lengths.tolist()}, max_len 32): expected "
        f"cache.kv_len = 5, got {cache.kv_len}; hint: set it to max(positions) + 1 (attention "
        "reads that many slots), not max_len"
    )


def test_ch02_decode_step_records_no_autograd_graph(ch02, model):
    cache, logits, lengths = prefill_rows(model, [[1, 2, 3]], 8)
    out = ch02.decode_step(model, cache, logits.argmax(-1), lengths)
    assert not out.requires_grad, (
        f"decode_step: expected logits with no autograd graph, got requires_grad=True "
        f"({type(out.grad_fn).__name__}); hint: run the step under torch.inference_mode()"
    )
