"""The OpenAI-compatible server, driven by the official `openai` client on a loopback
port: same greedy text as the offline API, streaming, bad input (HTTP 400, the server
keeps serving), metrics, and a client disconnect that frees the request's blocks."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import CHATML, free_port, running

from minillm import load_tokenizer
from minillm.engine import Engine, EngineConfig, SamplingParams
from minillm.serving.api_server import build_app, create_app

NAME = "minillm-bundled"
PROMPTS = ["In the beginning", "And the LORD said unto Moses", "Blessed are"]


@pytest.fixture(scope="module")
def server(model):
    """(base url, engine): a server on its own thread (the bundled model with a ChatML
    template given, as `serve --chat-template` does), stopped after the module."""
    engine = Engine(model, load_tokenizer(), max_num_seqs=8)
    with running(create_app(engine, NAME, chat_template=CHATML)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model):
    """Greedy texts of PROMPTS (12 tokens) from the offline engine."""
    engine = Engine(model, load_tokenizer())
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].text for o in engine.run_to_completion()]


def complete(client, prompt, **kw):
    """Greedy, 12 tokens, EOS ignored (vLLM's extra parameter), unless `kw` says otherwise."""
    args = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    return client.completions.create(**{**args, "extra_body": {"ignore_eos": True}, **kw})


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_completions_equal_the_offline_api_also_when_concurrent(client, offline):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: complete(client, p), PROMPTS))
    assert [o.choices[0].text for o in outs] == offline
    assert outs[0].choices[0].finish_reason == "length"
    assert outs[0].usage.completion_tokens == 12


def test_streamed_completion_adds_up_to_the_same_text(client, offline):
    chunks = list(complete(client, PROMPTS[1], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == offline[1]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len(chunks) > 3  # tokens arrive as they are produced, not in one piece


def test_chat_stream_and_non_stream_agree(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Who made the heaven?"}])
    kw.update(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    parts = list(client.chat.completions.create(stream=True, **kw))
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text


def test_n_samples_and_seed(client):
    a = complete(client, PROMPTS[0], n=2, seed=3, temperature=1.0)
    b = complete(client, PROMPTS[0], n=2, seed=3, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


BAD = [
    ({"prompt": "x" * 2000, "max_tokens": 4}, "context"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10_000}, "context"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "Hi", "n": 100}, "n=100"),
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": ""}, "empty"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "says"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_completion_requests_get_400_json(server, body, says):
    r = httpx.post(server[0] + "/v1/completions", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_a_model_not_served_here_is_404(server, client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        complete(client, "Hi", model="gpt-4")


def test_bad_chat_and_malformed_json_get_400_and_the_server_keeps_serving(server, client):
    url = server[0] + "/v1/chat/completions"
    assert httpx.post(url, json={"model": NAME, "messages": []}).status_code == 400
    assert httpx.post(url, json={"model": NAME, "messages": "hi"}).status_code == 400
    for headers in ({"content-type": "application/json"}, {}):
        r = httpx.post(url, content=b'{"model": "x", "messages": [', headers=headers)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=3)
    assert complete(client, "Hi").choices[0].text  # still serving


def metric(server, name: str) -> float:
    text = httpx.get(server[0] + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(f"minillm_{name} "))
    return float(line.split()[-1])


def test_metrics_are_prometheus_text(server, client):
    complete(client, "Hi")
    text = httpx.get(server[0] + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
        assert f"# TYPE minillm_{name} gauge" in text
    assert metric(server, "generation_tokens_total") >= 12
    assert metric(server, "time_to_first_token_seconds_count") >= 1


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, monkeypatch):
    url, engine = server
    step = engine.step

    def slow_step():  # slow the engine so the request is surely still running
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = metric(server, "requests_aborted_total")
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        assert engine.num_blocks_used > 0
    deadline = time.time() + 10
    while metric(server, "requests_aborted_total") == aborted or engine.num_blocks_used:
        assert time.time() < deadline, "the disconnected request was not aborted"
        time.sleep(0.05)
    assert metric(server, "kv_blocks_used") == 0 and metric(server, "num_requests_running") == 0


def test_chat_without_a_template_is_a_400_that_says_how(model):
    with running(create_app(Engine(model, load_tokenizer(), max_num_seqs=2), NAME)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert complete(client, "Hi").choices[0].text  # completions still serve


def test_chat_prompt_is_the_template_with_the_real_special_tokens(server, client):
    tok = load_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    want = tok.apply_chat_template(messages, chat_template=CHATML)
    assert r.usage.prompt_tokens == len(want)
    ids = httpx.post(server[0] + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == want


def test_build_app_serves_the_bundled_model_by_default():
    app = build_app(config=EngineConfig(max_num_seqs=2))
    paths = {route.path for route in app.routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"} <= paths
    assert {"/tokenize", "/detokenize", "/version", "/health"} <= paths


def test_client_that_gives_up_on_a_non_streaming_request_frees_its_blocks(server, monkeypatch):
    url, engine = server
    step = engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = metric(server, "requests_aborted_total")
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.time() + 10
    while metric(server, "requests_aborted_total") == aborted or engine.num_blocks_used:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)


def test_cli_serve_starts_a_server_that_answers(tmp_path):
    """`python -m minillm serve` (the README's command) serves the bundled model."""
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.3)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        done = api.completions.create(
            model=api.models.list().data[0].id,
            prompt="In the beginning",
            max_tokens=5,
            temperature=0,
        )
        assert done.choices[0].text and done.usage.completion_tokens == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
