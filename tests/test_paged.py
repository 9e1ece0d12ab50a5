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
from minillm.cache.block_manager import block_hash
from minillm.generation import generate_paged

# ------------------------------------------------------------------ block manager, by hand


def state(m: BlockManager):
    """Everything observable about a manager, to check that a failed call changed nothing."""
    return (
        [(b.ref_count, b.hash) for b in m.blocks],
        list(m.free_ids),
        list(m.evictable),
        dict(m.cached),
        {s: (list(t.block_ids), list(t.token_ids)) for s, t in m.tables.items()},
    )


def test_allocate_takes_ceil_blocks_and_free_returns_them():
    m = BlockManager(8, block_size=4)
    assert m.allocate(0, list(range(9))) == 0  # nothing cached yet
    assert len(m.block_table(0)) == 3 and m.num_free_blocks == 5
    assert m.slot(0, 5) == m.block_table(0)[1] * 4 + 1
    m.free(0)
    assert m.num_free_blocks == 8
    with pytest.raises(KeyError, match="freed twice"):
        m.free(0)


def test_prefix_hit_reuses_full_blocks_but_never_the_last_tokens_block():
    m = BlockManager(16, block_size=4)
    prompt = list(range(10))  # blocks [0-3] [4-7] full, [8-9] partial
    m.allocate(0, prompt)
    assert m.allocate(1, prompt + [99, 98]) == 8  # both full blocks shared
    assert m.block_table(1)[:2] == m.block_table(0)[:2]
    assert m.allocate(2, prompt[:8]) == 4  # 8 tokens: the block of the last token is recomputed
    assert m.allocate(3, [7] + prompt[1:]) == 0  # first block differs: the chain breaks
    assert [m.blocks[b].ref_count for b in m.block_table(0)[:2]] == [3, 2]


def test_prefix_hit_is_verified_by_tokens_not_just_hash():
    m = BlockManager(8, block_size=2, hash_fn=lambda prev, toks: 0)  # every block collides
    m.allocate(0, [1, 2, 3])
    assert m.allocate(1, [5, 6, 7]) == 0  # same hash, other tokens: a miss
    assert m.allocate(2, [1, 2, 9]) == 2


def test_unreferenced_cached_blocks_are_evicted_lru_and_still_hit_before_that():
    m = BlockManager(5, block_size=2)
    m.allocate(0, [1, 2, 3])  # blocks: [1,2] full and cached, [3] partial
    m.allocate(1, [5, 6, 7])
    m.free(0)
    m.free(1)
    assert m.num_free_blocks == 5 and len(m.evictable) == 2
    assert m.allocate(2, [1, 2, 0]) == 2  # revived from the evictable list
    m.free(2)  # [5,6] is now the least recently used cached block
    m.allocate(3, [9] * 7)  # 4 blocks: the 3 free ones + the LRU cached one
    m.free(3)
    assert m.allocate(4, [1, 2, 0]) == 2  # [1,2] survived
    assert m.allocate(5, [5, 6, 0]) == 0  # [5,6] was evicted


def test_out_of_blocks_raises_and_changes_nothing():
    m = BlockManager(3, block_size=2)
    m.allocate(0, [1, 2, 3, 4])
    before = state(m)
    assert not m.can_allocate([5, 6, 7])
    with pytest.raises(OutOfBlocks):
        m.allocate(1, [5, 6, 7])
    assert state(m) == before
    m.append_slot(0, 5)  # takes the last block
    m.append_slot(0, 6)
    before = state(m)
    assert not m.can_append(0)
    with pytest.raises(OutOfBlocks):
        m.append_slot(0, 7)
    assert state(m) == before


