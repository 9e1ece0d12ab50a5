"""The paged cache: block bookkeeping (unit + property tests) and the model running on it."""

from collections import Counter

import pytest
import torch
from helpers import greedy
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm import generate
from minillm.cache import BlockManager, KVCache, OutOfBlocks, PagedKVCache
from minillm.cache.block_manager import PagedSequence, block_hash
from minillm.generation import generate_paged

# ------------------------------------------------------------------ block manager, by hand


def seq(tokens) -> PagedSequence:
    return PagedSequence(list(tokens))


def prefill(m: BlockManager, tokens) -> PagedSequence:
    """Allocate a sequence and mark all its tokens computed (its prefill ran)."""
    s = seq(tokens)
    m.allocate(s)
    m.mark_computed(s, len(s))
    return s


def state(m: BlockManager, *seqs: PagedSequence):
    """Everything observable about a manager and some sequences, to check that a failed
    call changed nothing."""
    return (
        [(b.ref_count, b.hash) for b in m.blocks],
        list(m.free_ids),
        list(m.evictable),
        dict(m.cached),
        [(list(s.block_table), list(s.block_hashes), s.num_computed_tokens) for s in seqs],
    )


def test_allocate_takes_ceil_blocks_and_free_returns_them():
    m = BlockManager(8, block_size=4)
    a = seq(range(9))
    assert m.allocate(a) == 0  # nothing cached yet
    assert len(a.block_table) == 3 and m.num_free_blocks == 5
    assert m.slot(a, 5) == a.block_table[1] * 4 + 1
    m.free(a)
    assert m.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_hit_reuses_full_blocks_but_never_the_last_tokens_block():
    m = BlockManager(16, block_size=4)
    prompt = list(range(10))  # blocks [0-3] [4-7] full, [8-9] partial
    a = prefill(m, prompt)
    b = seq(prompt + [99, 98])
    assert m.allocate(b) == 8 and b.num_computed_tokens == 8  # both full blocks shared
    assert b.block_table[:2] == a.block_table[:2]
    assert m.allocate(seq(prompt[:8])) == 4  # 8 tokens: the last token's block is recomputed
    assert m.allocate(seq([7] + prompt[1:])) == 0  # first block differs: the chain breaks
    assert [m.blocks[x].ref_count for x in a.block_table[:2]] == [3, 2]


def test_a_block_is_found_only_once_its_kv_are_written():
    """Chunked prefill: a prompt whose first chunk ran publishes only that chunk's full
    blocks; another prompt with the same start must not hit blocks still unwritten."""
    m = BlockManager(16, block_size=4)
    prompt = list(range(13))
    a = seq(prompt)
    m.allocate(a)
    assert m.allocate(seq(prompt)) == 0  # allocated, nothing computed: no hit
    m.mark_computed(a, 5)  # the first chunk: tokens 0-4, one full block
    assert m.allocate(seq(prompt)) == 4
    m.mark_computed(a, 13)
    assert m.allocate(seq(prompt)) == 12


def test_prefix_hit_is_verified_by_tokens_not_just_hash():
    m = BlockManager(8, block_size=2, hash_fn=lambda prev, toks: 0)  # every block collides
    prefill(m, [1, 2, 3])
    assert m.allocate(seq([5, 6, 7])) == 0  # same hash, other tokens: a miss
    assert m.allocate(seq([1, 2, 9])) == 2


def test_unreferenced_cached_blocks_are_evicted_lru_and_still_hit_before_that():
    m = BlockManager(5, block_size=2)
    a = prefill(m, [1, 2, 3])  # blocks: [1,2] full and cached, [3] partial
    b = prefill(m, [5, 6, 7])
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 5 and len(m.evictable) == 2
    c = seq([1, 2, 0])
    assert m.allocate(c) == 2  # revived from the evictable list
    m.free(c)  # [5,6] is now the least recently used cached block
    m.free(prefill(m, [9] * 7))  # 4 blocks: the 3 free ones + the LRU cached one
    assert m.allocate(seq([1, 2, 0])) == 2  # [1,2] survived
    assert m.allocate(seq([5, 6, 0])) == 0  # [5,6] was evicted


def test_out_of_blocks_raises_and_changes_nothing():
    m = BlockManager(3, block_size=2)
    a = prefill(m, [1, 2, 3, 4])
    before = state(m, a)
    b = seq([5, 6, 7])
    assert not m.can_allocate(b)
    with pytest.raises(OutOfBlocks):
        m.allocate(b)
    assert state(m, a) == before
    a.token_ids.append(5)
    m.append_slots(a)  # takes the last block
    m.mark_computed(a, 5)
    a.token_ids += [6, 7]
    before = state(m, a)
    assert not m.can_append(a)
    with pytest.raises(OutOfBlocks):
        m.append_slots(a)
    assert state(m, a) == before


