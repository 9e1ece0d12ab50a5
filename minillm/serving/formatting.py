"""OpenAI's response JSON: choices (whole or as stream deltas) with their logprobs, usage.

Logprobs follow OpenAI's two shapes, as vLLM writes them. Completions: four parallel lists,
`tokens`, `token_logprobs`, `top_logprobs` (a {token text: logprob} dict per position with
the top k and the token itself, so up to k + 1 entries) and `text_offset`; with echo the
prompt's first token has null logprobs (nothing comes before it). Chat: `content`, a list of
{token, logprob, bytes, top_logprobs: the top k, best first}. A logprob of -inf is written
as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minillm.engine.outputs import PositionLogprobs

TokenText = Callable[[int], str]


def _lp(value: float) -> float:
    return max(value, -9999.0)


def completion_logprobs(
    ids: list[int], entries: list[PositionLogprobs | None], k: int, text: TokenText, offset: int
) -> dict[str, list]:
    """The completions shape for `ids` (entries aligned with them); offsets from `offset`."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token, entry in zip(ids, entries, strict=True):
        piece = text(token)
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry[token].logprob))
        top = list(entry.items())[: k + 1]  # the token itself first, then the top k
        out["top_logprobs"].append({text(t): _lp(lp.logprob) for t, lp in top})
    return out


def chat_logprobs(
    ids: list[int], entries: list[PositionLogprobs], k: int, text: TokenText
) -> list[dict[str, Any]]:
    """The chat shape: one {token, logprob, bytes, top_logprobs} per generated token."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": _lp(logprob), "bytes": list(piece.encode("utf-8"))}

    content = []
    for token, entry in zip(ids, entries, strict=True):
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
        top_items = [item(t, lp.logprob) for t, lp in top]
        content.append({**item(token, entry[token].logprob), "top_logprobs": top_items})
    return content


@dataclass
class Piece:
    """What one engine output adds to a choice: text, token ids, their logprob entries
    (None where there is none: the prompt's first token, or logprobs not asked for)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    entries: list[PositionLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generated: int = 0  # tokens the engine generated for it (usage.completion_tokens)


@dataclass
class Choice:
    """One choice of the answer, accumulated over the engine's outputs."""

    index: int
    pieces: list[Piece] = field(default_factory=list)
    offset: int = 0  # characters of token text already sent (completions' text_offset)
    started: bool = False  # a chunk was sent (chat's first delta carries the role)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_generated: int = 0

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.num_generated += piece.generated
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.stop_reason = piece.stop_reason if piece.finish_reason else self.stop_reason

    def take(self) -> Piece:
        """Everything accumulated, as one piece; the choice starts empty again."""
        whole = Piece()
        for p in self.pieces:
            whole.text += p.text
            whole.ids += p.ids
            whole.entries += p.entries
        whole.finish_reason, whole.stop_reason = self.finish_reason, self.stop_reason
        self.pieces = []
        return whole


def choice_json(
    choice: Choice, piece: Piece, chat: bool, stream: bool, k: int | None, text: TokenText
) -> dict[str, Any]:
    """A choice of a response (stream: a chunk's choice, with its delta)."""
    logprobs = None
    if k is not None and chat:
        logprobs = {"content": chat_logprobs(piece.ids, piece.entries, k, text)}
    elif k is not None:
        logprobs = completion_logprobs(piece.ids, piece.entries, k, text, choice.offset)
        choice.offset += sum(len(t) for t in logprobs["tokens"])
    out: dict[str, Any] = {"index": choice.index}
    if chat and stream:
        out["delta"] = {"content": piece.text}
        if not choice.started:
            out["delta"] = {"role": "assistant", "content": piece.text}
    elif chat:
        out["message"] = {"role": "assistant", "content": piece.text}
    else:
        out["text"] = piece.text
    choice.started = True
    stop_reason = piece.stop_reason if piece.finish_reason else None
    return {
        **out,
        "logprobs": logprobs,
        "finish_reason": piece.finish_reason,
        "stop_reason": stop_reason,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
