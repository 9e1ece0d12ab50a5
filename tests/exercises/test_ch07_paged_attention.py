"""Chapter 07 exercises, graded against minillm.cache.

`ch07` is the module under test (solutions/ by default, exercises/ with
MINILLM_IMPL=exercises). Test names start with `test_ch07_<exercise>`.
"""

from __future__ import annotations

import random

import pytest
import torch

from exercises.feedback import assert_close
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
    of_list, of_tuple = ch07.block_hash(None, [1, 2, 3]), ch07.block_hash(None, (1, 2, 3))
    assert of_list == of_tuple, (
        f"block_hash(None, [1, 2, 3]) and block_hash(None, (1, 2, 3)): expected the same hash, "
        f"got {of_list} and {of_tuple}; hint: hash the tokens as a tuple (tuple(token_ids)), "
        "so that a list and a tuple agree"
    )
    h = ch07.block_hash(None, [1, 2])
    assert isinstance(h, int), (
        f"block_hash(None, [1, 2]): expected an int, got {type(h).__name__} {h!r:.60}; "
        "hint: Python's hash() of a tuple is an int"
    )
    again, fresh = (
        ch07.block_hash(h, [3, 4]),
        ch07.block_hash(ch07.block_hash(None, (1, 2)), (3, 4)),
    )
    assert again == fresh, (
        f"block_hash(h, [3, 4]) with h = block_hash(None, [1, 2]), computed twice: expected "
        f"the same hash, got {again} and {fresh}; hint: depend on prev_hash and the tokens "
        "only (no counter, no id(), no randomness)"
    )


def test_ch07_block_hash_depends_on_the_tokens_and_the_prefix(ch07):
    a, b = ch07.block_hash(None, [1, 2]), ch07.block_hash(None, [9, 9])
    assert a != b, (
        f"block_hash(None, [1, 2]) and block_hash(None, [9, 9]): expected different hashes, "
        f"got {a} for both; hint: hash the token ids themselves"
    )
    after_a, after_b = ch07.block_hash(a, [3, 4]), ch07.block_hash(b, [3, 4])
    assert after_a != after_b, (
        f"block_hash(prev, [3, 4]) after [1, 2] and after [9, 9]: expected different hashes, "
        f"got {after_a} for both; hint: chain prev_hash in: hash (prev_hash, tokens) together"
    )
    ab, ba = ch07.block_hash(None, [1, 2]), ch07.block_hash(None, [2, 1])
    assert ab != ba, (
        f"block_hash(None, [1, 2]) and block_hash(None, [2, 1]): expected different hashes, "
        f"got {ab} for both; hint: order matters: hash a tuple, not a set, sum or sorted list"
    )


# --- prefix_block_hashes --------------------------------------------------------------------


def test_ch07_prefix_block_hashes_one_per_full_block_chained(ch07):
    tokens = [5, 6, 7, 8, 9]
    hashes = ch07.prefix_block_hashes(tokens, 2)
    case = "prefix_block_hashes([5, 6, 7, 8, 9], block_size=2)"
    assert len(hashes) == 2, (
        f"{case}: expected 2 hashes (2 full blocks; the partial block [9] gets none), got "
        f"{len(hashes)}; hint: one hash per full block, none for a partial last block"
    )
    h0 = ch07.block_hash(None, [5, 6])
    want = [h0, ch07.block_hash(h0, [7, 8])]
    assert hashes == want, (
        f"{case}: expected [block_hash(None, [5, 6]), block_hash(that, [7, 8])] = {want}, got "
        f"{hashes}; hint: each block's hash chains the previous block's (None for the first)"
    )
    short = ch07.prefix_block_hashes([1, 2, 3], 4)
    assert short == [], (
        f"prefix_block_hashes([1, 2, 3], block_size=4): expected [] (no full block), got "
        f"{short}; hint: a partial block gets no hash"
    )


