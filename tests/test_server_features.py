"""The server's sampling controls and evaluation features, through the official `openai`
client, against references: logprobs and echo against the log-softmax of a full forward
(completions and chat, streamed too), batched prompts against one request each, best_of
against ranking best_of samples by hand, penalties against the engine's reference-checked
sampler, /tokenize and /detokenize against the tokenizer, and chat prompts against
transformers' apply_chat_template on a real chat model (SmolLM2)."""

import httpx
import openai
import pytest
import torch
from serving import CHATML, running

from minillm import load_tokenizer
from minillm.engine import Engine, SamplingParams
from minillm.serving.api_server import create_app

NAME = "bundled"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(model, tok):
    with running(create_app(Engine(model, tok, max_num_seqs=8), NAME, CHATML)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def reference(model, ids):
    """log-softmax of a full forward (no cache): row p scores token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def offline(model, tok, prompt_ids, **kw):
    engine = Engine(model, tok)
    engine.add_request(prompt_ids, SamplingParams(**kw))
    return engine.run_to_completion()[0].outputs


def check_completion_logprobs(lp, ids, ref, k, tok, first_is_prompt_start):
    for i, token in enumerate(ids):
        assert lp.tokens[i] == tok.decode([token], False)
        if i == 0 and first_is_prompt_start:
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            continue
        row = ref[i - 1] if first_is_prompt_start else ref[i]
        assert lp.token_logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(k)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        want = {tok.decode([t], False): v for t, v in pairs}
        for text, value in want.items():
            assert lp.top_logprobs[i][text] == pytest.approx(value, abs=1e-4)
        assert len(lp.top_logprobs[i]) in (k, k + 1)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_completion_echo_with_logprobs_equals_a_full_forward(model, tok, client):
    prompt = "And the LORD said unto Moses"
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True
    )
    choice, ids = r.choices[0], tok.encode(prompt)
    generated = offline(model, tok, ids, temperature=0, max_tokens=6)[0]
    assert choice.text == prompt + generated.text
    all_ids = ids + generated.token_ids
    check_completion_logprobs(choice.logprobs, all_ids, reference(model, all_ids), 3, tok, True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(model, tok, client):
    ids = tok.encode("In the beginning God created")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    check_completion_logprobs(choice.logprobs, ids, reference(model, ids), 1, tok, True)
    assert r.usage.completion_tokens == 0


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_add_up_to_the_whole(client, echo):
    """Streamed chunks (text held back while it may begin a stop string) add up to the
    whole answer: text, tokens, logprobs and offsets, the echoed prompt once."""
    kw = dict(model=NAME, prompt="In the beginning", max_tokens=12, temperature=0, logprobs=2)
    # " of" (the first token) and " the", "the LORD" later wait: they may begin a stop string
    kw.update(echo=echo, stop=["the LORD hath", " of the world"])
    whole = client.completions.create(**kw).choices[0]
    parts = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(p.text for p in parts) == whole.text
    assert whole.text.startswith("In the beginning") == echo
    assert len(parts[0].logprobs.tokens) == 3 + 3 * echo  # " of", " the" waited for " LORD"
    tokens = sum((p.logprobs.tokens for p in parts if p.logprobs), [])
    values = sum((p.logprobs.token_logprobs for p in parts if p.logprobs), [])
    offsets = sum((p.logprobs.text_offset for p in parts if p.logprobs), [])
    assert tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_chat_logprobs_and_top_logprobs_streamed_or_not(model, tok, client):
    messages = [{"role": "user", "content": "Who made the heaven?"}]
    kw = dict(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    whole = client.chat.completions.create(top_logprobs=2, **kw).choices[0]
    ids = tok.apply_chat_template(messages, chat_template=CHATML)
    content = whole.logprobs.content
    generated = [tok.encode(c.token, add_special_tokens=False) for c in content]
    out_ids = offline(model, tok, ids, temperature=0, max_tokens=6)[0].token_ids
    ref = reference(model, ids + out_ids)
    for i, (item, token) in enumerate(zip(content, out_ids, strict=True)):
        row = ref[len(ids) + i - 1]
        assert item.token == tok.decode([token], False) and generated[i]
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert item.bytes == list(item.token.encode("utf-8"))
        top = row.topk(2)
        assert [t.token for t in item.top_logprobs] == [tok.decode([t], False) for t in top.indices]
    parts = list(client.chat.completions.create(stream=True, top_logprobs=2, **kw))
    streamed = sum((p.choices[0].logprobs.content for p in parts if p.choices[0].logprobs), [])
    assert [c.token for c in streamed] == [c.token for c in content]
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert all(c.top_logprobs == [] for c in plain)


def test_batched_prompts_equal_one_request_each(client, tok):
    texts = ["In the beginning", "Blessed are", "And Jesus said"]
    kw = dict(model=NAME, max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True})
    for prompts in (texts, [tok.encode(t) for t in texts]):
        batch = client.completions.create(prompt=prompts, **kw)
        assert [c.index for c in batch.choices] == list(range(6))
        one = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
        assert [c.text for c in batch.choices] == [t for t in one for _ in range(2)]
        assert batch.usage.completion_tokens == 30
        assert batch.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)


def test_best_of_returns_the_n_most_likely_samples(client, model, tok):
    ids = tok.encode("In the beginning")
    kw = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    every = offline(model, tok, ids, n=4, logprobs=0, **kw)
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    body = dict(n=2, best_of=4, seed=5, temperature=1.0, max_tokens=6)
    r = client.completions.create(model=NAME, prompt=ids, extra_body={"ignore_eos": True}, **body)
    assert [c.text for c in r.choices] == [o.text for o in best]


@pytest.mark.parametrize(
    "controls",
    [
        dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(logit_bias={"1150": 8.0}),
        dict(extra_body={"repetition_penalty": 1.6, "min_tokens": 4}),
    ],
    ids=["presence-frequency", "logit-bias", "repetition-min-tokens"],
)
def test_penalties_and_bias_do_what_the_sampler_does(client, model, tok, controls):
    ids = tok.encode("And the LORD said unto Moses")
    kw = {k: v for k, v in controls.items() if k != "extra_body"}
    kw.update(controls.get("extra_body", {}))
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    want = offline(model, tok, ids, temperature=0, max_tokens=10, **kw)[0].text
    plain = offline(model, tok, ids, temperature=0, max_tokens=10)[0].text
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, **controls)
    assert r.choices[0].text == want != plain


def test_tokenize_detokenize_and_version(server, tok):
    text = "In the beginning God created the heaven"
    r = httpx.post(server + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and "".join(r["token_strs"]) == text
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    assert httpx.get(server + "/version").json()["version"]


@pytest.fixture(scope="module")
def smollm2_server(smollm2, smollm2_tokenizer):
    engine = Engine(smollm2, smollm2_tokenizer, max_num_seqs=2, num_blocks=64)
    with running(create_app(engine, "smollm2")) as url:
        yield url


def test_chat_prompt_ids_equal_transformers_on_smollm2(smollm2_server):
    """The model's own template (chat_template.jinja) with its real bos/eos: the same ids
    as transformers' apply_chat_template on the same messages."""
    import transformers
    from helpers import SMOLLM2_CONVERSATIONS

    from minillm.model.weights import resolve_model_dir

    hf = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    client = openai.OpenAI(base_url=smollm2_server + "/v1", api_key="unused", max_retries=0)
    for messages in SMOLLM2_CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ours = httpx.post(smollm2_server + "/tokenize", json={"messages": messages}).json()
        assert ours["tokens"] == want["input_ids"]
        r = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=8, temperature=0
        )
        assert r.usage.prompt_tokens == len(want["input_ids"]) and r.choices[0].message.content
    reply = client.chat.completions.create(
        model="smollm2", messages=SMOLLM2_CONVERSATIONS[0], max_tokens=24, temperature=0
    ).choices[0]
    assert "Paris" in reply.message.content and "<|im_start|>" not in reply.message.content
