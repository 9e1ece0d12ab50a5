"""Both ways of splitting a model over ranks (gloo processes on this CPU), held to one
contract: greedy tokens identical to one device's, batched, preempted by recompute or swap
and in small chunks; a rank that dies or hangs ends in an error, not a hang; `serve`
launched rank by rank through env:// answers the openai client with one device's text and
stops every rank on SIGTERM. The splits' own tests are test_tensor_parallel.py and
test_pipeline_parallel.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest

from minillm import LLM, SamplingParams
from minillm.bench.http_load import free_port
from minillm.engine import parallel
from minillm.engine import rank as rank_module

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["In the beginning", "And the LORD said unto Moses, Speak", "Blessed are the", "Amen"]
KINDS = ["tensor", "pipeline"]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def split(kind: str, **settings) -> LLM:
    return LLM(device="cpu", **{f"{kind}_parallel_size": 2}, **settings)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "settings",
    [
        {},  # batched, chunked prefill
        {"num_blocks": 6, "block_size": 8},  # preemption by recompute
        {"num_blocks": 6, "block_size": 8, "preemption_mode": "swap"},
        {"max_num_batched_tokens": 5, "max_num_seqs": 2},  # small chunks, a queue
    ],
)
def test_greedy_tokens_identical_to_one_device(kind, settings):
    expected = tokens(LLM(device="cpu", **settings))
    two = split(kind, **settings)
    try:
        assert tokens(two) == expected
    finally:
        two.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_that_dies_fails_the_next_request_with_an_error(kind):
    llm = split(kind)
    try:
        ranks = llm.engine.runner.worker
        ranks.procs[0].kill()
        ranks.procs[0].join(5)
        start = time.monotonic()
        out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
        assert f"{kind}-parallel rank 1 exited" in out.error
        assert out.outputs[0].finish_reason == "abort"
        assert time.monotonic() - start < 5
    finally:
        llm.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_that_hangs_times_out_into_an_error(kind, monkeypatch):
    for module in (parallel, rank_module):  # rank 0's group and its shared-memory collectives
        monkeypatch.setattr(module, "TIMEOUT", timedelta(seconds=3))
    llm = split(kind)
    ranks = llm.engine.runner.worker
    try:
        os.kill(ranks.procs[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert all(o.error is not None and "stopped answering" in o.error for o in out)
        assert time.monotonic() - start < 20
        again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]  # fails at once now
        assert "restart the engine" in again.error
    finally:
        ranks.procs[0].kill()
        llm.close()


def _serve(rank: int, port: int, master: int, extra: list[str]) -> subprocess.Popen:
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master),
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "minillm", "serve", "--port", str(port), *extra]
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


def wait_until_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited ({server.returncode}): {server.stderr.read()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no /health answer on port {port} in {timeout} s")


@pytest.mark.parametrize("kind", KINDS)
def test_serve_launched_rank_by_rank_answers_openai_with_one_ranks_text(kind):
    """Two separate launches meeting through env:// (as on two machines), then SIGTERM to
    rank 0 stops both; Ctrl-C on rank 1 alone is ignored (rank 0 owns shutdown). Rank 1
    learns from rank 0 whether it holds a shard or a stage."""
    openai = pytest.importorskip("openai")
    port, master = free_port(), free_port()
    one = LLM(device="cpu")
    prompt, n = "And the LORD said unto Moses", 16
    expected = one.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0]
    args = [f"--{kind}-parallel-size", "2", "--device", "cpu"]
    worker = _serve(1, port, master, args)
    server = _serve(0, port, master, args)
    try:
        wait_until_healthy(port, server, timeout=90)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.completions.create(
            model="minillm-bundled", prompt=prompt, max_tokens=n, temperature=0
        )
        assert reply.choices[0].text == expected.outputs[0].text
        worker.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert worker.poll() is None  # still serving its shard
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == -signal.SIGTERM  # uvicorn re-raises it after its shutdown
        assert worker.wait(30) == 0  # stopped by rank 0's close, not killed
    finally:
        for proc in (server, worker):
            proc.kill()
            proc.wait()