def test_ch07_prefix_block_hashes_share_exactly_the_common_full_blocks(ch07):
    rng = random.Random(0)
    for _ in range(50):
        bs = rng.choice([2, 3, 4])
        common = [rng.randrange(5) for _ in range(rng.randrange(12))]
        a = common + [7] + [rng.randrange(5) for _ in range(rng.randrange(8))]
        b = common + [8] + [rng.randrange(5) for _ in range(rng.randrange(8))]
        ha, hb = ch07.prefix_block_hashes(a, bs), ch07.prefix_block_hashes(b, bs)
        same = len(common) // bs  # blocks entirely inside the common prefix
        case = (
            f"prefix_block_hashes of a {len(a)}- and a {len(b)}-token prompt sharing their "
            f"first {len(common)} tokens, block_size={bs}"
        )
        assert ha[:same] == hb[:same], (
            f"{case}: expected their first {same} hashes equal, got {len(ha)} and {len(hb)} "
            f"hashes with blocks {[i for i in range(same) if ha[i : i + 1] != hb[i : i + 1]]} "
            "different; hint: a block's hash depends only on its tokens and the blocks before"
        )
        assert all(x != y for x, y in zip(ha[same:], hb[same:], strict=False)), (
            f"{case}: expected every hash from block {same} on to differ, got equal hashes "
            f"at blocks {[i for i in range(same, min(len(ha), len(hb))) if ha[i] == hb[i]]}; "
            "hint: chain prev_hash in, so one different token changes every later block"
        )


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
        assert mine == hits, (
            f"prefix_block_hashes, block_size={bs}: first prompt {first}, second {second}: "
            f"expected {hits} leading full blocks of the second found among the first's hashes "
            f"(minillm's prefix-cache hits), got {mine}; hint: full blocks only, each hash "
            "chained to the one before"
        )


# --- cow_append -----------------------------------------------------------------------------


