"""Triton paged decode and flash prefill against dense attention (torch SDPA), fp32.

On a CPU they run in Triton's interpreter (minillm.kernels turns it on); skipped with the
reason when Triton can run neither on a GPU nor in the interpreter. Shapes stay small:
the interpreter executes every program instance in Python.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels import triton_status

OK, HOW = triton_status()
pytestmark = pytest.mark.skipif(not OK, reason=f"Triton unavailable: {HOW}")
DEVICE = "cuda" if HOW == "cuda" else "cpu"
ATOL = 1e-5


def paged_case(lens, heads, kv_heads, head_dim, block_size, seed=0):
    """Random K/V for sequences of `lens` tokens, scattered over a shuffled pool, plus
    the same K/V laid out densely [B, kv_heads, S, D] for SDPA."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lens), max(lens)
    k = torch.randn(B, kv_heads, S, head_dim, generator=g)
    v = torch.randn(B, kv_heads, S, head_dim, generator=g)
    q = torch.randn(B, heads, head_dim, generator=g)
    width = -(-S // block_size)
    num_blocks = B * width + 3  # spare blocks: the tables must be honoured, not assumed
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: B * width].view(B, width)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)  # junk
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    for b, n in enumerate(lens):
        for t in range(n):
            blk, off = tables[b, t // block_size], t % block_size
            k_pool[blk, off], v_pool[blk, off] = k[b, :, t], v[b, :, t]
    lens_t = torch.tensor(lens)
    to = [x.to(DEVICE) for x in (q, k_pool, v_pool, tables, lens_t, k, v)]
    return to


def dense_decode(q, k, v, lens):
    """SDPA of each sequence's one query over its first lens[b] keys."""
    mask = torch.arange(k.shape[2], device=k.device) < lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None], enable_gqa=True
    )
    return out[:, :, 0]


@pytest.mark.parametrize(
    "lens, heads, kv_heads, head_dim, block_size",
    [
        ([1, 7, 8, 9], 4, 2, 16, 8),  # around one block boundary, GQA 2
        ([33, 5, 16], 6, 2, 8, 16),  # odd lengths, GQA 3 (a group that is no power of 2)
        ([17, 31], 8, 1, 32, 4),  # multi-query attention, many small blocks
        ([3, 40], 2, 2, 24, 32),  # multi-head, head_dim not a power of two
    ],
)
@pytest.mark.parametrize("num_splits", [1, 2, 3, None])  # None: choose_splits decides
def test_paged_decode_matches_sdpa(lens, heads, kv_heads, head_dim, block_size, num_splits):
    """With and without split-K: 3 splits of a short row leave whole splits empty (past the
    row's blocks), which the merge must weigh as nothing."""
    from minillm.kernels.paged_attention import paged_attention, paged_attention_ref

    q, k_pool, v_pool, tables, lens_t, k, v = paged_case(
        lens, heads, kv_heads, head_dim, block_size
    )
    expected = dense_decode(q, k, v, lens_t)
    torch.testing.assert_close(
        paged_attention_ref(q, k_pool, v_pool, tables, lens_t), expected, atol=ATOL, rtol=0
    )
    out = paged_attention(q, k_pool, v_pool, tables, lens_t, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tile, num_splits", [(32, 1), (32, 3), (64, 2)])
def test_paged_decode_tiles_span_several_blocks(tile, num_splits):
    """A tile of 32 tokens over blocks of 4 reads 8 blocks per iteration, each through its
    own table entry; a split boundary may fall inside a tile's reach."""
    from minillm.kernels.paged_attention import paged_attention

    q, k_pool, v_pool, tables, lens, k, v = paged_case([37, 5, 64], 6, 2, 16, 4, seed=3)
    out = paged_attention(q, k_pool, v_pool, tables, lens, num_splits=num_splits, tile=tile)
    torch.testing.assert_close(out, dense_decode(q, k, v, lens), atol=ATOL, rtol=0)


def test_choose_splits_fills_the_machine_without_tiny_splits():
    from minillm.kernels.paged_attention import choose_splits

    cpu = torch.device("cpu")
    assert choose_splits(1, 1, 512, cpu) == 8  # batch 1, long context: split
    assert choose_splits(64, 2, 512, cpu) == 1  # the batch already gives enough programs
    assert choose_splits(1, 1, 12, cpu) == 1  # 12 blocks: a split needs 8 of them


def test_paged_decode_rejects_bad_shapes():
    from minillm.kernels.paged_attention import paged_attention

    q, k_pool, v_pool, tables, lens, _, _ = paged_case([3, 5], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], k_pool, v_pool, tables, lens)
    with pytest.raises(RuntimeError, match="context_lens"):  # checked on the device
        paged_attention(q, k_pool, v_pool, tables, lens * 0)
    with pytest.raises(ValueError, match="tile=24"):
        paged_attention(q, k_pool, v_pool, tables, lens, tile=24)


