"""A thin wrapper over a Hugging Face `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


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
        self.tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token_id = self._special_id(cfg.get("bos_token"))
        self.eos_token_id = self._special_id(cfg.get("eos_token"))

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):  # older configs store AddedToken dicts
            token = token.get("content")
        return None if token is None else self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids, with BOS where the tokenizer's post-processor adds it (Llama does)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
