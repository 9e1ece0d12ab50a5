"""The engine's output contract: what `step()` and `abort()` return is all a client needs.

A streaming client (the server, AsyncEngine) sees only the outputs of `step()`; it never
reads the engine's sequences. Two engines run the same requests in lock step, one emitting
deltas and one cumulative outputs, under preemption and chunked prefill, with n > 1,
best_of, logprobs, prompt logprobs, a stop string, and a request aborted midway. After
every step, a client that only joined the deltas must hold exactly what the cumulative
engine says, field by field; when everything is done, neither engine holds anything of the
requests (the sequence, its blocks and its detokenizer were their one owner).
"""

from dataclasses import replace

from minillm import load_tokenizer
from minillm.engine import Engine, SamplingParams

# Tight pool (preemption), chunks of at most 6 tokens, samples seeded so both engines draw
# the same tokens.
CONFIG = dict(num_blocks=12, block_size=4, max_num_seqs=12, max_num_batched_tokens=6)
ABORTED, ABORT_AT_STEP = "sampled", 5


def requests(prompts, stop: str) -> dict[str, tuple[list[int], SamplingParams]]:
    a, b, c = prompts
    return {
        "greedy": (b + a, SamplingParams(temperature=0, max_tokens=12)),
        "n2": (a, SamplingParams(n=2, temperature=0.9, seed=7, logprobs=2, max_tokens=10)),
        "best_of": (c, SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=6)),
        "prompt_lp": (c + a, SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=5)),
        "stop": (b, SamplingParams(temperature=0, stop=[stop], max_tokens=16)),
        ABORTED: (a + b, SamplingParams(temperature=0.7, seed=1, max_tokens=30)),
    }


class DeltaClient:
    """What a streaming client keeps: per request and sample, the joined deltas."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    def take(self, out) -> None:
        state = self.seen.setdefault(out.request_id, {"samples": {}, "prompt_logprobs": None})
        state |= dict(
            prompt=out.prompt_token_ids,
            finished=out.finished,
            error=out.error,
            cached=out.num_cached_tokens,
        )
        if out.prompt_logprobs is not None:
            assert state["prompt_logprobs"] is None, "prompt logprobs were sent twice"
            state["prompt_logprobs"] = out.prompt_logprobs
        for o in out.outputs:
            s = state["samples"].setdefault(o.index, dict(text="", ids=[], logprobs=[]))
            s["text"] += o.text
            s["ids"] += o.token_ids
            s["logprobs"] += o.logprobs or []
            s |= dict(finish=o.finish_reason, stop=o.stop_reason, cum=o.cumulative_logprob)


def as_client_state(out) -> dict:
    """A cumulative output in the client's shape."""
    samples = {
        o.index: dict(
            text=o.text,
            ids=o.token_ids,
            logprobs=o.logprobs or [],
            finish=o.finish_reason,
            stop=o.stop_reason,
            cum=o.cumulative_logprob,
        )
        for o in out.outputs
    }
    return dict(
        samples=samples,
        prompt_logprobs=out.prompt_logprobs,
        prompt=out.prompt_token_ids,
        finished=out.finished,
        error=out.error,
        cached=out.num_cached_tokens,
    )


def holds_nothing(engine: Engine) -> bool:
    m, s = engine.manager, engine.scheduler
    queued = s.running or s.waiting or s.swapped
    return m.num_free_blocks == m.num_blocks and not queued and not engine.requests


def test_the_step_outputs_carry_everything_a_client_needs(model, prompts):
    tok = load_tokenizer()
    probe = Engine(model, tok)  # a stop string the greedy reply really contains
    probe.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=16))
    text = probe.run_to_completion()[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"the probe's reply {text!r} has no two characters to stop on"

    work = requests(prompts, stop)
    delta, cumulative = Engine(model, tok, **CONFIG), Engine(model, tok, **CONFIG)
    for rid, (ids, params) in work.items():
        delta.add_request(ids, replace(params, output_kind="delta"), request_id=rid)
        cumulative.add_request(ids, params, request_id=rid)
    client, latest = DeltaClient(), {}
    step = 0
    while delta.has_unfinished() or cumulative.has_unfinished():
        step += 1
        outs_d, outs_c = delta.step(), cumulative.step()
        if step == ABORT_AT_STEP:
            outs_d.append(delta.abort(ABORTED))
            outs_c.append(cumulative.abort(ABORTED))
        for out in outs_d:
            client.take(out)
        for out in outs_c:
            latest[out.request_id] = as_client_state(out)
        # After each step the delta client knows what the cumulative outputs say (best_of
        # requests emit only once finished, in both kinds).
        for rid, state in latest.items():
            assert client.seen.get(rid) == state, f"step {step}, request {rid!r}"
        assert step < 500, "the engines did not finish"

    assert set(latest) == set(work), f"requests with no output: {set(work) - set(latest)}"
    assert delta.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert latest[ABORTED]["samples"][0]["finish"] == "abort"
    assert latest["stop"]["samples"][0]["stop"] == stop
    assert stop not in latest["stop"]["samples"][0]["text"]
    assert len(latest["prompt_lp"]["prompt_logprobs"]) == len(work["prompt_lp"][0])
    assert sorted(latest["n2"]["samples"]) == [0, 1] and list(latest["best_of"]["samples"]) == [0]
    assert all(lp for s in latest["n2"]["samples"].values() for lp in s["logprobs"])
    for engine in (delta, cumulative):
        assert holds_nothing(engine), "a finished request left state in the engine"
