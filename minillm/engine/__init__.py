"""Chapter 08: continuous batching over the paged KV cache (sequence, scheduler, model runner,
detokenizer, the engine and its one `EngineConfig`) and vLLM's offline API (`LLM`); the
server is `minillm.serving`."""

from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.llm_engine import Engine
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.generation.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "Sequence",
]
