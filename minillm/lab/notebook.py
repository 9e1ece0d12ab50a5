"""What the notebooks show besides tables and plots: source listings kept out of the way."""

from __future__ import annotations

import inspect
import re
from typing import Any


def source_details(summary: str, *objects: Any) -> None:
    """Display the source of `objects` in a collapsed <details> block titled `summary`:
    optional depth a learner opens on demand, built from the code as it is (never a copy
    that goes stale), and not counted in a chapter's reading length."""
    from IPython.display import Markdown, display

    code = "\n".join(inspect.getsource(obj) for obj in objects)
    display(
        Markdown(f"<details><summary>{summary}</summary>\n\n```python\n{code}```\n\n</details>")
    )


def show_source(*functions: Any) -> None:
    """Print each function's source without its docstring: the lines that do the work
    (the docstring is one `help()` away)."""
    for fn in functions:
        print(re.sub(r'\n\s+"""[\s\S]*?"""', "", inspect.getsource(fn), count=1))