def test_fork_shares_blocks_and_copies_the_last_one_on_write():
    m = BlockManager(8, block_size=4)
    parent = prefill(m, [1, 2, 3, 4, 5, 6])
    child = seq(parent.token_ids)
    m.fork(parent, child)
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    shared_last = parent.block_table[-1]
    child.token_ids.append(7)
    copies = m.append_slots(child)  # the child writes first: it gets a private copy
    assert copies == [(shared_last, child.block_table[-1])] and child.block_table[-1] != shared_last
    parent.token_ids.append(8)
    assert m.append_slots(parent) == []  # the parent is now the only owner: no copy
    assert parent.block_table[-1] == shared_last
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared


def test_swap_out_and_back_in_keeps_the_table_shape_and_frees_device_blocks():
    m = BlockManager(6, block_size=2, num_swap_blocks=4)
    a = prefill(m, [1, 2, 3, 4, 5])  # 3 blocks
    device = list(a.block_table)
    out = m.swap_out(a)
    assert [d for d, _ in out] == device and a.swapped and m.num_free_blocks == 6
    assert len(m.free_swap_ids) == 1
    back = m.swap_in(a)
    assert [s for s, _ in back] == [c for _, c in out] and not a.swapped
    assert len(a.block_table) == 3 and len(m.free_swap_ids) == 4
    c = seq([1, 2, 3, 4, 9])
    assert m.allocate(c) == 4  # its blocks rejoined the prefix cache
    m.free(c)
    m.swap_out(a)  # 3 of the 4 swap blocks
    b = prefill(m, [7, 7, 7])  # 2 blocks: more than the swap space has left
    before = state(m, b)
    assert not m.can_swap_out(b)
    with pytest.raises(OutOfBlocks, match="swap space"):
        m.swap_out(b)
    assert state(m, b) == before and list(m.free_swap_ids) == [m.free_swap_ids[0]]


def test_bad_calls_name_the_fix():
    m = BlockManager(4, block_size=2)
    with pytest.raises(ValueError, match="empty prompt"):
        m.allocate(seq([]))
    a = prefill(m, [1])
    with pytest.raises(ValueError, match="free"):
        m.allocate(a)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)


def test_block_hash_chains_the_prefix():
    assert block_hash(None, [1, 2]) == block_hash(None, (1, 2))
    assert block_hash(block_hash(None, [1, 2]), [3, 4]) != block_hash(
        block_hash(None, [9, 2]), [3, 4]
    )


