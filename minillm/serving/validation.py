"""Everything a request carries is checked here, before the engine sees any of it: the JSON
itself (no NaN/Infinity, no lone surrogates), the fields (strict models, unsupported ones
refused), the prompt (size, token ids in the vocabulary, the chat template), and the
sampling numbers (`SamplingParams`' own checks) with the engine's limits
(`Engine.check_request`). Anything wrong raises `ApiError`: a 400 naming the field and the
fix. These functions run in the server's thread pool, not on the event loop: a prompt near
the size limit takes a while to tokenize (and `Tokenizer.encode_batch` releases the GIL).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from pydantic import BaseModel, ValidationError

from minillm.engine.llm_engine import Engine
from minillm.generation.sampling import SamplingParams
from minillm.model.tokenizer import Tokenizer
from minillm.serving.protocol import (
    UNSUPPORTED,
    ApiError,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)

Body = TypeVar("Body", bound=BaseModel)
# Parsing holds the GIL (json.loads of 2 MiB of ids: ~40 ms in one C call; pydantic's check
# of them ~20 ms). Integers are parsed by a Python function, which lets other threads (the
# event loop) run between them; two parses at once could not run in parallel anyway, and
# queued back to back they would hold up the event loop for both: one at a time.
PARSING = threading.Lock()
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only such bodies can hold one
TOKEN_KEY = re.compile(r"[0-9]+")  # a token id as a JSON object key


@dataclass
class Prompt:
    """One prompt of a request: its ids, and its text (for echo: None means decode the ids)."""

    ids: list[int]
    text: str | None = None


def parse(raw: bytes, model: type[Body]) -> Body:
    """The request body as `model`, or ApiError saying what is wrong with it."""
    with PARSING:
        try:
            data = json.loads(
                raw, parse_constant=_no_constants, parse_float=_finite_float, parse_int=_int
            )
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            raise ApiError(f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(
            "the request body must be a JSON object (send Content-Type: application/json)"
        )
    if SURROGATE_ESCAPE.search(raw):
        _check_strings(data, "")
    for name in data:
        if name in UNSUPPORTED:
            raise ApiError(f"'{name}' is not supported by this server: {UNSUPPORTED[name]}", name)
    with PARSING:
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise ApiError(*_describe(err)) from None


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number (the JSON standard has no NaN or Infinity)")


def _int(text: str) -> int:
    return int(text)  # a Python frame: the GIL can switch here (see PARSING)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a 64-bit float")
    return value


def _check_strings(value: Any, where: str) -> None:
    """Refuse a lone surrogate ("\\ud800"): it is not Unicode text, no tokenizer takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                f"{where or 'the body'} contains a lone UTF-16 surrogate, which is not valid "
                "Unicode text: send the character itself or its full surrogate pair",
                where or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, where)
            _check_strings(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


def _describe(err: ValidationError) -> tuple[str, str | None]:
    """One pydantic error, as a sentence: the deepest one, without union branch names."""
    first = max(err.errors(), key=lambda e: len(e.get("loc", ())))
    loc = [str(x) for x in first.get("loc", ()) if not _is_branch(str(x))]
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return f"'{where}' is not a field this server supports: remove it", where
    if first.get("type") == "missing":
        return f"'{where}' is required", where
    return f"{where or 'body'}: {first.get('msg')}", where or None


def _is_branch(part: str) -> bool:
    """A union's branch name in a pydantic location ("str", "list[int]"): not a field."""
    return part in ("str", "int", "float", "bool") or "[" in part


def check_model(name: str | None, served: str) -> None:
    if name not in (None, served):
        raise ApiError(
            f"model {name!r} is not served here; this server serves {served!r}", "model", 404
        )


def longest_token_chars(tok: Tokenizer) -> int | None:
    """The most characters one token stands for: a text longer than context * this cannot
    fit, and is refused without tokenizing it. None when no such bound is safe: a
    normalizer or a splitting pre-tokenizer may delete characters (BERT-style), so such a
    tokenizer's text is tokenized first (the body limit bounds how long that takes)."""
    pre = repr(tok.tok.pre_tokenizer)
    if tok.tok.normalizer is not None or "Whitespace" in pre or "Removed" in pre:
        return None
    return max(1, *(len(tok.decode([i], False)) for i in range(tok.vocab_size)))


def check_chars(num_chars: int, context: int, chars: int | None, param: str) -> None:
    """Refuse a text that cannot fit in the context whatever its tokens (see above)."""
    if chars is not None and num_chars > context * chars:
        raise ApiError(
            f"{param} has {num_chars} characters, so at least {-(-num_chars // chars)} tokens "
            f"(no token here is longer than {chars} characters): more than the model's "
            f"context of {context}",
            param,
        )


def encode_texts(
    texts: list[str], tok: Tokenizer, context: int, chars: int | None, special: bool
) -> list[list[int]]:
    for text in texts:
        check_chars(len(text), context, chars, "prompt")
    return tok.encode_batch(texts, add_special_tokens=special)


def completion_prompts(
    body: CompletionRequest, tok: Tokenizer, context: int, chars: int | None, max_prompts: int
) -> list[Prompt]:
    """The prompts of a completion request: text, ids, or a batch of either."""
    prompt = body.prompt
    batched = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    batch = prompt if batched else [prompt]
    if not prompt or any(len(p) == 0 for p in batch):
        raise ApiError("prompt is empty: give at least one token", "prompt")
    if len(batch) > max_prompts:
        raise ApiError(
            f"{len(batch)} prompts in one request; this server takes at most {max_prompts} "
            "(send several requests)",
            "prompt",
        )
    texts = [p for p in batch if isinstance(p, str)]
    ids = iter(encode_texts(texts, tok, context, chars, body.add_special_tokens) if texts else [])
    return [Prompt(next(ids), p) if isinstance(p, str) else Prompt(list(p)) for p in batch]


def chat_prompt(
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tok: Tokenizer,
    template: str | None,
    context: int,
    chars: int | None,
) -> Prompt:
    """The conversation in the model's own chat template (or the server's --chat-template),
    with its real special tokens: the same ids as transformers' apply_chat_template."""
    if not messages:
        raise ApiError("messages is empty: give at least one message", "messages")
    if template is None and tok.chat_template is None:
        raise ApiError(
            "this model has no chat template (it is a base model): send plain text to "
            "/v1/completions, serve a chat model (--model smollm2), or give the server a "
            "template (--chat-template FILE)",
            "messages",
        )
    plain = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):  # OpenAI's content parts: text only, one a line
            content = "\n".join(part.text for part in m.content)  # as vLLM joins them
        message = {"role": m.role, "content": content}
        plain.append({**message, "name": m.name} if m.name is not None else message)
    check_chars(sum(len(m["content"]) for m in plain), context, chars, "messages")
    try:
        text = tok.render_chat(plain, add_generation_prompt, template)
    except ValueError as err:  # no template, or the template's raise_exception
        raise ApiError(str(err), "messages") from None
    except jinja2.TemplateError as err:
        raise ApiError(f"the chat template failed on these messages: {err}", "messages") from None
    return Prompt(encode_texts([text], tok, context, chars, False)[0], text)


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    best_of: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams (which refuses bad numbers); defaults are vLLM's."""
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "stop_token_ids": body.stop_token_ids,
    }
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not TOKEN_KEY.fullmatch(key):  # not int(): it takes " 7", "+7", "7_0" and "٧"
            raise ApiError(
                f'logit_bias key {key!r} must be a token id: ASCII digits, such as "42"',
                "logit_bias",
            )
        bias[int(key)] = value
    try:
        return SamplingParams(
            n=body.n,
            best_of=best_of,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            output_kind="delta",  # each output carries only what is new: O(1) per token
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as err:
        raise ApiError(str(err), _param_of(str(err))) from None


def include_usage(body: SamplingFields) -> bool:
    """Whether a stream ends with a usage chunk; `stream_options` goes with `stream` only
    (as vLLM checks it): sent without it, it would be ignored."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            "stream_options is only for streams: send it with stream=true", "stream_options"
        )
    return body.stream_options is not None and body.stream_options.include_usage


def check_request(engine: Engine, prompt: Prompt, params: SamplingParams) -> None:
    try:
        engine.check_request(prompt.ids, params)
    except ValueError as err:
        raise ApiError(str(err), _param_of(str(err))) from None


def _param_of(message: str) -> str | None:
    """The field a SamplingParams or engine message is about ("seed=...: ..." -> seed)."""
    found = re.match(r"(\w+)(=|\[| token ids| \()", message)
    return found.group(1) if found else None
