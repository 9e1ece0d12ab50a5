"""The OpenAI API's side of the server: request bodies, error JSON, chat prompts.

Bad input raises `ApiError`, which the server turns into HTTP 400 with OpenAI's error
JSON (`{"error": {"message", "type", "param", "code"}}`). Chat prompts use the tokenizer
config's `chat_template` (Jinja) when it has one. The bundled model has none (it was
trained on plain text), so the documented default is one line per message,
`"{role}: {content}\\n"`, followed by `"assistant:"`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


class ApiError(Exception):
    """Bad input: becomes HTTP 400 with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_response(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class RequestFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI names, plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # vLLM's extra sampling parameters (send them with the openai client's extra_body)
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)


class CompletionRequest(RequestFields):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]]


class ChatRequest(RequestFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def default_chat_template(messages: list[dict[str, str]]) -> str:
    """The bundled model's chat format: one "role: content" line each, then "assistant:"."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def load_chat_template(model_dir: str | Path) -> str | None:
    """The Jinja `chat_template` of a checkpoint's tokenizer config, if it has one."""
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text()).get("chat_template") if path.exists() else None
