"""Generation: sampling, the one sampling loop, and the generators built on it: naive
(chapter 01), cached (02), static-shape compiled (05), paged (07), speculative with a draft
model or with prompt lookup (10)."""

from minillm.generation.cached import generate, generate_naive
from minillm.generation.lookup import prompt_lookup_generate
from minillm.generation.paged import generate_paged
from minillm.generation.params import greedy_params
from minillm.generation.sampling import SamplingParams
from minillm.generation.speculative import speculative_generate
from minillm.generation.static import generate_static

__all__ = [
    "SamplingParams",
    "generate",
    "generate_naive",
    "generate_paged",
    "generate_static",
    "greedy_params",
    "prompt_lookup_generate",
    "speculative_generate",
]
