"""Small helpers shared by the package tests."""

import importlib
import re
from functools import cache

from minillm.generation import greedy_params as greedy  # noqa: F401  (the tests' name)


@cache
def resolve(dotted: str) -> object | None:
    """The object a dotted name names (a module, or an attribute path inside one: prose's
    `minillm.cache.paged.PagedKVCache`), or None when nothing answers to it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return None
            obj = getattr(obj, attr)
        return obj
    return None


# SmolLM2 tokenizer and chat samples (tests/test_smollm2.py, tests/test_llama_cpp.py)
SMOLLM2_TEXTS = [
    "Hello world! How are you today?",
    "naïve café, 東京, Zürich, emoji 🤖🎉 and math: ∑ x² ≤ π",
    "  leading spaces, double  spaces,\ttabs\nnew lines\r\nand trailing   ",
    "digits 1234567, 3.14159, 2024-01-01, $1,000, v2.0 and abc123def",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'll say it's DON'T, you've; we'd they're",
    "def f(x):\n    return {'a': [1, 2]}  # code",
]
# transformers 5.19 does not know llama.cpp's "smollm" pre-tokenizer (it has no entry in
# GGUF_PRE_TOKENIZER_SPLITS) and falls back to GPT-2's regex alone, which cuts a whitespace
# run before a digit differently ("a  1": "a", "Ġ", "Ġ", "1" instead of "a", "ĠĠ", "1").
# SmolLM2's own tokenizer.json (Digits, then ByteLevel) and llama.cpp ("\p{N}", then GPT-2's
# regex) split the digits off first, as minillm does; tests/test_llama_cpp.py checks it
# against llama.cpp.
SPACE_BEFORE_DIGIT = ["Steps:\n\n1. Preheat the oven.\n2. Mix.", "a  1", "x = [  1,   2]"]
SMOLLM2_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer in one sentence."},
        {"role": "user", "content": "Tell me about the sea."},
    ],
    [
        {"role": "user", "content": "Give me a word that rhymes with cat."},
        {"role": "assistant", "content": "Hat."},
        {"role": "user", "content": "Another one, please?"},
    ],
]


# A figure as prose states one: 1.5x, 38%, 12 ms, 0.3 s, 60 GB/s, 512 MiB, 49 tok/s (not a
# "p50, ms" column head, not "4 x 128"). The notebook, docs and CLAIMS provenance tests use it.
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x|\s?(?:%|ms|µs|s|GB/s|MiB|GiB|tok/s))(?![\w/])"
)
