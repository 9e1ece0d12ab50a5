"""Where minillm keeps the files it derives (a GGUF converted to safetensors, a compiled
CPU kernel, a built llama-server): `$MINILLM_CACHE`, else ~/.cache/minillm. Each is rebuilt
when missing, so the folder can be deleted at any time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$MINILLM_CACHE`, else ~/.cache/minillm (not created here)."""
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")
