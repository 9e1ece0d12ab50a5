"""Chapter 07 exercises, graded against minillm.cache.

`ch07` is the module under test (solutions/ by default, exercises/ with
MINILLM_IMPL=exercises). Test names start with `test_ch07_<exercise>`.
"""

from __future__ import annotations

import random

import pytest
import torch

from minillm.cache import BlockManager
from minillm.cache.block_manager import PagedSequence
from minillm.kernels.paged_attention import gather_kv as minillm_gather_kv
from minillm.kernels.paged_attention import paged_attention_ref


def raises_runtime_error(fn, *args) -> None:
    """fn(*args) raises RuntimeError (NotImplementedError, a subclass, does not count)."""
    with pytest.raises(RuntimeError) as e:
        fn(*args)
    if isinstance(e.value, NotImplementedError):
        raise e.value


# --- block_hash -----------------------------------------------------------------------------


def test_ch07_block_hash_is_deterministic_and_takes_lists_or_tuples(ch07):
    assert ch07.block_hash(None, [1, 2, 3]) == ch07.block_hash(None, (1, 2, 3))
    h = ch07.block_hash(None, [1, 2])
    assert isinstance(h, int)
    assert ch07.block_hash(h, [3, 4]) == ch07.block_hash(ch07.block_hash(None, (1, 2)), (3, 4))


def test_ch07_block_hash_depends_on_the_tokens_and_the_prefix(ch07):
    a, b = ch07.block_hash(None, [1, 2]), ch07.block_hash(None, [9, 9])
    assert a != b, "different tokens, same hash"
    assert ch07.block_hash(a, [3, 4]) != ch07.block_hash(b, [3, 4]), (
        "block [3, 4] after [1, 2] and after [9, 9] got the same hash: chain prev_hash in"
    )
    assert ch07.block_hash(None, [1, 2]) != ch07.block_hash(None, [2, 1]), "order matters"


# --- prefix_block_hashes --------------------------------------------------------------------


def test_ch07_prefix_block_hashes_one_per_full_block_chained(ch07):
    tokens = [5, 6, 7, 8, 9]
    hashes = ch07.prefix_block_hashes(tokens, 2)
    assert len(hashes) == 2, f"{len(hashes)} hashes for 2 full blocks (and a partial one)"
    h0 = ch07.block_hash(None, [5, 6])
    assert hashes == [h0, ch07.block_hash(h0, [7, 8])]
    assert ch07.prefix_block_hashes([1, 2, 3], 4) == []


def test_ch07_prefix_block_hashes_share_exactly_the_common_full_blocks(ch07):
    rng = random.Random(0)
    for _ in range(50):
        bs = rng.choice([2, 3, 4])
        common = [rng.randrange(5) for _ in range(rng.randrange(12))]
        a = common + [7] + [rng.randrange(5) for _ in range(rng.randrange(8))]
        b = common + [8] + [rng.randrange(5) for _ in range(rng.randrange(8))]
        ha, hb = ch07.prefix_block_hashes(a, bs), ch07.prefix_block_hashes(b, bs)
        same = len(common) // bs  # blocks entirely inside the common prefix
        assert ha[:same] == hb[:same]
        assert all(x != y for x, y in zip(ha[same:], hb[same:], strict=False))