# ------------------------------------------------------------------ block manager, properties


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / swap / free against a model of the pool's contents:
    each slot holds the token id written there, so a read through a block table must give
    back exactly the sequence's tokens, whatever was shared, copied, swapped, evicted or
    reused."""

    def __init__(self):
        super().__init__()
        self.m = BlockManager(12, block_size=3, num_swap_blocks=6)
        self.content: dict[int, int] = {}  # slot -> token written there
        self.swap_content: dict[int, int] = {}
        self.live: list[PagedSequence] = []

    def write(self, s: PagedSequence, position: int) -> None:
        slot = self.m.slot(s, position)
        block = self.m.blocks[slot // self.m.block_size]
        assert block.ref_count == 1, f"slot {slot} is written while shared"
        self.content[slot] = s.token_ids[position]

    def copy(self, pairs, src_of, dst_of) -> None:
        bs = self.m.block_size
        for src, dst in pairs:
            for i in range(bs):
                if src * bs + i in src_of:
                    dst_of[dst * bs + i] = src_of[src * bs + i]

    @rule(
        base=st.sampled_from([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [4, 4, 4, 4, 4, 4]]),
        n=st.integers(0, 5),
    )
    def allocate(self, base, n):
        s = seq(base[: max(1, n + 2)] + [8] * (n % 2))
        before = state(self.m)
        try:
            cached = self.m.allocate(s)
        except OutOfBlocks:
            assert state(self.m) == before
            return
        for pos in range(cached, len(s)):  # the prefill writes the uncached tail
            self.write(s, pos)
        self.m.mark_computed(s, len(s))
        self.live.append(s)

    @precondition(lambda self: any(not s.swapped for s in self.live))
    @rule(data=st.data(), token=st.integers(0, 9))
    def append(self, data, token):
        s = data.draw(st.sampled_from([s for s in self.live if not s.swapped]))
        s.token_ids.append(token)
        before = state(self.m, s)
        try:
            copies = self.m.append_slots(s)
        except OutOfBlocks:
            assert state(self.m, s) == before
            s.token_ids.pop()
            return
        self.copy(copies, self.content, self.content)  # the cache copies before the write
        self.write(s, len(s) - 1)
        self.m.mark_computed(s, len(s))

    @precondition(lambda self: any(not s.swapped for s in self.live))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([s for s in self.live if not s.swapped]))
        child = seq(parent.token_ids)
        self.m.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: any(not s.swapped for s in self.live))
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from([s for s in self.live if not s.swapped]))
        if self.m.can_swap_out(s):
            self.copy(self.m.swap_out(s), self.content, self.swap_content)

    @precondition(lambda self: any(s.swapped for s in self.live))
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from([s for s in self.live if s.swapped]))
        if self.m.can_swap_in(s):
            self.copy(self.m.swap_in(s), self.swap_content, self.content)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live))
        self.m.free(s)
        self.live.remove(s)

    @invariant()
    def ref_counts_equal_table_holders(self):
        holders = Counter(b for s in self.live if not s.swapped for b in s.block_table)
        assert [b.ref_count for b in self.m.blocks] == [holders[i] for i in range(12)]

    @invariant()
    def every_block_is_in_exactly_one_place(self):
        used = {b.id for b in self.m.blocks if b.ref_count > 0}
        free, evictable = list(self.m.free_ids), list(self.m.evictable)
        assert len(free) + len(evictable) + len(used) == 12
        assert set(free) | set(evictable) | used == set(range(12))
        assert all(self.m.blocks[b].hash is not None for b in evictable)
        assert all(self.m.blocks[self.m.cached[h]].hash == h for h in self.m.cached)
        swapped = [b for s in self.live if s.swapped for b in s.block_table]
        assert sorted(swapped + list(self.m.free_swap_ids)) == list(range(6))

    @invariant()
    def cached_blocks_hold_the_tokens_they_are_named_by(self):
        bs = self.m.block_size
        for block_id in self.m.cached.values():
            held = tuple(self.content.get(block_id * bs + i) for i in range(bs))
            assert held == self.m.blocks[block_id].token_ids

    @invariant()
    def reads_through_tables_give_each_sequences_tokens(self):
        for s in self.live:
            pool = self.swap_content if s.swapped else self.content
            read = [pool.get(self.m.slot(s, p)) for p in range(len(s))]
            assert read == s.token_ids, f"a sequence reads {read}, wrote {s.token_ids}"

    def teardown(self):
        for s in self.live:
            self.m.free(s)
        assert self.m.num_free_blocks == 12 and len(self.m.free_swap_ids) == 6
        assert all(b.ref_count == 0 for b in self.m.blocks)


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_properties = PoolMachine.TestCase


# ------------------------------------------------------------------ the model on a paged cache


@pytest.fixture(scope="module")
def long_prompts(model, prompts):
    """Prompts of 1 to 40 tokens; two share a 19-token prefix (prefix-cache hits)."""
    base = prompts[1] + prompts[0] + prompts[1][:7]  # 19 tokens
    return [prompts[2], base + prompts[0], prompts[0], base + prompts[2] + prompts[1] * 2]


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_greedy_equals_contiguous_greedy(model, long_prompts, block_size):
    """Prompts of 1 to ~45 tokens, 20 new tokens: rows cross block boundaries at
    different steps."""
    assert generate_paged(model, long_prompts, greedy(20), block_size) == generate(
        model, long_prompts, greedy(20)
    )


def test_prefix_hits_skip_prefill_and_keep_tokens(model, long_prompts):
    m = BlockManager(64, block_size=4)
    out = generate_paged(model, long_prompts, greedy(12), manager=m)
    assert out == generate(model, long_prompts, greedy(12))
    assert m.allocate(seq(long_prompts[3])) >= 16  # the shared 19-token prefix: 4 full blocks


def test_parallel_samples_share_prompt_blocks(model, prompts):
    p = prompts[1] * 3  # 27 tokens or so: 7 blocks of 4
    forked = generate_paged(model, [p], greedy(10), block_size=4, n=3)
    assert forked == generate(model, [p] * 3, greedy(10))  # CoW kept every copy intact
    blocks = BlockManager(64, 4)
    parent = prefill(blocks, p)
    for _ in (1, 2):
        blocks.fork(parent, seq(p))
    assert blocks.num_free_blocks == 64 - -(-len(p) // 4)  # 3 samples, one prompt's blocks


def test_paged_cache_logits_match_contiguous(model, prompts):
    p = prompts[1] + prompts[0]  # 12 tokens over 3 blocks of 5
    m, bs = BlockManager(10, 5), 5
    a_seq = seq(p)
    m.allocate(a_seq)
    paged = PagedKVCache(model.config, 10, bs)
    paged.plan(decode=[], chunks=[(a_seq.block_table, len(p))])
    dense = KVCache(model.config, 1, len(p))
    with torch.inference_mode():
        a = model(torch.tensor([p]), cache=paged)
        b = model(torch.tensor([p]), cache=dense)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    kv = paged.k[0].flatten(0, 1)[[m.slot(a_seq, i) for i in range(len(p))]]  # [T, kvh, d]
    torch.testing.assert_close(kv.transpose(0, 1), dense.k[0, 0])
