"""The continuous-batching engine: same greedy tokens as `generate` however requests are
batched (alone, static, continuous under preemption), no leaked blocks, abort, n > 1,
stop strings, seeded sampling, and vLLM's offline API shape."""

import pytest
from helpers import greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import SamplingParams as BaseParams
from minillm import generate, load_tokenizer
from minillm.engine import LLM, Engine, SamplingParams
from minillm.engine.detokenizer import stop_text_holdback
from minillm.kernels import triton_status


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def workload(prompts):
    """Eight prompts of 2 to 30 tokens; two share a long prefix (prefix-cache hits)."""
    a, b, c = prompts
    return [b, c, a, b + a + b, a + c, b + a + b + c, c + a, b * 3]


def run(engine, prompts, params):
    for p in prompts:
        engine.add_request(p, params)
    return engine.run_to_completion()


def leaked(engine) -> bool:
    m, s = engine.manager, engine.scheduler
    held = any(b.ref_count for b in m.blocks) or s.running or s.waiting or s.swapped
    return m.num_free_blocks != m.num_blocks or bool(held) or engine.requests


@pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])
def test_greedy_tokens_equal_generate_with_the_triton_decode_kernel(model, tok, prompts):
    """Decode attention in the Triton paged kernel (the default on a GPU), blocks of 4."""
    params = greedy(6)
    alone = [generate(model, [p], params)[0] for p in prompts]
    engine = Engine(model, tok, block_size=4, use_kernel=True)
    assert engine.runner.worker.cache.use_kernel
    assert [o.outputs[0].token_ids for o in run(engine, prompts, params)] == alone
    assert not leaked(engine)


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # continuous, roomy pool
        dict(static=True, max_num_seqs=3),  # the baseline: fixed batches of 3
        dict(num_blocks=14, block_size=4, max_num_seqs=8),  # tight pool: preemption
        dict(num_blocks=14, block_size=4, max_num_seqs=8, preemption_mode="swap"),
        dict(max_num_seqs=4, max_num_batched_tokens=5),  # prompts cut in chunks of <= 5
        dict(chunked_prefill=False, max_num_seqs=4),  # whole prompts, prefill-only steps
        dict(decode_mode="static", max_num_seqs=5),  # what a CUDA graph records: 3 rows -> 4
    ],
    ids=[
        "continuous",
        "static",
        "preempt-recompute",
        "preempt-swap",
        "chunked",
        "unchunked",
        "padded-decode",
    ],
)
def test_greedy_tokens_equal_generate_alone(model, tok, workload, config):
    params = greedy(24)
    alone = [generate(model, [p], params)[0] for p in workload]
    engine = Engine(model, tok, **config)
    outs = run(engine, workload, params)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert [o.prompt_token_ids for o in outs] == workload
    if config.get("num_blocks") == 14:
        assert engine.scheduler.num_preemptions > 0, "the tight pool should force preemption"
    if config.get("preemption_mode") == "swap":
        assert engine.trace is None and len(engine.manager.free_swap_ids) == 14
    assert not leaked(engine)