def test_ch07_prefix_block_hashes_find_what_minillm_finds(ch07):
    """The number of leading full blocks a second prompt shares with a first one (by your
    hashes) equals the number of prefix-cache hits minillm's BlockManager reports."""
    rng = random.Random(1)
    for _ in range(30):
        bs = rng.choice([2, 4])
        first = [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        second = first[: rng.randrange(len(first) + 1)] + [rng.randrange(3) for _ in range(5)]
        m = BlockManager(32, bs)
        a = PagedSequence(list(first))
        m.allocate(a)
        m.mark_computed(a, len(first))  # its prefill ran: its full blocks are cached
        hits = m.allocate(PagedSequence(list(second))) // bs
        known = set(ch07.prefix_block_hashes(first, bs))
        mine = 0
        for h in ch07.prefix_block_hashes(second[: len(second) - 1], bs):  # last token: computed
            if h not in known:
                break
            mine += 1
        assert mine == hits


# --- cow_append -----------------------------------------------------------------------------


def test_ch07_cow_append_fills_a_block_then_opens_the_next(ch07):
    table, refs, free = [], [0] * 4, [2, 0, 1, 3]
    slots = [ch07.cow_append(table, n, refs, free, 2) for n in range(5)]
    want = [(4, None), (5, None), (0, None), (1, None), (2, None)]
    assert slots == want, (
        f"(slot, copy) per token: expected {want}, got {slots}; slot = block * block_size + "
        "offset, and a new block is taken from the front of free only when the last is full"
    )
    got = (table, refs, free)
    assert got == ([2, 0, 1], [1, 1, 1, 0], [3]), (
        f"(table, refs, free): expected ([2, 0, 1], [1, 1, 1, 0], [3]), got {got}: each new "
        "block goes on the table with ref_count 1 and leaves free"
    )


def test_ch07_cow_append_copies_a_shared_last_block_once(ch07):
    refs, free = [0] * 6, [3, 4, 5]
    parent = []
    for n in range(3):  # 3 tokens in blocks of 2: one full block and one half block
        ch07.cow_append(parent, n, refs, free, 2)
    child = list(parent)  # fork
    for b in parent:
        refs[b] += 1
    slot, copy = ch07.cow_append(child, 3, refs, free, 2)
    assert copy == (4, 5), "the shared half block must be copied before the write"
    assert (child, slot) == ([3, 5], 5 * 2 + 1), (
        f"the child's table and slot: expected ([3, 5], 11), got ({child}, {slot}): the copy "
        "(block 5) replaces the shared block on the table, and the token goes into it"
    )
    assert refs[3:] == [2, 1, 1], (
        f"ref counts of blocks 3, 4, 5: expected [2, 1, 1], got {refs[3:]}: the full block "
        "stays shared (2); the shared half block loses the child (2 -> 1: decrement its "
        "ref_count); the copy has one owner (1)"
    )
    slot, copy = ch07.cow_append(parent, 3, refs, free, 2)
    assert copy is None and slot == 4 * 2 + 1, "the parent is now the only owner"


def test_ch07_cow_append_full_shared_block_needs_no_copy(ch07):
    refs, free = [0, 2, 0], [2]
    table = [1]  # one full block of 2, shared with another sequence
    slot, copy = ch07.cow_append(table, 2, refs, free, 2)
    got = (copy, table, slot, refs)
    assert got == (None, [1, 2], 4, [0, 2, 1]), (
        f"(copy, table, slot, refs): expected (None, [1, 2], 4, [0, 2, 1]), got {got}: a "
        "full shared block is never written again, so no copy: open a new block instead"
    )


def test_ch07_cow_append_out_of_blocks_changes_nothing(ch07):
    table, refs, free = [0], [2], []
    hint = "raise before changing anything: check free first, then update table and refs"
    raises_runtime_error(ch07.cow_append, table, 1, refs, free, 4)  # shared: needs a copy
    got = (table, refs, free)
    assert got == ([0], [2], []), f"expected ([0], [2], []) after the error, got {got}: {hint}"
    raises_runtime_error(ch07.cow_append, table, 4, refs, free, 4)  # full: needs a new block
    got = (table, refs, free)
    assert got == ([0], [2], []), f"expected ([0], [2], []) after the error, got {got}: {hint}"


def test_ch07_cow_append_agrees_with_minillm_under_random_forks(ch07):
    rng = random.Random(2)
    bs, n_blocks = 3, 30
    m = BlockManager(n_blocks, bs, prefix_cache=False)
    refs, free = [0] * n_blocks, list(range(n_blocks))
    tables: dict[int, list[int]] = {}
    seqs: dict[int, PagedSequence] = {}
    next_id = 0
    for _ in range(150):
        if not tables or rng.random() < 0.15:  # a fork (or the first sequence)
            if tables:
                parent = rng.choice(sorted(tables))
                seqs[next_id] = PagedSequence(list(seqs[parent].token_ids))
                m.fork(seqs[parent], seqs[next_id])
                tables[next_id] = list(tables[parent])
                for b in tables[next_id]:
                    refs[b] += 1
            else:
                seqs[next_id] = PagedSequence([1])
                m.allocate(seqs[next_id])
                m.mark_computed(seqs[next_id], 1)
                tables[next_id] = []
                ch07.cow_append(tables[next_id], 0, refs, free, bs)
            next_id += 1
            continue
        sid = rng.choice(sorted(tables))
        seq = seqs[sid]
        length = len(seq)
        seq.token_ids.append(0)
        if not m.can_append(seq):  # the pool ran dry: the exercise must refuse too
            seq.token_ids.pop()
            raises_runtime_error(ch07.cow_append, tables[sid], length, refs, free, bs)
            continue
        copies = m.append_slots(seq)
        m.mark_computed(seq, len(seq))
        mine = ch07.cow_append(tables[sid], length, refs, free, bs)
        assert mine == (m.slot(seq, length), copies[0] if copies else None)
        assert tables[sid] == seq.block_table
    assert refs == [b.ref_count for b in m.blocks]


# --- gather_kv ------------------------------------------------------------------------------


def test_ch07_gather_kv_reads_through_the_table(ch07):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 4, 2, 3, generator=g)  # 10 blocks of 4 slots, 2 kv heads, d 3
    table = [7, 2, 9]
    for length in (1, 4, 5, 11, 12):
        out = ch07.gather_kv(pool, table, length)
        assert out.shape == (2, length, 3)
        dense = minillm_gather_kv(pool, torch.tensor([table]))[0, :, :length]
        torch.testing.assert_close(out, dense)
    torch.testing.assert_close(ch07.gather_kv(pool, table, 6)[:, 5], pool[2, 1])


