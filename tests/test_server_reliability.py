"""The server under hostile and heavy traffic, on loopback only, every wait bounded:

- 70 malformed or hostile requests: each gets a 4xx with OpenAI's error JSON, and the
  server is healthy after each (nothing left running, /health answers);
- a 500 is OpenAI-shaped and carries no traceback;
- one bad request among 16 good concurrent ones (refused, or failing inside the engine)
  leaves the good ones' tokens identical to isolated runs;
- 64 concurrent streams, half of them dropped by their clients at random points: every KV
  block comes back and the finished streams' greedy text is unchanged;
- a preemption-heavy small pool: seeded samples identical to isolated runs;
- /health stays under 100 ms while maximal requests are parsed and run;
- SIGTERM ends `python -m minillm serve` in bounded time with a stuck request or step.
"""

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving import CHATML, free_port, running

from minillm import load_tokenizer
from minillm.engine import Engine, SamplingParams
from minillm.serving.api_server import create_app

NAME = "bundled"
# ChatML that refuses a conversation opening with the assistant, as many real templates do.
RAISING = (
    "{% if messages[0].role == 'assistant' %}"
    "{{ raise_exception('Conversation roles must start with user or system') }}{% endif %}"
) + CHATML
C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "Hi"}]


def raw(text: str) -> dict:
    return {"content": text.encode(), "headers": {"content-type": "application/json"}}


def chunks(n: int):
    for _ in range(n):
        yield b"x" * 2**20


