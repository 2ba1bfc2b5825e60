"""Drafters by name. Each proposes tokens from the committed context and rolls back after a verdict."""

from __future__ import annotations

import importlib

from .base import Drafter, DrafterOptions, Proposal

# name -> "module:Class", imported on use so a device installs only what its drafter needs.
REGISTRY = {
    "llama-cpp": "edge_client.drafters.llama_cpp:LlamaCppDrafter",
    "onnx": "edge_client.drafters.onnx:OnnxDrafter",
    "ngram": "edge_client.drafters.ngram:NgramDrafter",
    "cacheback": "edge_client.drafters.cacheback:CachebackDrafter",
    "none": "edge_client.drafters.base:NoDrafter",
}


def create_drafter(name: str, options: DrafterOptions | None = None) -> Drafter:
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(options or DrafterOptions())


__all__ = ["Drafter", "DrafterOptions", "Proposal", "REGISTRY", "create_drafter"]
