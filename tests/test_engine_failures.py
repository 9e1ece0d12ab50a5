"""A request that fails inside an engine step is aborted alone, with its error, and the
requests it shared the step with get exactly the tokens they get alone: a failure in the
batched forward, in one sequence's draw, in its detokenization, in delivering its output."""

import threading

import pytest
from helpers import greedy

from minillm import generate, load_tokenizer
from minillm.engine import Engine, SamplingParams
from minillm.engine.sequence import Sequence


@pytest.fixture(scope="module")
def workload(prompts):
    a, b, c = prompts
    return [b, c, a, b + a, a + c, c + a + b, b * 2, a]


@pytest.fixture(scope="module")
def alone(model, workload):
    return [generate(model, [p], greedy(12))[0] for p in workload]


def run_with(engine, workload, bad_prompt, bad_params=None):
    ids = [engine.add_request(p, greedy(12)) for p in workload[:4]]
    bad = engine.add_request(bad_prompt, bad_params or greedy(12), request_id="bad")
    ids += [engine.add_request(p, greedy(12)) for p in workload[4:]]
    outs = {o.request_id: o for o in engine.run_to_completion()}
    return [outs[i].outputs[0].token_ids for i in ids], outs.get(bad), engine


def free(engine) -> bool:
    m = engine.manager
    return m.num_free_blocks == m.num_blocks and not engine.requests


def test_an_id_outside_the_vocabulary_in_the_forward_fails_only_its_request(
    model, workload, alone, monkeypatch
):
    engine = Engine(model, load_tokenizer())
    monkeypatch.setattr(engine, "check_request", lambda *args: None)  # slip past the check
    tokens, bad, engine = run_with(engine, workload, [5, 99999])
    assert tokens == alone
    assert bad.finished and bad.outputs[0].finish_reason == "abort"
    assert "IndexError" in bad.error and free(engine)


def test_a_failing_draw_fails_only_its_sequence_s_request(model, workload, alone, monkeypatch):
    history = Sequence.history

    def broken(seq, stops):
        if seq.request_id == "bad":
            raise RuntimeError("broken sampler state")
        return history(seq, stops)

    monkeypatch.setattr(Sequence, "history", broken)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=12, n=3)
    tokens, bad, engine = run_with(Engine(model, load_tokenizer()), workload, workload[0], params)
    assert tokens == alone
    assert {o.finish_reason for o in bad.outputs} == {"abort"}
    assert "broken sampler state" in bad.error and free(engine)


def test_a_failing_detokenization_fails_only_its_request(model, workload, alone):
    tok = load_tokenizer()
    forced = 1234  # a token none of the good requests generates
    assert all(forced not in a for a in alone)

    class Fussy(type(tok)):
        def decode(self, ids, skip_special_tokens=True):
            if forced in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "cannot decode")
            return super().decode(ids, skip_special_tokens)

    fussy = Fussy(tok.model_dir)
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={forced: 100.0})
    tokens, bad, engine = run_with(Engine(model, fussy), workload, workload[1], params)
    assert tokens == alone
    assert "UnicodeDecodeError" in bad.error and free(engine)


def test_a_consumer_that_raises_loses_only_its_own_request(model, workload, alone):
    """The engine returns its outputs; the server's engine thread hands them on. A
    consumer that raises is dropped there, and the other requests never notice."""
    from minillm.serving.async_engine import AsyncEngine

    engine = Engine(model, load_tokenizer())
    core, finals, done = AsyncEngine(engine), {}, threading.Event()

    def keep(out):
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == len(workload):
                done.set()

    def gone(_out):
        raise RuntimeError("the client's queue is closed")

    core.start()
    try:
        ids = [core.add(p, greedy(12), keep) for p in workload]
        bad = core.add(workload[2], greedy(12), gone)
        assert done.wait(timeout=60), "the good requests did not finish"
    finally:
        core.stop(timeout=5)
    assert [finals[i].outputs[0].token_ids for i in ids] == alone
    assert bad not in finals and bad not in engine.requests and free(engine)