def test_fork_shares_blocks_and_copies_the_last_one_on_write():
    m = BlockManager(8, block_size=4)
    m.allocate(0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    assert m.block_table(1) == m.block_table(0)
    shared_last = m.block_table(0)[-1]
    slot, copy = m.append_slot(1, 7)  # the child writes first: it gets a private copy
    assert copy is not None and copy[0] == shared_last and m.block_table(1)[-1] == copy[1]
    assert slot == copy[1] * 4 + 2
    slot, copy = m.append_slot(0, 8)  # the parent is now the only owner: no copy
    assert copy is None and slot == shared_last * 4 + 2
    assert m.block_table(0)[0] == m.block_table(1)[0]  # the full block stays shared


def test_bad_calls_name_the_fix():
    m = BlockManager(4, block_size=2)
    with pytest.raises(ValueError, match="empty prompt"):
        m.allocate(0, [])
    m.allocate(0, [1])
    with pytest.raises(ValueError, match="free"):
        m.allocate(0, [1])
    with pytest.raises(KeyError, match="allocate"):
        m.append_slot(7, 1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)


def test_block_hash_chains_the_prefix():
    assert block_hash(None, [1, 2]) == block_hash(None, (1, 2))
    assert block_hash(block_hash(None, [1, 2]), [3, 4]) != block_hash(
        block_hash(None, [9, 2]), [3, 4]
    )


# ------------------------------------------------------------------ block manager, properties


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free against a model of the pool's contents: each
    slot holds the token id written there, so a read through a block table must give back
    exactly the sequence's tokens, whatever was shared, copied, evicted or reused."""

    def __init__(self):
        super().__init__()
        self.m = BlockManager(12, block_size=3)
        self.content: dict[int, int] = {}  # slot -> token written there
        self.next_id = 0

    def write(self, seq: int, position: int, token: int) -> None:
        slot = self.m.slot(seq, position)
        block = self.m.blocks[slot // self.m.block_size]
        assert block.ref_count == 1, f"slot {slot} is written while shared"
        self.content[slot] = token

    @rule(
        base=st.sampled_from([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [4, 4, 4, 4, 4, 4]]),
        n=st.integers(0, 5),
    )
    def allocate(self, base, n):
        prompt = base[: max(1, n + 2)] + [8] * (n % 2)
        before = state(self.m)
        try:
            cached = self.m.allocate(self.next_id, prompt)
        except OutOfBlocks:
            assert state(self.m) == before
            return
        for pos in range(cached, len(prompt)):  # the prefill writes the uncached tail
            self.write(self.next_id, pos, prompt[pos])
        self.next_id += 1

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data(), token=st.integers(0, 9))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.m.tables)))
        before = state(self.m)
        try:
            slot, copy = self.m.append_slot(seq, token)
        except OutOfBlocks:
            assert state(self.m) == before
            return
        bs = self.m.block_size
        if copy is not None:  # the cache copies the block before the write
            src, dst = copy
            for i in range(bs):
                if src * bs + i in self.content:
                    self.content[dst * bs + i] = self.content[src * bs + i]
        assert slot == self.m.slot(seq, self.m.num_tokens(seq) - 1)
        self.write(seq, self.m.num_tokens(seq) - 1, token)

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.m.tables)))
        self.m.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(data.draw(st.sampled_from(sorted(self.m.tables))))

    @invariant()
    def ref_counts_equal_table_holders(self):
        holders = Counter(b for t in self.m.tables.values() for b in t.block_ids)
        assert [b.ref_count for b in self.m.blocks] == [holders[i] for i in range(12)]

    @invariant()
    def every_block_is_in_exactly_one_place(self):
        used = {b.id for b in self.m.blocks if b.ref_count > 0}
        free, evictable = list(self.m.free_ids), list(self.m.evictable)
        assert len(free) + len(evictable) + len(used) == 12
        assert set(free) | set(evictable) | used == set(range(12))
        assert all(self.m.blocks[b].hash is not None for b in evictable)
        assert all(self.m.blocks[self.m.cached[h]].hash == h for h in self.m.cached)

    @invariant()
    def cached_blocks_hold_the_tokens_they_are_named_by(self):
        bs = self.m.block_size
        for block_id in self.m.cached.values():
            held = tuple(self.content.get(block_id * bs + i) for i in range(bs))
            assert held == self.m.blocks[block_id].token_ids

    @invariant()
    def reads_through_tables_give_each_sequences_tokens(self):
        for seq, t in self.m.tables.items():
            read = [self.content.get(self.m.slot(seq, p)) for p in range(len(t.token_ids))]
            assert read == t.token_ids, f"sequence {seq} reads {read}, wrote {t.token_ids}"

    def teardown(self):
        for seq in list(self.m.tables):
            self.m.free(seq)
        assert self.m.num_free_blocks == 12
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
    assert m.allocate(99, long_prompts[3]) >= 16  # the shared 19-token prefix: 4 full blocks


def test_parallel_samples_share_prompt_blocks(model, prompts):
    p = prompts[1] * 3  # 27 tokens or so: 7 blocks of 4
    forked = generate_paged(model, [p], greedy(10), block_size=4, n=3)
    assert forked == generate(model, [p] * 3, greedy(10))  # CoW kept every copy intact
    blocks = BlockManager(64, 4)
    blocks.allocate(0, p)
    for child in (1, 2):
        blocks.fork(0, child)
    assert blocks.num_free_blocks == 64 - -(-len(p) // 4)  # 3 samples, one prompt's blocks


def test_paged_cache_logits_match_contiguous(model, prompts):
    p = prompts[1] + prompts[0]  # 12 tokens over 3 blocks of 5
    m, bs = BlockManager(10, 5), 5
    m.allocate(0, p)
    paged = PagedKVCache(model.config, 10, bs)
    paged.set_tables([m.block_table(0)])
    dense = KVCache(model.config, 1, len(p))
    with torch.inference_mode():
        a = model(torch.tensor([p]), cache=paged)
        b = model(torch.tensor([p]), cache=dense)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    kv = paged.k[0].flatten(0, 1)[[m.slot(0, i) for i in range(len(p))]]  # [T, kvh, d]
    torch.testing.assert_close(kv.transpose(0, 1), dense.k[0, 0])
