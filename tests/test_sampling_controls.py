"""Sampling controls, each against a reference implementation of its definition written
here in plain Python: vLLM's penalties (presence, frequency, repetition), `logit_bias`,
`min_tokens`; log-probabilities against the log-softmax of a full forward (no cache) at
every position, generated and prompt; `best_of` against ranking an n=best_of run by hand.
The same SamplingParams drive `generate` and the engine: one sampling path."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import generate, generate_naive, load_tokenizer
from minillm.engine import Engine, SamplingParams
from minillm.generation.processors import History, adjust_logits
from minillm.generation.sampling import make_generator, sample

VOCAB = 12


def reference_adjust(logits, prompt, output, params, stops):
    """vLLM's definitions, token by token: min_tokens masks the stop ids, logit_bias adds,
    then repetition (prompt or output; divide a positive logit, multiply a negative one),
    frequency (count in the output) and presence (in the output at all)."""
    out = [float(x) for x in logits]
    if len(output) < params.min_tokens:
        for t in stops:
            out[t] = -math.inf
    for t, bias in (params.logit_bias or {}).items():
        out[t] += bias
    counts, seen = Counter(output), set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            r = params.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= params.frequency_penalty * counts[t]
        out[t] -= params.presence_penalty * (counts[t] > 0)
    return out


penalty = st.floats(-2, 2, allow_nan=False)
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
    prompt=tokens,
    output=tokens,
    presence=penalty,
    frequency=penalty,
    repetition=st.floats(0.5, 2.0),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    min_tokens=st.integers(0, 4),
)
def test_adjustments_equal_the_reference_definitions(
    logits, prompt, output, presence, frequency, repetition, bias, min_tokens
):
    params = SamplingParams(
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=bias,
        min_tokens=min_tokens,
        max_tokens=8,
    )
    stops = {0, 3}
    history = History(prompt + output, len(prompt), stops)
    ours = adjust_logits(torch.tensor([logits]), params, [history])[0].tolist()
    want = reference_adjust(logits, prompt, output, params, stops)
    for a, b in zip(ours, want, strict=True):
        assert a == b or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (ours, want)


def reference_greedy(model, prompt, params, stops):
    """Greedy decoding from full forwards (no cache), adjusted by the reference above."""
    out = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + out]))[0, -1].double().tolist()
            adjusted = reference_adjust(logits, prompt, out, params, stops)
            out.append(max(range(len(adjusted)), key=adjusted.__getitem__))
            if out[-1] in stops and len(out) > params.min_tokens:
                break
    return out


CONTROLS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0, frequency_penalty=-0.5),
    "bias": dict(logit_bias={11: 9.0, 7: 5.0, 264: -100.0}),
    "min_tokens": dict(min_tokens=6, logit_bias={0: 30.0}),  # EOS (id 0) forced, held off
}


@pytest.mark.parametrize("name", CONTROLS)
def test_greedy_with_controls_equals_the_reference_in_engine_and_generate(model, prompts, name):
    params = SamplingParams(temperature=0, max_tokens=12, **CONTROLS[name])
    stops = {model.config.eos_token_id}
    want = [reference_greedy(model, p, params, stops) for p in prompts]
    engine = Engine(model, load_tokenizer(), max_num_batched_tokens=4)  # chunked prompts
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {o.request_id: o.outputs[0] for o in engine.run_to_completion()}
    assert [outs[i].token_ids for i in ids] == want
    assert [generate(model, [p], params)[0] for p in prompts] == want
    assert [generate_naive(model, p, params) for p in prompts] == want
    if name == "min_tokens":  # 6 tokens, then EOS: the earliest a stop may come
        assert all(len(w) == 7 and w[-1] == 0 and 0 not in w[:-1] for w in want)
        assert {outs[i].finish_reason for i in ids} == {"stop"}
    else:
        plain = SamplingParams(temperature=0, max_tokens=12)
        assert [
            generate(model, [p], plain)[0] for p in prompts
        ] != want  # the control changed something: the test can fail


def test_seeded_sampling_with_controls_is_one_path(model, prompts):
    """Engine (batched, preempted) and `generate` draw the same tokens for the same seed."""
    controls = dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 3.0})
    params = SamplingParams(
        temperature=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True, **controls
    )
    want = [generate(model, [p], params)[0] for p in prompts]
    engine = Engine(model, load_tokenizer(), num_blocks=8, block_size=4)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}
    assert [outs[i] for i in ids] == want
    assert engine.scheduler.num_preemptions > 0


def test_a_tiny_repetition_penalty_samples_its_limit_not_nan():
    """Found by schemathesis: repetition_penalty=1e-300 divides a seen positive logit by ~0,
    giving +inf; the draw is then uniform over those tokens (the limit), never NaN."""
    logits = torch.tensor([[-2.0, 0.5, 0.3, -0.1, 1.0]])
    params = SamplingParams(repetition_penalty=1e-300, seed=0)
    seen = History([1, 2, 3], 3, ())
    draws = {int(sample(logits, params, make_generator(i), [seen])) for i in range(40)}
    assert draws == {1, 2}  # the seen tokens with positive logits, both drawn


def test_min_tokens_holds_off_stop_strings_too(model, prompts):
    tok = load_tokenizer()
    free = Engine(model, tok)
    free.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = free.run_to_completion()[0].outputs[0].text
    stop = text.split()[1]  # a word the model writes early
    for min_tokens, stopped_early in ((0, True), (20, False)):
        params = SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, stop=stop, min_tokens=min_tokens
        )
        engine = Engine(model, tok)
        engine.add_request(prompts[0], params)
        out = engine.run_to_completion()[0].outputs[0]
        assert (out.finish_reason == "stop") == stopped_early
        assert (len(out.token_ids) < 20) == stopped_early


def full_logprobs(model, ids):
    """log-softmax of a full forward at every position: row p scores token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def check_position(entry, token, row, k):
    """An engine logprob entry: the token's own logprob and rank, then the reference top k."""
    assert list(entry)[0] == token
    assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
    assert entry[token].rank == int((row > row[token] + 1e-6).sum()) + 1
    top = row.topk(k)
    for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert entry[t].logprob == pytest.approx(lp, abs=1e-4)
    assert len(entry) in (k, k + 1)