@pytest.mark.parametrize(
    "B, heads, kv_heads, T, D, block",
    [
        (2, 4, 2, 37, 16, 16),  # odd length: a ragged last tile
        (1, 6, 2, 16, 8, 16),  # exactly one tile, head_dim padded to 16
        (1, 3, 3, 5, 32, 16),  # shorter than a tile
        (1, 4, 1, 50, 16, 32),  # multi-query, bigger tiles
    ],
)
def test_flash_prefill_matches_causal_sdpa(B, heads, kv_heads, T, D, block):
    from minillm.kernels.flash_prefill import flash_prefill

    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = flash_prefill(q, k, v, block_m=block, block_n=block)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    # the scale argument is honoured, not assumed
    out = flash_prefill(q, k, v, scale=0.5 / math.sqrt(D), block_m=block, block_n=block)
    expected = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, scale=0.5 / math.sqrt(D)
    )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_the_kernels_run_in_fp16():
    """fp16 is the dtype on a T4 (no bf16 tensor cores), so both kernels must take it:
    fp16 inputs, fp32 accumulation inside, fp16 out, as close to fp32 SDPA as fp16 allows."""
    from minillm.kernels.flash_prefill import flash_prefill
    from minillm.kernels.paged_attention import paged_attention

    q, k_pool, v_pool, tables, lens, k, v = paged_case([9, 30], 6, 2, 16, 8, seed=5)
    half = [x.half() for x in (q, k_pool, v_pool)]
    out = paged_attention(half[0], half[1], half[2], tables, lens, num_splits=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_decode(q, k, v, lens), atol=2e-3, rtol=0)

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 21, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = flash_prefill(q.half(), k.half(), v.half(), block_m=16, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=0)


def test_flash_prefill_rejects_bad_tiles():
    from minillm.kernels.flash_prefill import flash_prefill

    q = torch.zeros(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="powers of two"):
        flash_prefill(q, q, q, block_m=8)


def _prefilled(model, prompts, use_kernel=False):
    """A paged cache holding the prompts' K/V, written by the model in one forward (all
    prompts as chunks of one row), and their sequences' block tables."""
    from minillm.cache import BlockManager, PagedKVCache
    from minillm.cache.block_manager import PagedSequence

    m = BlockManager(16, 4)
    cache = PagedKVCache(model.config, 16, 4, device=DEVICE, use_kernel=use_kernel)
    seqs = [PagedSequence(list(p)) for p in prompts]
    for s in seqs:
        m.allocate(s)
    cache.plan(decode=[], chunks=[(s.block_table, len(s)) for s in seqs])
    ids = torch.tensor([[t for p in prompts for t in p]], device=DEVICE)
    pos = torch.tensor([[i for p in prompts for i in range(len(p))]], device=DEVICE)
    with torch.inference_mode():
        model.to(DEVICE)(ids, pos, cache=cache)
    return m, cache, seqs


def test_paged_decode_on_the_models_cache(model, prompts):
    """The Triton kernel reads a PagedKVCache filled by the model exactly as the
    reference gather does."""
    from minillm.kernels.paged_attention import paged_attention, paged_attention_ref

    cfg = model.config
    _, cache, seqs = _prefilled(model, prompts)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs])
    lens = torch.tensor([len(p) for p in prompts])
    q = torch.randn(len(prompts), cfg.num_attention_heads, cfg.head_dim)
    k_pool, v_pool = cache.k[1].cpu(), cache.v[1].cpu()
    ref = paged_attention_ref(q, k_pool, v_pool, tables, lens)
    got = paged_attention(*(x.to(DEVICE) for x in (q, k_pool, v_pool, tables, lens)))
    torch.testing.assert_close(got.cpu(), ref, atol=ATOL, rtol=0)


def test_a_mixed_step_attends_the_same_with_the_kernel_or_a_gather(model, prompts):
    """One step of decode rows (through the Triton kernel, or gathered for SDPA) and a
    prompt chunk, in one row: the two caches' attention outputs agree, and both equal SDPA
    over each sequence's own cached keys."""
    cfg = model.config
    _, plain, seqs = _prefilled(model, prompts[:2], use_kernel=False)
    m, kernel, _ = _prefilled(model, prompts[:2], use_kernel=True)
    for s in seqs:
        s.token_ids.append(7)  # one decode token each
        m.append_slots(s)
    chunk_seq = seqs[0].__class__(list(prompts[2]) * 3)
    m.allocate(chunk_seq)
    plan = dict(
        decode=[s.block_table for s in seqs],
        chunks=[(chunk_seq.block_table, len(chunk_seq))],
    )
    n = len(seqs) + len(chunk_seq)
    g = torch.Generator().manual_seed(1)
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(1, H, n, D, generator=g).to(DEVICE)
    k = torch.randn(1, KV, n, D, generator=g).to(DEVICE)
    v = torch.randn(1, KV, n, D, generator=g).to(DEVICE)
    pos = torch.tensor([[len(s) - 1 for s in seqs] + list(range(len(chunk_seq)))], device=DEVICE)
    outs = []
    for cache in (plain, kernel):
        cache.plan(**plan)
        outs.append(cache.attention(2, q, k, v, pos))
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)
    # decode row 0 by hand: SDPA over its prompt's keys (layer 2) and its new key
    keys = plain.k[2].flatten(0, 1)[[m.slot(seqs[0], t) for t in range(len(seqs[0]))]]
    vals = plain.v[2].flatten(0, 1)[[m.slot(seqs[0], t) for t in range(len(seqs[0]))]]
    want = F.scaled_dot_product_attention(
        q[:, :, :1], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], enable_gqa=True
    )
    torch.testing.assert_close(outs[0][:, :, :1], want, atol=ATOL, rtol=0)


def test_model_with_the_paged_kernel_gives_the_contiguous_caches_greedy_tokens(model, prompts):
    """use_kernel=True: every decode step of the model attends with the Triton kernel."""
    from minillm import SamplingParams, generate
    from minillm.generation import generate_paged

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    model = model.to(DEVICE)
    expected = generate(model, prompts, greedy)
    assert generate_paged(model, prompts, greedy, block_size=4, use_kernel=True) == expected
    forked = generate_paged(model, prompts[:1], greedy, block_size=4, n=2, use_kernel=True)
    assert forked == [expected[0], expected[0]]
