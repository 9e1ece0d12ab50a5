"""Exercise skeletons for the minillm course: fill in the bodies, then grade them.

Each `chNN_*.py` module here has the same functions as its twin in `solutions/`,
with signatures and docstrings but bodies that `raise NotImplementedError`.
Grade one chapter with

    make grade CH=01      # = MINILLM_IMPL=exercises pytest tests/exercises -k ch01

See `exercises/README.md`.
"""
