"""Hierarchical drafting (Globerson et al., arXiv 2510.19705): a model-free proposer under a model drafter.

The proposer's guesses (prompt lookup or Cacheback) are checked by the model in one forward and kept by the
standard rejection rule against the model's own distribution (KVDrafter.propose's `guesses`), so the tokens and
the q sent are exactly the model's and the server's verification stays lossless. It pays where a forward of
several tokens costs little more than one (a memory-bound device) and the proposer is often right; a GuessGate
turns the proposer off where its guesses are not kept often enough to pay for their checks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .base import Proposal


@dataclass
class GuessGate:
    """Whether the proposer's guesses are worth checking: over the last `window` checks, the guesses kept must
    average at least `min_kept` a check (each kept guess is a sequential model step saved; a check that keeps none
    costs its forward). Once off, the proposer rests for `rest` drafts, then is tried again."""

    min_kept: float = 1.0
    window: int = 16
    rest: int = 64
    _kept: deque = field(default_factory=deque)
    _resting: int = 0

    def allows(self) -> bool:
        if self._resting:
            self._resting -= 1
            return False
        return True

    def record(self, kept: int) -> None:
        self._kept.append(kept)
        if len(self._kept) > self.window:
            self._kept.popleft()
        if len(self._kept) == self.window and sum(self._kept) < self.min_kept * self.window:
            self._resting = self.rest
            self._kept.clear()


class StackedDrafter:
    """Drafts with `model` (a KVDrafter), its guesses first proposed by `proposer` (any model-free drafter)."""

    def __init__(self, proposer, model, gate: GuessGate | None = None):
        self.proposer, self.model = proposer, model
        self.gate = gate or GuessGate()
        self.name = f"stack:{proposer.name}+{model.name}"
        self.checks = self.guessed = self.kept = 0  # lifetime counts, for the benchmark and the logs

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        self.proposer.begin(context, sampling)
        self.model.begin(context, sampling)

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        guesses = self.proposer.propose(context, k - 1).token_ids if k > 1 and self.gate.allows() else []
        proposal = self.model.propose(context, k, stop, guesses=guesses)
        if guesses:
            kept = self.model.guesses_kept
            self.gate.record(kept)
            self.checks, self.guessed, self.kept = self.checks + 1, self.guessed + len(guesses), self.kept + kept
        return proposal

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        self.proposer.accept(context, ahead)
        self.model.accept(context, ahead)

    def close(self) -> None:
        self.proposer.close()
        self.model.close()
