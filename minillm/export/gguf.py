"""Write a minillm / Hugging Face Llama checkpoint as a GGUF file for llama.cpp (chapter 08).

llama.cpp reads one self-describing file: GGUF = key/value metadata (architecture, shapes,
the tokenizer) + named tensors. llama.cpp's own `convert_hf_to_gguf.py` does this for
hundreds of architectures but lives only in a llama.cpp checkout, and it refuses the
bundled tokenizer: it recognises a byte-level BPE pre-tokenizer by the hash of its output
on a test string, and ours (trained for the course) is in no table. The pre-tokenizer IS
GPT-2's (tokenizer.json: ByteLevel, use_regex=True), so we name it "gpt-2" ourselves ("smollm"
for SmolLM2's digits-first variant, so that `smollm2`, read from its GGUF, exports back) and
write the file with the `gguf` package only. The result matches the converter's output
tensor for tensor when the converter is told the same name.

    python -m minillm.export.gguf [MODEL_DIR] out.gguf [--outtype f32|f16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from minillm.model.gguf_layout import gguf_name, rope_to_interleaved
from minillm.model.weights import load_config, load_state_dict, resolve_model_dir


def pre_tokenizer_name(pre: dict) -> str | None:
    """llama.cpp's name for a tokenizer.json pre-tokenizer this exporter can describe:
    GPT-2's byte-level regex ("gpt-2"), or digits split off first, then it ("smollm", as
    SmolLM2's tokenizer does). None for anything else."""
    byte_level = lambda p: p.get("type") == "ByteLevel" and p.get("use_regex")  # noqa: E731
    if byte_level(pre):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    digits = {"type": "Digits", "individual_digits": True}
    if len(parts) == 2 and parts[0] == digits and byte_level(parts[1]):
        return "smollm"
    return None


def tokenizer_fields(model_dir: Path) -> dict:
    """tokens, token types, merges, special ids, pre-tokenizer name and chat template of a
    byte-level BPE tokenizer.json (+ tokenizer_config.json)."""
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    pre_name = pre_tokenizer_name(pre)
    if tok["model"]["type"] != "BPE" or pre_name is None:
        raise ValueError(
            f"{model_dir}/tokenizer.json is not a GPT-2-style byte-level BPE (model "
            f"{tok['model']['type']}, pre-tokenizer {pre.get('type')}): convert this checkpoint "
            "with llama.cpp's convert_hf_to_gguf.py instead"
        )
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    vocab.update(special)
    tokens = [f"[PAD{i}]" for i in range(max(vocab.values()) + 1)]
    types = [gguf.TokenType.UNUSED] * len(tokens)
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    ids = {k: vocab.get(cfg.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")}
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "ids": ids,
        "add_bos": bool(cfg.get("add_bos_token", False)),
        "pre": pre_name,
        "chat_template": cfg.get("chat_template"),
    }


OUTTYPES = ("f32", "f16", "q8_0")


def export_gguf(model_dir: str | Path | None, out_path: str | Path, outtype: str = "f32") -> Path:
    """Write `model_dir` (None: the bundled model) to `out_path` as GGUF; weight matrices in
    `outtype` ("f32", "f16", or "q8_0": llama.cpp's 8-bit blocks of 32 with an fp16 scale,
    quantized by the `gguf` package as llama.cpp's own quantizer does), norms always f32.
    Returns the path."""
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    model_dir = resolve_model_dir(model_dir)
    cfg = load_config(model_dir)
    if cfg.architecture != "LlamaForCausalLM" or cfg.rope_scaling or cfg.qkv_bias:
        raise ValueError(
            f"{cfg.architecture} (rope_scaling={cfg.rope_scaling}, qkv_bias={cfg.qkv_bias}): "
            "this exporter writes plain Llama only; use llama.cpp's convert_hf_to_gguf.py"
        )
    tok = tokenizer_fields(model_dir)
    out_path = Path(out_path)
    w = gguf.GGUFWriter(out_path, arch="llama")
    w.add_name(model_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    ftype = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}[outtype]
    w.add_file_type(gguf.LlamaFileType[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])  # llama.cpp's name for the split rule (see above)
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for kind, add in [("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)]:
        if tok["ids"][kind] is not None:
            add(tok["ids"][kind])
    for kind, add in [("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)]:
        if tok["ids"][kind] is not None:
            add(tok["ids"][kind])
    w.add_add_bos_token(tok["add_bos"])
    w.add_add_eos_token(False)
    if isinstance(tok["chat_template"], str):
        w.add_chat_template(tok["chat_template"])

    state = load_state_dict(model_dir)
    if cfg.tie_word_embeddings:  # llama.cpp reuses token_embd when output.weight is absent
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        t = tensor.float()
        if name.endswith("q_proj.weight"):
            t = rope_to_interleaved(t, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = rope_to_interleaved(t, cfg.num_key_value_heads)
        data = np.ascontiguousarray(t.numpy())
        if outtype == "f16" and data.ndim == 2:
            data = data.astype(np.float16)
        if outtype == "q8_0" and data.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, q8), raw_dtype=q8)
            continue
        w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: bundled)")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--outtype", default="f32", choices=OUTTYPES)
    args = parser.parse_args(argv)
    path = export_gguf(args.model, args.out, args.outtype)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