# fmt: off
HOSTILE = [  # (name, method, path, httpx kwargs, status, the error message says)
    ("id over vocab", "POST", C, {"json": {"prompt": [5, 99999]}}, 400, "99999 at position 1"),
    ("negative id", "POST", C, {"json": {"prompt": [-1]}}, 400, "must be in [0, 4096)"),
    ("id >= 2**63", "POST", C, {"json": {"prompt": [2**63]}}, 400, "must be in [0, 4096)"),
    ("float id", "POST", C, {"json": {"prompt": [1.5]}}, 400, "prompt"),
    ("bool in ids", "POST", C, {"json": {"prompt": [[True]]}}, 400, "prompt"),
    ("lone surrogate", "POST", C, raw('{"prompt": "\\ud800"}'), 400, "lone UTF-16 surrogate"),
    ("surrogate in chat", "POST", CHAT, raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400, "surrogate"),
    ("surrogate in stop", "POST", C, raw('{"prompt": "a", "stop": ["\\ud83d"]}'), 400, "surrogate"),
    ("NaN temperature", "POST", C, raw('{"prompt": "a", "temperature": NaN}'), 400, "NaN"),
    ("Infinity top_p", "POST", C, raw('{"prompt": "a", "top_p": Infinity}'), 400, "Infinity"),
    ("huge temperature", "POST", C, raw('{"prompt": "a", "temperature": 1e400}'), 400, "overflows"),
    ("negative temperature", "POST", C, {"json": {"prompt": "a", "temperature": -1}}, 400, "temperature"),
    ("top_p 0", "POST", C, {"json": {"prompt": "a", "top_p": 0}}, 400, "top_p"),
    ("seed 2**64", "POST", C, {"json": {"prompt": "a", "seed": 2**64}}, 400, "seed"),
    ("seed+1 overflows", "POST", C, {"json": {"prompt": "a", "seed": 2**63 - 1, "n": 2}}, 400, "seed"),
    ("negative seed", "POST", C, {"json": {"prompt": "a", "seed": -1}}, 400, "seed"),
    ("false as seed", "POST", C, {"json": {"prompt": "a", "seed": False}}, 400, "seed"),
    ("true as max_tokens", "POST", C, {"json": {"prompt": "a", "max_tokens": True}}, 400, "max_tokens"),
    ("'yes' as a bool", "POST", C, {"json": {"prompt": "a", "ignore_eos": "yes"}}, 400, "ignore_eos"),
    ("n 0", "POST", C, {"json": {"prompt": "a", "n": 0}}, 400, "n=0"),
    ("n 1000", "POST", C, {"json": {"prompt": "a", "n": 1000}}, 400, "max_num_seqs"),
    ("best_of < n", "POST", C, {"json": {"prompt": "a", "n": 3, "best_of": 2}}, 400, "best_of"),
    ("best_of streamed", "POST", C, {"json": {"prompt": "a", "best_of": 3, "stream": True}}, 400, "streamed"),
    ("max_tokens -1", "POST", C, {"json": {"prompt": "a", "max_tokens": -1}}, 400, "max_tokens"),
    ("max_tokens 0", "POST", C, {"json": {"prompt": "a", "max_tokens": 0}}, 400, "echo=true"),
    ("max_tokens 10**30", "POST", C, {"json": {"prompt": "a", "max_tokens": 10**30}}, 400, "context"),
    ("max_tokens string", "POST", C, {"json": {"prompt": "a", "max_tokens": "many"}}, 400, "max_tokens"),
    ("empty prompt", "POST", C, {"json": {"prompt": ""}}, 400, "empty"),
    ("empty id list", "POST", C, {"json": {"prompt": []}}, 400, "empty"),
    ("empty prompt in batch", "POST", C, {"json": {"prompt": [[1], []]}}, 400, "empty"),
    ("65 prompts", "POST", C, {"json": {"prompt": ["a"] * 65}}, 400, "at most 64"),
    ("4000 characters", "POST", C, {"json": {"prompt": "a" * 4000}}, 400, "characters"),
    ("prompt past context", "POST", C, {"json": {"prompt": [5] * 300}}, 400, "context"),
    ("logprobs 21", "POST", C, {"json": {"prompt": "a", "logprobs": 21}}, 400, "max_logprobs"),
    ("logprobs -1", "POST", C, {"json": {"prompt": "a", "logprobs": -1}}, 400, "logprobs"),
    ("logit_bias key", "POST", C, {"json": {"prompt": "a", "logit_bias": {"x": 1}}}, 400, "token id"),
    ("logit_bias Arabic digit", "POST", C, {"json": {"prompt": "a", "logit_bias": {"\u0667": 1}}}, 400, "ASCII digits"),
    ("logit_bias superscript", "POST", C, {"json": {"prompt": "a", "logit_bias": {"\u00b2": 1}}}, 400, "ASCII digits"),
    ("logit_bias doubled minus", "POST", C, {"json": {"prompt": "a", "logit_bias": {"--5": 1}}}, 400, "ASCII digits"),
    ("logit_bias negative", "POST", C, {"json": {"prompt": "a", "logit_bias": {"-5": 1}}}, 400, "ASCII digits"),
    ("logit_bias space", "POST", C, {"json": {"prompt": "a", "logit_bias": {" 7": 1}}}, 400, "ASCII digits"),
    ("logit_bias plus", "POST", C, {"json": {"prompt": "a", "logit_bias": {"+7": 1}}}, 400, "ASCII digits"),
    ("logit_bias underscore", "POST", C, {"json": {"prompt": "a", "logit_bias": {"7_0": 1}}}, 400, "ASCII digits"),
    ("stream_options unstreamed", "POST", C, {"json": {"prompt": "a", "stream_options": {"include_usage": True}}}, 400, "stream=true"),
    ("chat stream_options unstreamed", "POST", CHAT, {"json": {"messages": USER, "stream_options": {"include_usage": True}}}, 400, "stream=true"),
    ("max_completion_tokens 0", "POST", CHAT, {"json": {"messages": USER, "max_completion_tokens": 0, "max_tokens": 5}}, 400, "max_completion_tokens=0"),
    ("max token fields disagree", "POST", CHAT, {"json": {"messages": USER, "max_completion_tokens": 3, "max_tokens": 5}}, 400, "disagree"),
    ("chat max_tokens 0", "POST", CHAT, {"json": {"messages": USER, "max_tokens": 0}}, 400, "max_tokens=0"),
    ("logit_bias id", "POST", C, {"json": {"prompt": "a", "logit_bias": {"99999": 1}}}, 400, "vocabulary"),
    ("logit_bias value", "POST", C, {"json": {"prompt": "a", "logit_bias": {"5": 1000}}}, 400, "[-100, 100]"),
    ("presence 3", "POST", C, {"json": {"prompt": "a", "presence_penalty": 3}}, 400, "presence_penalty"),
    ("repetition 0", "POST", C, {"json": {"prompt": "a", "repetition_penalty": 0}}, 400, "repetition_penalty"),
    ("min_tokens > max", "POST", C, {"json": {"prompt": "a", "max_tokens": 2, "min_tokens": 5}}, 400, "min_tokens"),
    ("stop id over vocab", "POST", C, {"json": {"prompt": "a", "stop_token_ids": [99999]}}, 400, "vocabulary"),
    ("stop as object", "POST", C, {"json": {"prompt": "a", "stop": {"x": 1}}}, 400, "stop"),
    ("tools", "POST", CHAT, {"json": {"messages": USER, "tools": []}}, 400, "tool calling"),
    ("response_format", "POST", CHAT, {"json": {"messages": USER, "response_format": {"type": "json_object"}}}, 400, "structured output"),
    ("suffix", "POST", C, {"json": {"prompt": "a", "suffix": "b"}}, 400, "suffix"),
    ("unknown field", "POST", C, {"json": {"prompt": "a", "frobnicate": 1}}, 400, "'frobnicate'"),
    ("echo on chat", "POST", CHAT, {"json": {"messages": USER, "echo": True}}, 400, "'echo'"),
    ("stream_options key", "POST", C, {"json": {"prompt": "a", "stream_options": {"x": 1}}}, 400, "stream_options.x"),
    ("other model", "POST", C, {"json": {"prompt": "a", "model": "gpt-4"}}, 404, "not served"),
    ("not JSON", "POST", C, {"content": b'{"prompt": '}, 400, "not valid JSON"),
    ("JSON array", "POST", C, {"json": ["a"]}, 400, "JSON object"),
    ("100k-deep nesting", "POST", C, {"content": b"[" * 100_000 + b"]" * 100_000}, 400, "not valid JSON"),
    ("not UTF-8", "POST", C, {"content": b'{"prompt": "\xff"}'}, 400, "not valid JSON"),
    ("3 MiB body", "POST", C, {"content": b"x" * (3 * 2**20)}, 413, "at most 2097152"),
    ("3 MiB chunked", "POST", C, {"content": chunks(3)}, 413, "at most 2097152"),
    ("GET completions", "GET", C, {}, 405, "GET is not allowed"),
    ("unknown route", "POST", "/v1/embeddings", {"json": {}}, 404, "no route"),
    ("empty messages", "POST", CHAT, {"json": {"messages": []}}, 400, "messages is empty"),
    ("tool role", "POST", CHAT, {"json": {"messages": [{"role": "tool", "content": "x"}]}}, 400, "role"),
    ("image part", "POST", CHAT, { "json": { "messages": [ {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]} ] } }, 400, "messages.0.content.0"),
    ("template raises", "POST", CHAT, {"json": {"messages": [{"role": "assistant", "content": "x"}]}}, 400, "must start with user"),
    ("top_logprobs alone", "POST", CHAT, {"json": {"messages": USER, "top_logprobs": 2}}, 400, "logprobs=true"),
    ("top_logprobs 50", "POST", CHAT, {"json": {"messages": USER, "logprobs": True, "top_logprobs": 50}}, 400, "top_logprobs=50 exceeds"),
    ("tokenize both", "POST", TOK, {"json": {"prompt": "a", "messages": USER}}, 400, "either"),
    ("detokenize over vocab", "POST", DETOK, {"json": {"tokens": [99999]}}, 400, "vocabulary"),
]
# fmt: on


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(model, tok):
    """(url, engine): 64 sequences at once, a template that can refuse a conversation."""
    engine = Engine(model, tok, max_num_seqs=64)
    with running(create_app(engine, NAME, RAISING)) as url:
        yield url, engine


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(next(x for x in text.splitlines() if x.startswith(f"minillm_{name} ")).split()[-1])


