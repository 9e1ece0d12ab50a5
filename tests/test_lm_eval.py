"""A real evaluation harness against the server: lm-eval 0.4.13's `local-completions` with
its default (tokenized) requests on the two local tasks of `minillm/bench/eval_harness.py`, a
multiple-choice loglikelihood task and a generate_until task. lm-eval's loglikelihoods must
equal minillm's own log-probabilities of the same continuations (a full forward, no cache),
its greedy flags the argmax's, and its generations minillm's own greedy text.

Opt-in: needs `pip install -e ".[eval]"` (lm-eval==0.4.13, about a minute); skipped
without it, and `-m "not lm_eval"` leaves it out."""

import pytest
import torch
from serving import running

from minillm import load_tokenizer
from minillm.engine import Engine, SamplingParams
from minillm.serving.api_server import create_app

pytest.importorskip("lm_eval", reason='needs lm-eval: pip install -e ".[eval]"')
pytestmark = pytest.mark.lm_eval

NAME = "minillm-bundled"


@pytest.fixture(scope="module")
def results(model):
    from minillm.bench.eval_harness import run_eval

    engine = Engine(model, load_tokenizer(), max_num_seqs=8)
    with running(create_app(engine, NAME)) as url:
        yield run_eval(url, NAME)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` (trailing spaces move to the continuation; the whole is
    tokenized and split at the context's length), with the server's tokenizer: the one
    lm-eval used, through /tokenize."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def test_loglikelihoods_equal_minillm_s_own_logprobs(results, model):
    tok = load_tokenizer()
    samples = results["samples"]["minillm_kjv_mc"]
    assert len(samples) == 12
    checked = 0
    for sample in samples:
        for (context, continuation), [(loglik, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ctx, cont = encode_pair(tok, context, continuation)
            with torch.inference_mode():
                logits = model(torch.tensor([ctx + cont]))[0].double()
            logp = torch.log_softmax(logits, dim=-1)[len(ctx) - 1 : -1]
            want = float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())
            assert loglik == pytest.approx(want, abs=1e-3), (context, continuation)
            assert greedy == (logp.argmax(-1).tolist() == cont)
            checked += 1
    assert checked == 48
    acc = results["results"]["minillm_kjv_mc"]["acc,none"]
    assert acc == pytest.approx(sum(s["acc"] for s in samples) / len(samples)) and 0 <= acc <= 1


def test_generations_equal_minillm_s_own_greedy_text(results, model):
    tok = load_tokenizer()
    samples = results["samples"]["minillm_kjv_gen"]
    assert len(samples) == 8
    eos = tok.special_tokens["eos_token"]
    for sample in samples:
        [(prompt, kwargs)] = sample["arguments"]
        engine = Engine(model, tok)
        params = SamplingParams(
            temperature=0, max_tokens=kwargs["max_gen_toks"], stop=[*kwargs["until"], eos]
        )
        engine.add_request(tok.encode(prompt, add_special_tokens=False), params)
        want = engine.run_to_completion()[0].outputs[0].text
        assert sample["resps"] == [[want]]
    assert "exact_match,none" in results["results"]["minillm_kjv_gen"]
