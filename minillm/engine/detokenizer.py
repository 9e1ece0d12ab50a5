"""Incremental detokenization: text from token ids at a constant cost per token, stop strings
found on the new tail only, and streamed deltas that never show a stop string.

Decoding all of a sequence's output ids again for every new token costs O(length) per token,
O(length^2) for a reply: a 4k-token answer decodes 8 million tokens. vLLM's way, used here,
keeps two offsets into the output ids: `read_offset`, the tokens already turned into text,
and `prefix_offset`, a few tokens before it whose text is already known. Each new token
decodes only the window from `prefix_offset`: the text beyond the window's known prefix is
new. A token that ends inside a multi-byte character decodes to "\\ufffd", so the text waits
until the character is complete. A tokenizer's decoder may change how a token reads at the
start of a text (SentencePiece drops a leading space); decoding with one token of context
before the new ones keeps that right.
"""

from __future__ import annotations

from minillm.generation.sampling import SamplingParams
from minillm.model.tokenizer import Tokenizer


def stop_text_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (so a
    stream must not send them yet): the longest suffix that is a proper prefix of one."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class Detokenizer:
    """One sequence's output text, grown a token at a time."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer, self.params = tokenizer, params
        self.text = ""  # the output text, cut at a stop string once one appears
        self.prefix_offset = self.read_offset = 0
        self.emitted = 0  # characters already sent as deltas
        self.tail = max((len(s) for s in params.stop), default=1) - 1  # holdback window

    def update(
        self, output_ids: list[int], final: bool = False, check_stops: bool = True
    ) -> str | None:
        """Add the text of the ids appended since the last call (`final`: also an incomplete
        last character, as a full decode would show it); return the stop string that now
        ends the text, if any (only when `check_stops`: not within min_tokens): the text is
        then cut there."""
        decode = self.tokenizer.decode
        skip = self.params.skip_special_tokens
        known = decode(output_ids[self.prefix_offset : self.read_offset], skip)
        full = decode(output_ids[self.prefix_offset :], skip)
        if len(full) <= len(known) or (full.endswith("\ufffd") and not final):
            return None  # nothing new yet, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        start = len(self.text)
        self.text += full[len(known) :]
        hits = []  # (where, stop): a stop can only appear where the new text is
        for stop in self.params.stop if check_stops else ():
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                hits.append((at, stop))
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string wins
        self.text = self.text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        return stop

    def _visible_end(self, finished: bool) -> int:
        """Where the text a client may see ends: while running, a tail that might still
        become a stop string is held back."""
        if finished or not self.tail:
            return len(self.text)
        return len(self.text) - stop_text_holdback(self.text[-self.tail :], self.params.stop)

    def delta(self, finished: bool) -> str:
        """The visible text not sent yet (streaming)."""
        end = self._visible_end(finished)
        new = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return new

    def visible_text(self, finished: bool) -> str:
        """All the text a client may see now (cumulative outputs)."""
        return self.text[: self._visible_end(finished)]
