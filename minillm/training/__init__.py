"""Training the bundled models (`python -m minillm.training.train`), their corpus and
tokenizer, and the quality measures every chapter uses (perplexity, next-token agreement) on
held-out KJV text and on modern English (the CIA World Factbook)."""

from minillm.training.evaluate import (
    factbook_ids,
    first_divergence,
    held_out_ids,
    next_token_agreement,
    perplexity,
)

__all__ = ["factbook_ids", "first_divergence", "held_out_ids", "next_token_agreement", "perplexity"]
