"""Chapter 08: continuous batching over the paged KV cache, vLLM's offline API and an
OpenAI-compatible server (`python -m minillm serve`)."""

from minillm.engine.llm import LLM
from minillm.engine.llm_engine import CompletionOutput, Engine, RequestOutput
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import SamplingParams, Sequence

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "Sequence",
]
