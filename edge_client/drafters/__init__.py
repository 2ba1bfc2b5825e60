"""Drafters by name. Each proposes tokens from the committed context and rolls back after a verdict."""

from __future__ import annotations

import importlib

from .base import Drafter, DrafterOptions, Proposal

# name -> "module:Class", imported on use so a device installs only what its drafter needs.
REGISTRY = {
    "llama-cpp": "edge_client.drafters.llama_cpp:LlamaCppDrafter",
    "onnx": "edge_client.drafters.onnx:OnnxDrafter",
    "parallel": "edge_client.drafters.parallel:ParallelDrafter",
    "ngram": "edge_client.drafters.ngram:NgramDrafter",
    "cacheback": "edge_client.drafters.cacheback:CachebackDrafter",
    "none": "edge_client.drafters.base:NoDrafter",
}
PROPOSERS = ("ngram", "cacheback")  # model-free: the lower layer of a stack
MODELS = ("llama-cpp", "onnx")  # the upper layer, whose distribution the drafts follow
STACKED = "stack:ngram+llama-cpp"  # what `stacked` names
NAMES = sorted(REGISTRY) + ["stacked", "stack:PROPOSER+MODEL"]


def stack_layers(name: str) -> tuple[str, str] | None:
    """(proposer, model) of a stacked drafter's name (`stacked`, `stack:ngram+llama-cpp`), None for another name;
    a malformed stack is a ValueError naming what is allowed."""
    if name == "stacked":
        name = STACKED
    if not name.startswith("stack:"):
        return None
    proposer, plus, model = name[len("stack:"):].partition("+")
    if not plus or proposer not in PROPOSERS or model not in MODELS:
        raise ValueError(f"a stacked drafter is stack:PROPOSER+MODEL with PROPOSER one of {', '.join(PROPOSERS)} and "
                         f"MODEL one of {', '.join(MODELS)}, e.g. {STACKED}; got {name!r}")
    return proposer, model


def check_drafter_name(name: str) -> str:
    """The name if it names a drafter, else a ValueError listing them."""
    if name not in REGISTRY and stack_layers(name) is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(NAMES)}")
    return name


def create_drafter(name: str, options: DrafterOptions | None = None) -> Drafter:
    options = options or DrafterOptions()
    layers = stack_layers(check_drafter_name(name))
    if layers is not None:
        from .stacked import StackedDrafter

        return StackedDrafter(create_drafter(layers[0], options), create_drafter(layers[1], options))
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(options)


__all__ = ["Drafter", "DrafterOptions", "Proposal", "REGISTRY", "check_drafter_name", "create_drafter"]
