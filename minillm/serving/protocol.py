"""The OpenAI API's side of the server: request bodies and error JSON.

Every body is a strict model: a field this server does not implement is refused with a 400
that names it (`UNSUPPORTED` says why for the well-known ones), never accepted and ignored.
Numbers left out or sent as null take vLLM's defaults. vLLM's extra sampling fields
(`top_k`, `ignore_eos`, `repetition_penalty`, ...) are accepted too: send them with the
openai client's `extra_body`.

Errors are `ApiError`s, which the server turns into OpenAI's error JSON,
`{"error": {"message", "type", "param", "code"}}`, with the error's HTTP status.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

# Fields of OpenAI's API (or vLLM's) that this server does not implement, and why.
UNSUPPORTED = {
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "response_format": "structured output (JSON mode, JSON schema) is not implemented",
    "suffix": "insertion after a suffix is not implemented",
    "audio": "audio output is not implemented",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "min_p": "min_p sampling is not implemented (use top_p or top_k)",
    "guided_json": "guided decoding is not implemented",
    "guided_regex": "guided decoding is not implemented",
    "guided_choice": "guided decoding is not implemented",
    "chat_template_kwargs": "template arguments are not implemented",
}


TokenId = StrictInt  # JSON true or 1.0 is not a token id


class ApiError(Exception):
    """Bad input (or a failure to report): becomes OpenAI's error JSON with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    """OpenAI's error object. A message is made safe to encode: a lone surrogate from the
    request (which UTF-8 cannot encode) is written as its escape."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, param, status), status_code=status)


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error JSON, as every error of this server is written."""

    error: ErrorObject


class Strict(BaseModel):
    """No unknown fields, and no coercion: `true` is not 1, `"5"` is not 5, 1.0 is not an
    integer (JSON's types, as the schema says; an int is a fine float)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The sampling fields both endpoints share (OpenAI's names, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    user: str | None = None  # an end-user label, as in OpenAI's API: no effect on the output
    # vLLM's extra sampling parameters
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    # text, token ids, or a batch of either: each prompt gets n choices
    prompt: str | list[TokenId] | list[list[TokenId]] | list[str]
    echo: bool = False  # the prompt is written before the completion (with its logprobs)
    logprobs: int | None = Field(None, ge=0)  # the top logprobs per token (and the token's)
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True  # vLLM: BOS etc. around a text prompt


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True  # vLLM: end where the assistant's reply begins


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