@pytest.mark.parametrize(
    "config",
    [dict(), dict(max_num_batched_tokens=3), dict(num_blocks=6, block_size=4)],
    ids=["plain", "chunked-prompt", "preempted"],
)
def test_logprobs_of_generated_and_prompt_tokens_equal_a_full_forward(model, prompts, config):
    tok = load_tokenizer()
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    engine = Engine(model, tok, **config)
    for _ in range(2):  # the second time the prompts' blocks are cached: still all computed
        ids = [engine.add_request(p, params) for p in prompts]
        outs = {o.request_id: o for o in engine.run_to_completion()}
        for p, rid in zip(prompts, ids, strict=True):
            out, sample = outs[rid], outs[rid].outputs[0]
            ref = full_logprobs(model, p + sample.token_ids)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            for pos in range(1, len(p)):
                check_position(out.prompt_logprobs[pos], p[pos], ref[pos - 1], 2)
            assert len(sample.logprobs) == len(sample.token_ids)
            for i, t in enumerate(sample.token_ids):
                check_position(sample.logprobs[i], t, ref[len(p) + i - 1], 3)
            want = sum(float(ref[len(p) + i - 1, t]) for i, t in enumerate(sample.token_ids))
            assert sample.cumulative_logprob == pytest.approx(want, abs=1e-3)


def test_streamed_logprobs_add_up_to_the_whole(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, prompt_logprobs=0)
    engine = Engine(model, load_tokenizer())
    engine.add_request(prompts[1], params)
    whole = engine.run_to_completion()[0]
    deltas = []
    engine.add_request(prompts[1], SamplingParams(**{**params.__dict__, "output_kind": "delta"}))
    while engine.has_unfinished():
        deltas += engine.step()
    assert sum((d.outputs[0].logprobs for d in deltas), []) == whole.outputs[0].logprobs
    sent = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert sent == [whole.prompt_logprobs]  # once, with the first output


def test_best_of_returns_the_n_most_likely_of_best_of_samples(model, prompts):
    tok = load_tokenizer()
    base = dict(temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    engine = Engine(model, tok)
    engine.add_request(prompts[0], SamplingParams(n=5, logprobs=0, **base))
    every = engine.run_to_completion()[0].outputs
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    engine.add_request(prompts[0], SamplingParams(n=2, best_of=5, **base))
    best = engine.run_to_completion()[0].outputs
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert [o.index for o in best] == [0, 1] and best[0].logprobs is None
    assert len({tuple(o.token_ids) for o in every}) > 2  # a real choice was made


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=math.inf), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={3: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(seed=2**63 - 2, best_of=3), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_bad_controls_are_refused_by_sampling_params(kwargs, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kwargs)


def test_engine_refuses_ids_outside_the_vocabulary_and_too_many_logprobs(model):
    engine = Engine(model, load_tokenizer(), max_num_seqs=4)
    for prompt, says in (([5, 4096], "4096 at position 1"), ([-1], "-1"), ([2**63], "2**63")):
        with pytest.raises(ValueError, match="token ids must be in"):
            engine.add_request(prompt, SamplingParams())
        del says
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5], SamplingParams(logit_bias={5000: 1.0}))
    with pytest.raises(ValueError, match="max_logprobs=20"):
        engine.add_request([5], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="best_of=5 exceeds max_num_seqs=4"):
        engine.add_request([5], SamplingParams(n=1, best_of=5))
    assert not engine.has_unfinished()