def settled(url: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until nothing runs and every KV block is free."""
    deadline = time.monotonic() + timeout
    while metric(url, "kv_blocks_used") or metric(url, "num_requests_running"):
        assert time.monotonic() < deadline, "requests or blocks left behind"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("name", "method", "path", "kwargs", "status", "says"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_hostile_request_gets_an_openai_error_and_the_server_stays_healthy(
    server, name, method, path, kwargs, status, says
):
    url = server[0]
    r = httpx.request(method, url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"], error
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    settled(url)


def test_there_are_at_least_40_hostile_requests():
    assert len(HOSTILE) >= 40


def test_a_500_is_openai_shaped_without_a_traceback(server, monkeypatch):
    url = server[0]
    from minillm.serving import metrics

    def broken(self):
        raise RuntimeError("secret internals at /srv/app.py line 42")

    monkeypatch.setattr(metrics.ServerMetrics, "render", broken)
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "secret" not in r.text and "Traceback" not in r.text and ".py" not in r.text


def test_fastapi_s_own_validation_errors_are_openai_json_too(model, tok):
    """FastAPI answers a parameter it validates itself with 422; here it is OpenAI's 400."""
    app = create_app(Engine(model, tok, max_num_seqs=2), NAME)

    async def typed(n: int) -> dict:
        return {"n": n}

    app.add_api_route("/typed", typed, methods=["GET"])
    with running(app) as url:
        r = httpx.get(url + "/typed?n=abc", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "query.n" and "integer" in r.json()["error"]["message"]


def offline_texts(model, tok, prompts, params) -> list[str]:
    outs = []
    for p in prompts:  # each alone
        engine = Engine(model, tok)
        engine.add_request(p, params)
        outs.append(engine.run_to_completion()[0].outputs[0].text)
    return outs


PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses",
    "Blessed are the",
    "And Jesus said",
    "Thou shalt not",
    "The LORD is my shepherd",
    "And it came to pass",
    "Let there be",
]
GOOD = [PROMPTS[i % 8] + " " * (i // 8) for i in range(16)]


async def _post(client, url, body):
    r = await client.post(url + C, json=body)
    return r.status_code, r.json()


def _good(client, url, max_tokens):
    """The 16 good requests (greedy, fixed length), as coroutines to gather."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [_post(client, url, {"prompt": p, **body}) for p in GOOD]


def test_a_bad_request_among_16_good_ones_leaves_their_tokens_alone(server, model, tok):
    url = server[0]
    want = offline_texts(
        model, tok, GOOD, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            good = _good(client, url, 40)
            bad = [
                _post(client, url, {"prompt": [5, 99999], "max_tokens": 40}),
                _post(client, url, {"prompt": "a", "seed": 2**64, "n": 2}),
            ]
            return await asyncio.gather(*good[:8], *bad, *good[8:])

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < 60
    statuses = [s for s, _ in results]
    assert statuses[8:10] == [400, 400] and statuses[:8] + statuses[10:] == [200] * 16
    texts = [b["choices"][0]["text"] for _, b in results[:8] + results[10:]]
    assert texts == want
    settled(url)


def test_a_request_failing_inside_the_engine_fails_alone(model, tok):
    """A tokenizer that cannot decode one token: the request forced to generate it is
    aborted with an error (stream: "abort" finish and an error event; JSON: 500); 16
    concurrent good requests get exactly their isolated tokens."""
    forced = 1234
    want = offline_texts(
        model, tok, GOOD, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )

    class Fussy(type(tok)):
        armed = False  # once the server is up (it decodes every token once, at start)

        def decode(self, ids, skip_special_tokens=True):
            if self.armed and forced in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken token")
            return super().decode(ids, skip_special_tokens)

    fussy = Fussy(tok.model_dir)
    engine = Engine(model, fussy, max_num_seqs=32)
    bad = {"prompt": "Let there be", "max_tokens": 30, "logit_bias": {str(forced): 100}}
    with running(create_app(engine, NAME)) as url:
        fussy.armed = True

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                good = _good(client, url, 30)

                async def streamed():
                    async with client.stream("POST", url + C, json={**bad, "stream": True}) as r:
                        return [
                            json.loads(x[6:])
                            for x in [x async for x in r.aiter_lines()]
                            if x.startswith("data: {")
                        ]

                return await asyncio.gather(
                    *good[:8], _post(client, url, bad), streamed(), *good[8:]
                )

        results = asyncio.run(main())
        assert [b["choices"][0]["text"] for _, b in results[:8] + results[10:]] == want
        status, body = results[8]
        assert status == 500 and "UnicodeDecodeError" in body["error"]["message"]
        events = results[9]
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert "UnicodeDecodeError" in events[-1]["error"]["message"]
        settled(url)


def test_64_streams_with_random_disconnects_free_every_block(server, model, tok):
    url, engine = server
    rng = random.Random(0)
    prompts = [PROMPTS[i % 8] for i in range(64)]
    want = dict(
        zip(
            PROMPTS,
            offline_texts(
                model, tok, PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
            ),
            strict=True,
        )
    )
    drop_after = [rng.randint(1, 30) if i % 2 else None for i in range(64)]  # half are dropped
    aborted_before = metric(url, "requests_aborted_total")
    peak = []

    async def one(client, prompt, drop):
        body = {
            "prompt": prompt,
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, n = "", 0
        async with client.stream("POST", url + C, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    n += 1
                    if drop is not None and n >= drop:
                        return None  # the client goes away mid-stream
        return text

    async def watch():
        while True:
            peak.append(engine.num_blocks_used)
            await asyncio.sleep(0.02)

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            watcher = asyncio.ensure_future(watch())
            out = await asyncio.gather(
                *(one(client, p, d) for p, d in zip(prompts, drop_after, strict=True))
            )
            watcher.cancel()
            return out

    start = time.monotonic()
    texts = asyncio.run(main())
    elapsed = time.monotonic() - start
    settled(url)
    finished = [(p, t) for p, t in zip(prompts, texts, strict=True) if t is not None]
    assert len(finished) == 32 and all(t == want[p] for p, t in finished)
    aborted = metric(url, "requests_aborted_total") - aborted_before
    assert aborted >= 30  # a client that drops after its last chunk may have finished first
    print(
        f"\n64 streams: 32 dropped, {int(aborted)} aborted, peak {max(peak)} blocks in use, "
        f"0 after; 32/32 finished greedy texts unchanged; {elapsed:.1f} s"
    )


def test_preemption_heavy_pool_keeps_seeded_samples(model, tok):
    params = dict(temperature=1.0, top_p=0.95, max_tokens=40, ignore_eos=True)
    alone = []
    for i, p in enumerate(GOOD):
        engine = Engine(model, tok)
        engine.add_request(p, SamplingParams(seed=100 + i, **params))
        alone.append(engine.run_to_completion()[0].outputs[0].text)
    engine = Engine(model, tok, num_blocks=24, block_size=8, max_num_seqs=16)
    with running(create_app(engine, NAME)) as url:

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(
                    *(
                        _post(client, url, {"prompt": p, "seed": 100 + i, **params})
                        for i, p in enumerate(GOOD)
                    )
                )

        results = asyncio.run(main())
        assert [b["choices"][0]["text"] for _, b in results] == alone
        assert metric(url, "preemptions_total") > 0
        settled(url)


def test_health_stays_fast_while_maximal_requests_are_handled():
    """The server in its own process (as deployed: the client's work must not count), fed
    2 MiB bodies of token ids, prompts at the length where they must be tokenized to be
    refused, and full-context echo requests with 20 logprobs, all at once; /health is
    asked every 5 ms meanwhile, from a thread of its own (the heavy client's reading and
    writing must not delay the probes either).

    A loop blocked by this work (tokenizing, JSON, logprobs on the event loop) stalls a
    probe for 0.9-1.6 s in every round. On a busy 2-core machine (two test workers beside
    the server) the OS scheduler alone delays one probe now and then, once by 0.83 s: so
    the bound must hold in one of two rounds, and a second round runs only when the first
    one missed it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port)
    ids_body = json.dumps({"prompt": [5] * 690_000}).encode()  # just under 2 MiB of ids
    assert 1.9 * 2**20 < len(ids_body) <= 2 * 2**20
    near_bound = "And the LORD said " * 213  # 3834 characters: tokenized, then too long
    echo = {"prompt": [5] * 200, "max_tokens": 56, "echo": True, "logprobs": 20, "ignore_eos": True}

    async def heavy():
        async with httpx.AsyncClient(timeout=60) as client:
            headers = {"content-type": "application/json"}
            jobs = [client.post(url + C, content=ids_body, headers=headers) for _ in range(3)]
            jobs += [client.post(url + C, json={"prompt": near_bound}) for _ in range(3)]
            jobs += [client.post(url + C, json=echo) for _ in range(3)]
            return await asyncio.gather(*jobs)

    def one_round() -> list[float]:
        latencies: list[float] = []
        done = threading.Event()
        out: list = []
        worker = threading.Thread(target=lambda: (out.extend(asyncio.run(heavy())), done.set()))
        with httpx.Client(timeout=5) as p:
            p.get(url + "/health")  # connected: the first probe measures the server
            worker.start()
            while not done.is_set() and worker.is_alive():
                t = time.perf_counter()
                r = p.get(url + "/health")
                latencies.append(time.perf_counter() - t)
                assert r.status_code == 200
                time.sleep(0.005)
        worker.join()
        assert [r.status_code for r in out] == [400] * 6 + [200] * 3
        assert len(out[-1].json()["choices"][0]["logprobs"]["tokens"]) == 256
        assert len(latencies) > 10, latencies
        return latencies

    try:
        _wait_up(proc, url)
        rounds = [one_round()]
        if max(rounds[0]) >= 0.3:
            rounds.append(one_round())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    slowest = [sorted(r)[-5:] for r in rounds]
    assert min(max(r) for r in rounds) < 0.3, f"the five slowest probes of each round: {slowest}"
    print(
        f"\n/health under maximal requests: {len(rounds)} round(s), "
        + ", ".join(f"{len(r)} probes max {1000 * max(r):.0f} ms" for r in rounds)
    )


def _serve(port: int, *extra: str, patch: str = "") -> subprocess.Popen:
    """`python -m minillm serve` in a child process (with `patch` run first, if given)."""
    code = (
        f"{patch}\nfrom minillm.cli import main\nmain({['serve', '--port', str(port), *extra]!r})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


STUCK = {  # what hangs -> code run in the server process before it starts
    "body": "",  # the test sends half a body and waits; nothing is patched
    "step": "from minillm.engine import llm_engine\n"
    "llm_engine.Engine.step = lambda self: time.sleep(3600)",
    "event loop": "from minillm.serving import routes\n"
    "async def stuck():\n    time.sleep(3600)\n"
    "routes.GETS['/version'] = stuck",
}


@pytest.mark.parametrize("stuck", list(STUCK))
def test_sigterm_ends_the_server_in_bounded_time(stuck):
    """SIGTERM with a request whose body never finishes arriving and a stream in flight
    (the drain ends at --shutdown-timeout), with an engine step that never returns (the
    engine thread is let go after 2 s), or with the event loop itself blocked (only the
    watchdog can end it: --shutdown-timeout + 5 s, exit status 1)."""
    import socket

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "--shutdown-timeout", "1", patch="import time\n" + STUCK[stuck])
    try:
        _wait_up(proc, url)
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        body = {"prompt": "In the", "max_tokens": 200, "ignore_eos": True, "stream": True}
        stream = httpx.stream("POST", url + C, json=body, timeout=60)
        response = stream.__enter__()
        if stuck == "event loop":
            with pytest.raises(httpx.ReadTimeout):
                httpx.get(url + "/version", timeout=1)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - start
        print(f"\nSIGTERM with a stuck {stuck}: the process ended after {took:.1f} s")
        assert took < {"body": 3, "step": 6, "event loop": 9}[stuck], took
        assert (proc.returncode == 1) == (stuck == "event loop"), proc.returncode
        slow.close()
        try:
            response.read()
        except httpx.HTTPError:
            pass  # the stream was cut at the deadline: what a drain timeout means
        stream.__exit__(None, None, None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
