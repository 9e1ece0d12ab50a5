"""Chapter 08's streaming measurements: the engine's cost per streamed token after the forward
(`stream_cost`, with the real forward or replayed ids) and, for contrast, what re-decoding the
whole output per token costs (`naive_decode_cost`). `python -m benchmarks.streaming` runs them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from minillm.bench.workload import SEED
from minillm.engine import Engine
from minillm.engine.scheduler import Sampled
from minillm.generation import greedy_params
from minillm.model import ModelConfig, random_model


def long_context_model() -> Any:
    """The bundled model's shapes, random weights, 8192 positions and no EOS."""
    cfg = ModelConfig(max_position_embeddings=8192, eos_token_id=None)
    return random_model(cfg, seed=SEED)


def stream_cost(
    model: Any, tokenizer: Any, n: int, replay: list[int] | None = None
) -> dict[str, Any]:
    """Seconds per output token spent after the forward, for one streamed request: the mean,
    and the median over the last 256 tokens (robust to a load spike on a shared machine; at
    the end of a long output is where a quadratic streamer would show).

    `replay`: token ids to stream instead of running the model (the runner replaced by a
    script), so that nothing but the streaming machinery runs: with the real forward, a
    4096-token context's attention also evicts the CPU caches the Python code after it reads,
    which slows every line of it alike and is not the streamer's doing."""
    engine = Engine(model, tokenizer, max_num_seqs=1, num_blocks=-(-(n + 16) // 16))
    if replay is not None:
        script = iter(replay)
        engine.runner.run = lambda batch: [
            Sampled(next(script)) for item in batch.items for _ in item.samplers
        ]
    params = greedy_params(n, output_kind="delta", stop=["@@never@@"])
    received = []
    engine.add_request([1, 2, 3, 4], params)
    per_step = []
    while engine.has_unfinished():
        before = engine.time_in["postprocess"]
        received += engine.step()
        per_step.append(engine.time_in["postprocess"] - before)
    text = "".join(o.outputs[0].text for o in received)
    ids = [t for o in received for t in o.outputs[0].token_ids]
    assert len(ids) == n and text == tokenizer.decode(ids), "the deltas do not add up"
    return {
        "tokens": n,
        "ids": ids,
        "postprocess_s_per_token": engine.time_in["postprocess"] / n,
        "postprocess_s_median_last_256": statistics.median(per_step[-256:]),
        "run_s_per_token": engine.time_in["run"] / n,
        "streamed_chars": len(text),
    }


def naive_decode_cost(tokenizer: Any, ids: list[int], at: int, repeats: int = 20) -> float:
    """Seconds to decode the first `at` ids again (what a naive streamer does per token)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokenizer.decode(ids[:at])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
