"""The drafter's model file: the one asked for, or the default GGUF (sled.models)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sled.models import default_model_path


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
