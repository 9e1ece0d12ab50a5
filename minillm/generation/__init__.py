"""Generation: sampling, the one sampling loop, and the generators built on it: naive
(chapter 01), cached (02), static-shape compiled (05), paged (07), speculative (10)."""

from minillm.generation.cached import generate, generate_naive
from minillm.generation.paged import generate_paged
from minillm.generation.sampling import SamplingParams
from minillm.generation.speculative import speculative_generate
from minillm.generation.static import generate_static

__all__ = [
    "SamplingParams",
    "generate",
    "generate_naive",
    "generate_paged",
    "generate_static",
    "speculative_generate",
]
