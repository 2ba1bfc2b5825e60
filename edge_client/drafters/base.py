"""The drafter interface: begin, propose, accept (which rolls back), close."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..sampling import SamplingParams


@dataclass(frozen=True)
class DrafterOptions:
    model_path: str | None = None  # GGUF for llama-cpp; None: the SmolLM2 default
    onnx_model: str | None = None  # .onnx for the onnx drafter
    threads: int | None = None
    gpu_layers: int = 0
    flash_attn: bool = True  # llama.cpp's flash attention (EdgeConfig.flash_attn says why on)
    context_size: int = 4096
    top_k_cap: int = 16  # the sparse q carries at most this many tokens per position
    ngram_max: int = 4
    ngram_min: int = 1


@dataclass
class Proposal:
    token_ids: list[int]
    # Sparse q per token, or None when each token was chosen deterministically (q = 1 on it).
    q_ids: list[np.ndarray] | None = None  # each [K_i] int64
    q_probs: list[np.ndarray] | None = None  # each [K_i] float32
    extras: dict = field(default_factory=dict)
    # The drafter's confidence in each token (its top-1 probability there), or None where it has none.
    confidence: list[float] | None = None

    def q(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The sparse q of token i; a proposal without q chose each token with certainty."""
        if self.q_ids is None:
            return np.array([self.token_ids[i]], dtype=np.int64), np.ones(1, dtype=np.float32)
        return self.q_ids[i], self.q_probs[i]

    def then(self, other: "Proposal") -> "Proposal":
        """The tokens of this proposal then `other`'s, each with its own q and confidence."""
        if not self.token_ids or not other.token_ids:
            return other if not self.token_ids else self
        tokens = self.token_ids + other.token_ids
        confidence = (self.confidence + other.confidence
                      if self.confidence is not None and other.confidence is not None else None)
        if self.q_ids is None and other.q_ids is None:
            return Proposal(tokens, confidence=confidence)
        qs = [self.q(i) for i in range(len(self.token_ids))] + [other.q(i) for i in range(len(other.token_ids))]
        return Proposal(tokens, [q[0] for q in qs], [q[1] for q in qs], confidence=confidence)

    def cut(self, start: int, end: int | None = None) -> "Proposal":
        """Tokens [start, end) with their q and confidence."""
        return Proposal(self.token_ids[start:end], None if self.q_ids is None else self.q_ids[start:end],
                        None if self.q_probs is None else self.q_probs[start:end],
                        confidence=None if self.confidence is None else self.confidence[start:end])


class Drafter(Protocol):
    name: str

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        """Start a session with its whole context (prompt plus anything already committed)."""

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        """Up to k tokens that continue `context` (the committed tokens). A drafter that reports its confidence
        asks `stop.take(confidence)` (edge_client.adaptive.DraftStop) of each token it drafts, if a stop is given,
        and `stop.more()` before drafting the next, and ends the draft where either says no; one without confidence
        ignores it."""

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        """The verdict is in and `context` is committed: drop any state past what agrees with it. `ahead` are
        tokens drafted ahead that continue `context` and go out next: state for them may be kept (a KV cache
        keeps their keys and values rather than computing them again); they are not committed."""

    def close(self) -> None: ...


class NoDrafter:
    """Proposes nothing: the server decodes every token (the server-only baseline)."""

    name = "none"

    def __init__(self, options: DrafterOptions):
        pass

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        pass

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        return Proposal([])

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        pass

    def close(self) -> None:
        pass
