"""Pipeline parallelism: the layers in stages over N ranks, with one step in flight a stage,
compute what one device does.

The stages chained in one process give the whole model's logits within 1e-4 and hold only
their own weights; on ranks, greedy tokens are identical to one device's on TinyLlama's shape
and in three stages; two steps are in flight at once, a request aborted while its step is in
one leaves the others' tokens alone, and a failing step fails only its own request. What
both splits must do (tokens when batched, preempted or chunked, dead and hung ranks, serve
over env://) is test_parallel_engines.py.
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine.worker import CacheSettings, Step, Worker
from minillm.model.config import ModelConfig
from minillm.model.pipeline import load_stage, stage_layers
from minillm.model.shapes import CONFIGS, write_random_checkpoint
from minillm.model.weights import BUNDLED_DIR, load_config, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["In the beginning", "And the LORD said unto Moses, Speak", "Blessed are the", "Amen"]


@pytest.fixture(scope="module")
def tinyllama_dir(tmp_path_factory):
    """TinyLlama-1.1B's layer shape (32 heads, 4 KV heads, width 2048, MLP 5632), two layers
    and the bundled tokenizer's 4096-token vocabulary, untied, in indexed files."""
    out = tmp_path_factory.mktemp("tinyllama")
    overrides = {"num_hidden_layers": 2, "vocab_size": 4096, "max_position_embeddings": 256}
    return write_random_checkpoint(
        "TinyLlama-1.1B", out, dtype=torch.float16, max_shard_bytes=2**25, **overrides
    )


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_stages_are_balanced_by_the_weights_they_read():
    tiny = ModelConfig.from_hf(CONFIGS["TinyLlama-1.1B"])  # its head weighs 1.5 layers
    assert stage_layers(tiny, 2) == [(0, 12), (12, 22)]
    for size in range(1, 23):
        bounds = stage_layers(tiny, size)
        assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]]  # consecutive
        assert bounds[0][0] == 0 and bounds[-1][1] == 22
        assert all(b > a for a, b in bounds)
    with pytest.raises(ValueError, match="from 1 to 22"):
        stage_layers(tiny, 23)


@pytest.mark.parametrize("size", [2, 3])
def test_stages_chained_give_the_whole_models_logits(tinyllama_dir, size):
    model_dir = BUNDLED_DIR if size == 3 else tinyllama_dir
    cfg, settings = load_config(model_dir), CacheSettings(num_blocks=16, block_size=4)
    whole = Worker(load_model(model_dir), settings)
    stages = [
        Worker(load_stage(model_dir, cfg, a, b), settings) for a, b in stage_layers(cfg, size)
    ]
    prompt = [5, 17, 300, 41, 9, 88, 1000, 7, 3]
    first = Step(prompt[:6], list(range(6)), [5], [], [([0, 1], 6)])
    second = Step([12, *prompt[6:]], [0, 6, 7, 8], [0, 1, 2, 3], [[2]], [([0, 1, 3], 3)])
    for step in (first, second):
        hidden = None
        for stage in stages:
            hidden = stage.execute(step, hidden)
        torch.testing.assert_close(hidden, whole.execute(step), atol=1e-4, rtol=0)
    if not cfg.tie_word_embeddings:  # every weight on exactly one stage, the rest on meta
        held = sum(p.numel() for w in stages for p in w.model.parameters() if not p.is_meta)
        assert held == whole.model.num_parameters()


def test_greedy_tokens_identical_on_tinyllama_and_three_stages(tinyllama_dir):
    expected = tokens(LLM(str(tinyllama_dir), device="cpu"))
    two = LLM(str(tinyllama_dir), device="cpu", pipeline_parallel_size=2)
    try:
        assert tokens(two) == expected
    finally:
        two.close()
    expected = tokens(LLM(device="cpu"), PROMPTS * 2)
    three = LLM(device="cpu", pipeline_parallel_size=3)
    try:
        assert tokens(three, PROMPTS * 2) == expected
    finally:
        three.close()


def test_two_steps_in_flight_and_an_abort_inside_one():
    """8 requests make two steps of 4 in flight; aborting a request (n=2, its children
    forked by the step in flight) leaves every other request's tokens as one device gives
    them, and every block back in the pool."""
    params = [GREEDY] * 8
    params[5] = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(device="cpu").generate(PROMPTS * 2, params)]
    llm = LLM(device="cpu", pipeline_parallel_size=2)
    engine = llm.engine
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS * 2, params, strict=True)]
        first = engine.step()
        assert len(engine.in_flight) == 1  # the other half's step is still in the pipeline
        in_flight = {s.request_id for s in engine.in_flight[0][0].sequences()}
        assert len(first) == 4 and not in_flight & {o.request_id for o in first}
        assert ids[5] in in_flight
        assert engine.abort(ids[5]).outputs[0].finish_reason == "abort"
        done = {o.request_id: o for o in engine.run_to_completion()}
        assert ids[5] not in done
        for i, request_id in enumerate(ids):
            if i != 5:
                assert done[request_id].outputs[0].token_ids == expected[i]
        assert engine.num_blocks_used == 0 and not engine.in_flight
    finally:
        llm.close()


def test_a_failing_step_fails_only_its_own_request(monkeypatch):
    """The last stage (rank 0) raises on any step holding the prompt 5, 6, 7: that request
    is aborted with the error, the others get their tokens, in flight or not."""
    prompts = [[5, 6, 7], [5, 6, 8], [9, 10, 11], [12, 13, 14]]
    expected = tokens(LLM(device="cpu"), prompts[1:])
    llm = LLM(device="cpu", pipeline_parallel_size=2)
    local = llm.engine.runner.worker.local
    execute = local.execute

    def fragile(step, hidden=None):
        if any(step.ids[i : i + 3] == [5, 6, 7] for i in range(len(step.ids))):
            raise RuntimeError("this step holds the prompt 5, 6, 7")
        return execute(step, hidden)

    monkeypatch.setattr(local, "execute", fragile)
    try:
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert "5, 6, 7" in out[0].error and out[0].outputs[0].finish_reason == "abort"
        assert [o.outputs[0].token_ids for o in out[1:]] == expected
    finally:
        llm.close()


def test_what_cannot_run_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="set one of them to 1"):
        LLM(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="from 1 to 4"):
        LLM(pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        LLM(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="take hidden states: use 'eager'"):
        LLM(device="cpu", pipeline_parallel_size=2, decode_mode="static")
