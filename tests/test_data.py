"""Tests of the KJV corpus, its train/held-out split, the BPE tokenizer and training batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model import Tokenizer
from minillm.training.data import (
    ENDOFTEXT,
    batches,
    encode_corpus,
    load_kjv,
    save_tokenizer,
    split_corpus,
    train_tokenizer,
)

SAMPLES = [
    "In the beginning God created the heaven and the earth.\n",
    "Psalms 23\nThe LORD is my shepherd; I shall not want.\n",
    "  leading spaces, trailing spaces  \n\n\nblank lines\tand a tab",
    "Unicode: café, naïve, “quotes” — Ἐν ἀρχῇ, 日本語, emoji 🙂\r\n",
    "",
]


@pytest.fixture(scope="module")
def verses() -> list[str]:
    return load_kjv(headings=False)


@pytest.fixture(scope="module")
def tok(verses: list[str]):
    return train_tokenizer("".join(v + "\n" for v in verses[:2000]), vocab_size=512)


def test_corpus_has_every_verse_in_order(verses: list[str]) -> None:
    assert len(verses) == 31_102
    assert verses[0] == "In the beginning God created the heaven and the earth."
    assert verses[-1] == "The grace of our Lord Jesus Christ be with you all. Amen."
    assert all(v and v == " ".join(v.split()) and "\n" not in v for v in verses)


def test_headings_open_each_chapter(verses: list[str]) -> None:
    lines = load_kjv()
    assert len(lines) == 31_102 + 1_189
    assert lines[:2] == ["Genesis 1", verses[0]]
    assert "Psalms 23" in lines and "3 John 1" in lines
    verse_set = set(verses)
    assert [line for line in lines if line in verse_set] == verses


def test_split_is_deterministic_disjoint_and_about_5_percent() -> None:
    lines = [f"line {i}" for i in range(32_291)]
    train, held_out = split_corpus(lines)
    assert (train, held_out) == split_corpus(lines)
    train_lines, val_lines = train.splitlines(), held_out.splitlines()
    assert sorted(train_lines + val_lines) == sorted(lines)
    assert not set(train_lines) & set(val_lines)
    assert 0.045 < len(val_lines) / len(lines) < 0.055
    assert val_lines[0] == "line 1900" and "line 0" in train_lines  # chunk 19 is held out
    assert val_lines[-1] == "line 31999"  # ...and the last held-out chunk is near the end


def test_split_of_real_corpus_keeps_whole_lines(verses: list[str]) -> None:
    train, held_out = split_corpus(verses)
    assert train.endswith("\n") and held_out.endswith("\n")
    assert len(train.splitlines()) + len(held_out.splitlines()) == len(verses)


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_round_trips_exactly(tok, text: str) -> None:
    ids = tok.encode(text).ids
    assert ids == tok.encode(text, add_special_tokens=False).ids  # nothing is added
    assert tok.decode(ids) == text


def test_tokenizer_vocab_and_special_token(tok) -> None:
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(ENDOFTEXT) == 0
    assert tok.decode([0], skip_special_tokens=False) == ENDOFTEXT


def test_encode_corpus_matches_encoding_in_one_piece(tok, verses: list[str]) -> None:
    odd = "trailing  \nx \n \n\ny.\n\x1c.\r\n\u2028z\t\n  "
    text = "Genesis 1\n" + "".join(v + "\n" for v in verses[:300]) + odd
    ids = encode_corpus(tok, text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == tok.encode(text).ids
    assert tok.decode(ids.tolist()) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab1 .'\n\t\r\u2028é")), max_size=40))
def test_encode_corpus_matches_on_any_whitespace(tok, text: str) -> None:
    assert encode_corpus(tok, text).tolist() == tok.encode(text).ids


def test_saved_tokenizer_loads_with_transformers(tok, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    save_tokenizer(tok, tmp_path, model_max_length=256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.model_max_length == 256
    assert hf.bos_token_id == hf.eos_token_id == hf.pad_token_id == 0
    assert hf.model_input_names == ["input_ids", "attention_mask"]
    ours = Tokenizer(tmp_path)  # minillm's wrapper reads the same two files
    assert ours.bos_token_id == ours.eos_token_id == 0
    for text in SAMPLES:
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text).ids == ours.encode(text)
        assert hf.decode(ids) == ours.decode(ids) == text


def test_batches_are_shifted_windows_and_reproducible() -> None:
    ids = torch.arange(1000)
    x, y = next(batches(ids, batch_size=4, seq_len=16, generator=torch.Generator().manual_seed(0)))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.long))  # contiguous
    again = next(batches(ids, 4, 16, torch.Generator().manual_seed(0)))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)


def test_batches_reach_the_last_token() -> None:
    ids = torch.arange(10)
    stream = batches(ids, batch_size=64, seq_len=9, generator=torch.Generator().manual_seed(1))
    x, y = next(stream)
    assert torch.equal(x[0], ids[:9]) and torch.equal(y[0], ids[1:])  # only one window fits
    with pytest.raises(ValueError):
        next(batches(ids, 1, 10, torch.Generator()))
