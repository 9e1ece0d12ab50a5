"""A Hugging Face `tokenizer.json` rebuilt from a GGUF file's tokenizer metadata.

A GGUF stores a byte-level BPE tokenizer as plain lists under llama.cpp's keys: the
vocabulary (`tokenizer.ggml.tokens`, already spelled in GPT-2's byte alphabet, so " the" is
"Ġthe"), the merges ("Ġ t"), a type per token (1 normal, 3 control, 4 user-defined, ...), the
special ids and the chat template. What it does not store is the pre-tokenizer, the rule that
cuts text into words before BPE runs: only a name (`tokenizer.ggml.pre`) that llama.cpp maps
to a list of split regexes. `_PRE_TOKENIZERS` gives the `tokenizers` equivalent of the ones
minillm reads. Getting it wrong changes ids silently, e.g. SmolLM2's "smollm" splits every
digit off first, so "\\n\\n1." is "ĊĊ", "1", "." and not "Ċ", "Ċ", "1", ".".
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp pre-tokenizer name -> the `tokenizers` pre-tokenizers that cut text the same way
# (llama-vocab.cpp: "gpt-2" runs GPT-2's regex; "smollm" runs "\p{N}" first, then GPT-2's).
_PRE_TOKENIZERS: dict[str, list[pre_tokenizers.PreTokenizer]] = {
    "gpt-2": [],
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],
}


def _pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    if name not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {name!r} is not one minillm rebuilds ({sorted(_PRE_TOKENIZERS)}): "
            "add its split regexes (llama.cpp's llama-vocab.cpp) to _PRE_TOKENIZERS in "
            "minillm/model/gguf_tokenizer.py"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([*_PRE_TOKENIZERS[name], byte_level])


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer that GGUF metadata `meta` (key -> value) describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r}: minillm rebuilds byte-level BPE ('gpt2') only; "
            "load this model from its Hugging Face checkpoint (with tokenizer.json) instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary repeats a token: ids would not round-trip")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        single = f"{tokens[bos]}:0 $A:0"
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1", special_tokens=[(tokens[bos], bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (type 3: <|im_start|>, ...) and user-defined ones (type 4) match whole in
    # the text, never cut by BPE; control ones are also dropped by skip_special_tokens.
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, k in zip(tokens, types, strict=True) if k == 3]
    user = [t for t, k in zip(tokens, types, strict=True) if k == 4]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def tokenizer_config(meta: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: the special tokens as strings and the chat template, as
    transformers and `minillm.Tokenizer` read them."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for name, key in [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")]:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
