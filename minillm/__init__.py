"""minillm: a small LLM inference engine built chapter by chapter in the course.

The package is layered; each folder imports only from the ones listed before it:

    kernels, lab    Triton kernels with their PyTorch references; measuring tools (leaves)
    cache           the KV caches the model attends through (contiguous, paged)
    model           the decoder, its config, checkpoints, tokenizer
    generation      sampling and the generation loops (naive, cached, static, paged, speculative)
    training        corpus, tokenizer training, the training script, perplexity
    quant           quantization formats and QuantLinear; INT8 calibration and layer fusion
    export          ONNX / ONNX Runtime, TensorRT, GGUF
    engine          continuous batching: sequence, scheduler, model runner, LLMEngine, LLM
    serving         the OpenAI-compatible server
    bench           the benchmark harness over every backend

`tests/test_layers.py` checks that order.
"""

from minillm._version import __version__
from minillm.engine import LLM
from minillm.generation import SamplingParams, generate, generate_naive
from minillm.model import (
    BUNDLED_DIR,
    BUNDLED_DRAFT_DIR,
    ModelConfig,
    Tokenizer,
    Transformer,
    load_model,
    load_tokenizer,
    save_model,
)

__all__ = [
    "__version__",
    "LLM",
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