def test_ch07_cow_append_fills_a_block_then_opens_the_next(ch07):
    table, refs, free = [], [0] * 4, [2, 0, 1, 3]
    slots = [ch07.cow_append(table, n, refs, free, 2) for n in range(5)]
    want = [(4, None), (5, None), (0, None), (1, None), (2, None)]
    case = "cow_append(an empty table, tokens 0..4, free [2, 0, 1, 3], block_size 2)"
    assert slots == want, (
        f"{case}: (slot, copy) per token: expected {want}, got {slots}; hint: slot = block * "
        "block_size + offset, and a new block is taken from the front of free only when the "
        "last is full"
    )
    got = (table, refs, free)
    assert got == ([2, 0, 1], [1, 1, 1, 0], [3]), (
        f"{case}: (table, refs, free): expected ([2, 0, 1], [1, 1, 1, 0], [3]), got {got}; "
        "hint: each new block goes on the table with ref_count 1 and leaves free"
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
    assert copy == (4, 5), (
        f"cow_append(the child's table [3, 4], token 3; blocks 3 and 4 shared, free [5]): "
        f"expected copy (4, 5), got {copy}; hint: the shared half block must be copied before "
        "the write: (shared block, new block from the front of free)"
    )
    case = "cow_append(the child's table [3, 4], token 3; blocks 3 and 4 shared)"
    assert (child, slot) == ([3, 5], 5 * 2 + 1), (
        f"{case}: the child's table and slot: expected ([3, 5], 11), got ({child}, {slot}); "
        "hint: the copy (block 5) replaces the shared block on the table, and the token goes "
        "into it"
    )
    assert refs[3:] == [2, 1, 1], (
        f"{case}: ref counts of blocks 3, 4, 5: expected [2, 1, 1], got {refs[3:]}; hint: the "
        "full block stays shared (2); the shared half block loses the child (2 -> 1: "
        "decrement its ref_count); the copy has one owner (1)"
    )
    slot, copy = ch07.cow_append(parent, 3, refs, free, 2)
    case = "cow_append(the parent's table [3, 4], token 3) after the child copied block 4"
    assert copy is None, (
        f"{case}: expected no copy (the parent is now the only owner), got copy {copy}; hint: "
        "copy only while the last block's ref_count is above 1"
    )
    assert slot == 4 * 2 + 1, (
        f"{case}: expected slot 9 (block 4, offset 1), got {slot}; hint: the parent is now "
        "the only owner: write in place, slot = block * block_size + offset"
    )


def test_ch07_cow_append_full_shared_block_needs_no_copy(ch07):
    refs, free = [0, 2, 0], [2]
    table = [1]  # one full block of 2, shared with another sequence
    slot, copy = ch07.cow_append(table, 2, refs, free, 2)
    got = (copy, table, slot, refs)
    assert got == (None, [1, 2], 4, [0, 2, 1]), (
        f"cow_append(table [1] with its full block shared, token 2, free [2], block_size 2): "
        f"(copy, table, slot, refs): expected (None, [1, 2], 4, [0, 2, 1]), got {got}; hint: "
        "a full shared block is never written again, so no copy: open a new block instead"
    )


def test_ch07_cow_append_out_of_blocks_changes_nothing(ch07):
    table, refs, free = [0], [2], []
    hint = "hint: raise before changing anything: check free first, then update table and refs"
    raises_runtime_error(ch07.cow_append, table, 1, refs, free, 4)  # shared: needs a copy
    got = (table, refs, free)
    assert got == ([0], [2], []), (
        f"cow_append(table [0] shared, token 1, no free block): (table, refs, free): expected "
        f"([0], [2], []) after the RuntimeError, got {got}; {hint}"
    )
    raises_runtime_error(ch07.cow_append, table, 4, refs, free, 4)  # full: needs a new block
    got = (table, refs, free)
    assert got == ([0], [2], []), (
        f"cow_append(table [0] full, token 4, no free block): (table, refs, free): expected "
        f"([0], [2], []) after the RuntimeError, got {got}; {hint}"
    )


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
        before = list(tables[sid])
        mine = ch07.cow_append(tables[sid], length, refs, free, bs)
        want = (m.slot(seq, length), copies[0] if copies else None)
        case = f"cow_append(table {before}, token {length}, blocks of {bs}) under random forks"
        assert mine == want, (
            f"{case}: expected (slot, copy) {want} (minillm's BlockManager), got {mine}; hint: "
            "copy the last block only when it is shared (ref_count > 1) and not full"
        )
        assert tables[sid] == seq.block_table, (
            f"{case}: expected the table {seq.block_table}, got {tables[sid]}; hint: a copy "
            "replaces the shared last block; a new block is appended"
        )
    counts = [b.ref_count for b in m.blocks]
    assert refs == counts, (
        f"cow_append after 150 random appends and forks: expected ref counts {counts}, got "
        f"{refs}; hint: a new block or a copy starts at 1, the shared block a copy replaces "
        "loses 1"
    )


# --- gather_kv ------------------------------------------------------------------------------


def test_ch07_gather_kv_reads_through_the_table(ch07):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 4, 2, 3, generator=g)  # 10 blocks of 4 slots, 2 kv heads, d 3
    table = [7, 2, 9]
    hint = (
        "logical block i is physical block table[i]: position p is slot p % block_size of "
        "block table[p // block_size]; the result is [kv_heads, length, d]"
    )
    for length in (1, 4, 5, 11, 12):
        out = ch07.gather_kv(pool, table, length)
        case = f"gather_kv(pool of 10 blocks x 4 slots x 2 kv heads x d 3, {table}, {length})"
        assert out.shape == (2, length, 3), (
            f"{case}: expected shape (2, {length}, 3), got {tuple(out.shape)}; hint: flatten "
            "blocks x slots into positions, keep the first `length`, heads first"
        )
        dense = minillm_gather_kv(pool, torch.tensor([table]))[0, :, :length]
        assert_close(out, dense, f"{case} vs minillm", hint)
    assert_close(
        ch07.gather_kv(pool, table, 6)[:, 5],
        pool[2, 1],
        f"gather_kv(pool, {table}, 6): position 5 vs pool[2, 1] (block table[1] = 2, slot 1)",
        hint,
    )


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
    case = f"paged_decode(lens {lens}, {H} heads, {KV} kv heads, head_dim {D}, blocks of {bs})"
    assert out.shape == q.shape, (
        f"{case}: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}; hint: one "
        "output vector per sequence and head, [B, H, D]"
    )
    assert out.dtype == q.dtype, (
        f"{case}: expected q's dtype {q.dtype}, got {out.dtype}; hint: store the result in "
        "the output's element type"
    )
    err = (out - want).abs().max().item()
    assert err < 1e-5, (
        f"{case}: expected softmax attention over the gathered K/V (max error < 1e-5), got "
        f"max error {err:.2e}; hint: check the masking of the last block, the kv head of "
        "each query head and the rescaling by exp(m - m_new)"
    )


def test_ch07_paged_decode_survives_large_scores(ch07):
    """Scores of several hundred: exp overflows unless the running max is subtracted."""
    q, k_pool, v_pool, tables, lens = random_pool(1, [9, 30], 2, 1, 16, 4)
    q = q * 60
    out = ch07.paged_decode(q, k_pool, v_pool, tables, lens)
    case = "paged_decode(q x 60: scores of several hundred, lens [9, 30], blocks of 4)"
    hint = "subtract the running max before exp, and rescale the sums by exp(m - m_new)"
    assert torch.isfinite(out).all(), (
        f"{case}: expected finite values, got {int((~torch.isfinite(out)).sum())} inf/nan; "
        f"hint: {hint}"
    )
    assert_close(
        out,
        paged_attention_ref(q, k_pool, v_pool, tables, lens),
        f"{case} vs attention over the gathered K/V",
        hint,
    )
