"""minillm: a small LLM inference engine built chapter by chapter in the course."""

from minillm.generate import generate, generate_naive
from minillm.model import ModelConfig, Transformer
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.weights import BUNDLED_DIR, BUNDLED_DRAFT_DIR, load_model, load_tokenizer, save_model

__all__ = [
    "BUNDLED_DIR",
    "BUNDLED_DRAFT_DIR",
    "ModelConfig",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "generate",
    "generate_naive",
    "load_model",
    "load_tokenizer",
    "save_model",
]
__version__ = "0.1.0"