@pytest.mark.slow
def test_compiled_decode_steps_give_the_same_tokens(model, tok, workload):
    """decode_mode="compile": one torch.compile graph per bucket, replayed on fixed
    buffers; tokens equal generate's. Here one bucket: one row (requests run one at a time)
    and one block-table width (every context fits a block of 32), so it compiles once (each
    compile takes half a minute on a CPU; the width buckets are tested in "static" mode)."""
    params = greedy(12)
    engine = Engine(model, tok, max_num_seqs=1, decode_mode="compile", block_size=32)
    outs = run(engine, workload[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == [
        generate(model, [p], params)[0] for p in workload[:3]
    ]
    assert list(engine.runner.worker.graphs) == [(1, 1)]
    assert not leaked(engine)


def test_swap_preemption_resumes_without_recomputing(model, tok, workload):
    """With swap (and swap space for everyone), a preempted sequence's K/V come back from
    the CPU pool: no prompt token is computed twice, where recompute prefills again."""
    params = greedy(24)
    counts = {}
    for mode in ("recompute", "swap"):
        engine = Engine(model, tok, num_blocks=14, block_size=4, max_num_seqs=8,
                        preemption_mode=mode, num_swap_blocks=64)  # fmt: skip
        outs = run(engine, workload, params)
        assert engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == [
            generate(model, [p], params)[0] for p in workload
        ]
        counts[mode] = engine.num_prompt_tokens
    assert counts["swap"] <= sum(len(p) for p in workload) < counts["recompute"]


def test_chunked_prefill_keeps_decoding_while_a_long_prompt_runs(model, tok, prompts):
    """A long prompt arrives while another request decodes: with chunks of 8 tokens the
    decoding request gets a token in every step of the prefill; without chunking it waits
    one whole-prompt step."""
    long = (prompts[1] * 8)[:64]
    for chunked in (True, False):
        engine = Engine(model, tok, max_num_batched_tokens=8, chunked_prefill=chunked)
        engine.trace = []
        first = engine.add_request(prompts[0], greedy(20))
        engine.step()  # the first prompt (3 tokens) is prefilled
        engine.add_request(long, greedy(4))
        engine.run_to_completion()
        steps = [r for r in engine.trace if "1" in r.prefill_tokens]
        if chunked:  # 64 tokens: 7 chunks of <= 7 (one budget slot goes to the decode)
            assert len(steps) > 1 and all(first in r.decode_ids for r in steps)
        else:
            assert len(steps) == 1 and first not in steps[0].decode_ids


def test_static_batch_waits_for_its_longest_request(model, tok, workload):
    engine = Engine(model, tok, static=True, max_num_seqs=4)
    engine.trace = []
    lengths = [3, 20, 5, 7, 9, 2, 11, 4]
    for p, n in zip(workload, lengths, strict=True):
        engine.add_request(p, greedy(n))
    engine.run_to_completion()
    prefills = [r.step for r in engine.trace if r.prefill_tokens]
    # batch 1 (lengths 3, 20, 5, 7) runs 20 steps; then batch 2 is admitted.
    assert prefills == [0, 20]
    continuous = Engine(model, tok, max_num_seqs=4)
    run_steps = len(run(continuous, workload, greedy(8)))
    assert run_steps == len(workload) and continuous.num_steps < engine.num_steps


def test_prefix_cache_hits_only_blocks_already_computed(model, tok, prompts):
    """Two equal prompts admitted in the same step each compute their blocks (a block is
    published once its K/V are written, after the forward); a third arriving a step later
    finds both full blocks cached and skips their prefill."""
    p = prompts[1] * 4  # 36 tokens: 2 full blocks of 16
    engine = Engine(model, tok)
    first = [engine.add_request(x, greedy(10)) for x in (p, p)]
    engine.step()
    later = engine.add_request(p + prompts[0], greedy(10))
    outs = {o.request_id: o for o in engine.run_to_completion()}
    assert [outs[r].num_cached_tokens for r in (*first, later)] == [0, 0, 32]
    ref = generate(model, [p, p + prompts[0]], greedy(10))
    assert [outs[r].outputs[0].token_ids for r in (*first, later)] == [ref[0], ref[0], ref[1]]


def test_abort_frees_blocks_at_once(model, tok, workload):
    engine = Engine(model, tok, max_num_seqs=2)
    ids = [engine.add_request(p, greedy(30)) for p in workload[:4]]
    for _ in range(3):
        engine.step()
    assert engine.num_running == 2 and engine.num_blocks_used > 0
    used_by_first = len(engine.requests[ids[0]].seqs[0].block_table)
    before = engine.num_blocks_used
    engine.abort(ids[0])  # running
    assert engine.num_blocks_used == before - used_by_first
    last = engine.abort(ids[3])  # still waiting: its final output comes back at once
    assert last.finished and last.outputs[0].finish_reason == "abort"
    outs = engine.run_to_completion()
    assert [o.request_id for o in outs] == [ids[1], ids[2]]
    assert not leaked(engine)


def test_n_samples_share_the_prompt_blocks(model, tok, prompts):
    p = prompts[1] * 3  # 27 tokens: 2 blocks of 16
    engine = Engine(model, tok)
    engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True))
    engine.step()  # prefill the parent, fork two children
    seqs = engine.requests["0"].seqs
    tables = [s.block_table for s in seqs]
    assert len(seqs) == 3 and tables[0] == tables[1] == tables[2]
    assert engine.num_blocks_used == 2  # one prompt's blocks for three samples
    outs = engine.run_to_completion()
    ref = generate(model, [p], greedy(12))[0]
    assert [o.token_ids for o in outs[0].outputs] == [ref, ref, ref]
    assert [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert not leaked(engine)


def test_stop_strings_cut_the_text_and_streams_never_show_them(model, tok, prompts):
    full = tok.decode(generate(model, [prompts[0]], greedy(40))[0])
    stop = full[20:24]  # a piece from the middle of the greedy text
    cut = full[: full.index(stop)]
    engine = Engine(model, tok)
    streamed = []
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    engine.add_request(prompts[0], params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()  # each step's outputs: what a stream would send
    streamed = [o.outputs[0].text for o in outputs]
    out = outputs[-1].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (cut, "stop", stop)
    assert all(cut.startswith(s) for s in streamed) and streamed[-1] == cut
    assert not leaked(engine)


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc", ["cde"], 1), ("abcd", ["cde"], 2), ("abc", ["xyz"], 0), ("a\n", ["\n\n", "a\nb"], 2)],
)
def test_stop_text_holdback(text, stops, held):
    assert stop_text_holdback(text, stops) == held


def test_seeded_sampling_is_the_same_alone_and_batched(model, tok, workload):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    alone = run(Engine(model, tok), [workload[3]], params)[0].outputs[0].token_ids
    crowded = Engine(model, tok, num_blocks=12, block_size=4)
    others = BaseParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    for p in workload[:3]:
        crowded.add_request(p, others)
    crowded.add_request(workload[3], params, request_id="seeded")
    outs = {o.request_id: o for o in crowded.run_to_completion()}
    assert outs["seeded"].outputs[0].token_ids == alone
    assert crowded.scheduler.num_preemptions > 0


def test_requests_that_can_never_run_are_refused(model, tok):
    engine = Engine(model, tok, num_blocks=4, block_size=4, max_num_seqs=2)
    with pytest.raises(ValueError, match="lower max_tokens"):
        engine.add_request([1] * 10, greedy(10))  # 20 tokens > 4 blocks of 4
    with pytest.raises(ValueError, match="context"):
        Engine(model, tok).add_request([1] * 250, greedy(10))
    with pytest.raises(ValueError, match="n=3 exceeds max_num_seqs"):
        engine.add_request([1], SamplingParams(n=3))
    assert not engine.has_unfinished()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(
        st.tuples(
            st.integers(1, 20),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(1, 3),  # n
            st.one_of(st.none(), st.integers(0, 8)),  # abort after this many steps
        ),
        min_size=1,
        max_size=6,
    ),
    num_blocks=st.integers(9, 24),
    max_num_seqs=st.integers(1, 6),
)
def test_no_block_leaks_after_a_random_workload(model, tok, jobs, num_blocks, max_num_seqs):
    engine = Engine(model, tok, num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs)
    aborts, limits = {}, {}
    for i, (length, max_tokens, n, abort_at) in enumerate(jobs):
        prompt = [(7 * i + j) % 50 + 1 for j in range(length)]  # some shared prefixes
        params = SamplingParams(
            temperature=0.8, max_tokens=max_tokens, n=min(n, max_num_seqs), seed=i
        )
        rid = engine.add_request(prompt, params)
        limits[rid] = max_tokens
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(rid)
    step, finished = 0, {}
    while engine.has_unfinished():
        for rid in aborts.get(step, []):
            if (out := engine.abort(rid)) is not None:
                finished[rid] = out
        for out in engine.step():
            finished[out.request_id] = out
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert set(finished) == set(limits)
    for rid, out in finished.items():
        assert out.finished
        for o in out.outputs:
            assert o.finish_reason == "abort" or 1 <= len(o.token_ids) <= limits[rid]
    assert not leaked(engine)


def test_llm_offline_api_shape(model, prompts):
    llm = LLM()
    texts = ["In the beginning", "Blessed"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    tok = llm.get_tokenizer()
    ref = generate(model, [tok.encode(texts[0])], BaseParams(temperature=0, max_tokens=8))[0]
    assert outs[0].outputs[0].token_ids == ref
    assert outs[0].outputs[0].text == tok.decode(ref)
    assert outs[0].outputs[0].finish_reason in ("stop", "length")
    one = llm.generate({"prompt_token_ids": prompts[0]}, BaseParams(max_tokens=3, seed=1))
    assert one[0].prompt is None and len(one[0].outputs[0].token_ids) <= 3
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(texts, [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="context"):
        llm.generate(["fine", "x " * 300])
    assert not llm.engine.has_unfinished()  # the good prompt was not left queued
