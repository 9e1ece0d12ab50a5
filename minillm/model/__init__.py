"""The model: a Llama-style decoder in pure PyTorch (chapter 01), its config, checkpoint
loading and saving (HF directories; GGUF files and named models such as "smollm2", converted
once into the user cache), the tokenizer with its chat template, and real models' shapes for
random-weight work."""

from minillm.model.config import ModelConfig
from minillm.model.shapes import CONFIGS, random_model
from minillm.model.tokenizer import Tokenizer
from minillm.model.transformer import Transformer
from minillm.model.weights import (
    BUNDLED_DIR,
    BUNDLED_DRAFT_DIR,
    load_config,
    load_model,
    load_tokenizer,
    save_model,
)

__all__ = [
    "BUNDLED_DIR",
    "BUNDLED_DRAFT_DIR",
    "CONFIGS",
    "ModelConfig",
    "Tokenizer",
    "Transformer",
    "load_config",
    "load_model",
    "load_tokenizer",
    "random_model",
    "save_model",
]
