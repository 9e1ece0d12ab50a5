"""Training the bundled models (`python -m minillm.training.train`), their corpus and
tokenizer, and the quality measures every chapter uses (perplexity, next-token agreement)."""

from minillm.training.evaluate import (
    first_divergence,
    held_out_ids,
    next_token_agreement,
    perplexity,
)

__all__ = ["first_divergence", "held_out_ids", "next_token_agreement", "perplexity"]
