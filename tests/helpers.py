"""Small helpers shared by the package tests."""

from minillm import SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    """Greedy decoding of exactly n tokens (EOS does not stop it)."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
