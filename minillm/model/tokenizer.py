"""A thin wrapper over a Hugging Face `tokenizer.json` (the `tokenizers` library), with the
model's own chat template.

A chat model was fine-tuned on conversations in one exact markup (SmolLM2: ChatML,
"<|im_start|>user\\n...<|im_end|>\\n"), and answers well only when prompted in it. The
checkpoint carries that markup as a Jinja template (`chat_template.jinja`, transformers 5's
layout, or "chat_template" in tokenizer_config.json); `Tokenizer.apply_chat_template` renders
it the way transformers does, so every chat path of minillm (the CLI's `chat` and
`generate --chat`, the server) sends the model the ids it was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str) -> None:
    """Templates call raise_exception("...") to reject a conversation they cannot render
    (e.g. roles out of order); the message is the template author's."""
    raise ValueError(f"the chat template rejected these messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _compile(template: str) -> jinja2.Template:
    """Compile like transformers: sandboxed (a template is data from the model's files and
    must not reach Python), blocks trimmed, loop controls, and its helper functions."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's "chat_template"
    (a string, or a list of named templates of which "default" is the chat one)."""
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


class Tokenizer:
    """Text <-> ids, with the same ids as `transformers.AutoTokenizer` on the same files."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: minillm reads the fast-tokenizer file; convert a "
                "sentencepiece model with transformers (AutoTokenizer.from_pretrained(...)"
                ".save_pretrained(dir)) to produce it"
            )
        self.model_dir = model_dir
        self.tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        # Special tokens as strings: what a chat template writes ({{ bos_token }}).
        self.special_tokens = {n: self._content(cfg.get(n)) for n in _SPECIAL_NAMES}
        self.bos_token_id = self._special_id(self.special_tokens["bos_token"])
        self.eos_token_id = self._special_id(self.special_tokens["eos_token"])
        self.chat_template = _read_template(model_dir, cfg)
        self._compiled: dict[str, jinja2.Template] = {}

    @staticmethod
    def _content(token: str | dict | None) -> str | None:
        return token.get("content") if isinstance(token, dict) else token  # older: AddedToken

    def _special_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids, with BOS where the tokenizer's post-processor adds it (Llama does)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text; it releases the GIL while it works (a single `encode`
        holds it: tokenizing megabytes would stall every other thread, a server's event
        loop included)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """The conversation as the model's template writes it. `messages` are
        {"role": "system" | "user" | "assistant", "content": str}; with
        `add_generation_prompt` the text ends where the assistant's reply begins.
        `chat_template` replaces the model's own (as in transformers)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                f"{self.model_dir} has no chat template (no chat_template.jinja, no "
                '"chat_template" in tokenizer_config.json): it is a base model, so prompt it '
                "with plain text (generate without --chat), or use a chat model such as smollm2"
            )
        if template not in self._compiled:
            self._compiled[template] = _compile(template)
        return self._compiled[template].render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation, equal to transformers' `apply_chat_template(messages,
        tokenize=True, add_generation_prompt=...)`: the template writes the special tokens,
        so none are added around the text."""
        text = self.render_chat(messages, add_generation_prompt, chat_template)
        return self.encode(text, add_special_tokens=False)
