"""`python -m minillm.bench`: the harness's command line (also `python -m minillm bench`)."""

import sys

from minillm.bench.command import main

try:
    main()
except (ValueError, FileNotFoundError) as err:  # bad input: one clear line
    sys.exit(f"error: {err}")
