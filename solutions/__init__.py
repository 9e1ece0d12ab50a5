"""Reference answers to the exercises in `exercises/`, with the same API.

Written from scratch in plain torch (not imported from `minillm`), so that the
tests in `tests/exercises/` compare them with minillm, transformers and torch.
CI grades these; a learner reads them after trying (see `exercises/README.md`).
"""