def test_ch07_gather_kv_rejects_a_short_table(ch07):
    pool = torch.zeros(4, 4, 1, 2)
    with pytest.raises(ValueError, match="block"):
        ch07.gather_kv(pool, [0, 1], 9)


# --- paged_decode (Triton) ------------------------------------------------------------------


def random_pool(seed: int, lens: list[int], H: int, KV: int, D: int, bs: int):
    """A shuffled pool holding sequences of `lens` tokens, and what dense attention gives."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3  # spare blocks full of junk the kernel must not read
    k_pool, v_pool = torch.randn(2, num_blocks, bs, KV, D, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()  # tables out of order
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.long)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(len(lens), H, D, generator=g)
    return q, k_pool, v_pool, tables, torch.tensor(lens)


@pytest.mark.parametrize(
    "lens, H, KV, D, bs",
    [
        ([1, 4, 5, 11], 2, 2, 16, 4),  # one token, a full block, one past it, ragged
        ([7, 8, 9, 21], 8, 2, 16, 8),  # grouped-query attention: 4 heads per kv head
        ([3, 40], 4, 1, 32, 16),  # multi-query attention, a long sequence
    ],
)
def test_ch07_paged_decode_matches_attention_over_gathered_kv(ch07, lens, H, KV, D, bs):
    q, k_pool, v_pool, tables, lens_t = random_pool(0, lens, H, KV, D, bs)
    out = ch07.paged_decode(q, k_pool, v_pool, tables, lens_t)
    want = paged_attention_ref(q, k_pool, v_pool, tables, lens_t)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out - want).abs().max().item()
    assert err < 1e-5, (
        f"max error {err:.2e} vs softmax attention over the gathered K/V (lens {lens}, "
        f"{H} heads, {KV} kv heads, blocks of {bs}): check the masking of the last block, "
        "the kv head of each query head and the rescaling by exp(m - m_new)"
    )


def test_ch07_paged_decode_survives_large_scores(ch07):
    """Scores of several hundred: exp overflows unless the running max is subtracted."""
    q, k_pool, v_pool, tables, lens = random_pool(1, [9, 30], 2, 1, 16, 4)
    q = q * 60
    out = ch07.paged_decode(q, k_pool, v_pool, tables, lens)
    assert torch.isfinite(out).all(), "inf/nan: subtract the running max before exp"
    torch.testing.assert_close(out, paged_attention_ref(q, k_pool, v_pool, tables, lens))
