"""Hierarchical drafting (Globerson et al., arXiv 2510.19705): a model-free proposer under a model drafter.

The proposer's guesses (prompt lookup or Cacheback) are checked by the model in one forward and kept by the
standard rejection rule against the model's own distribution (KVDrafter.propose's `guesses`), so the tokens and
the q sent are exactly the model's and the server's verification stays lossless. A kept guess saves one of the
model's sequential steps; the check costs a forward of the guesses, which also evaluates the context's new tokens
(the round's first step). It pays where that forward costs little more than one step (a memory-bound device: ONNX
Runtime on a CPU, a GPU) and the proposer is often right; a GuessGate measures both on the device and
turns the proposer off where its checks do not pay.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .base import Proposal


@dataclass
class GuessGate:
    """Whether, and how many of, the proposer's guesses are worth checking. A check saves one model step (`step_s`,
    measured) for each guess kept, and one more where its forward also did the round's first step (`replaced`), and
    costs its forward (`check_s`, measured): over the last `window` checks the seconds saved must stay above zero.
    Once they do not, the proposer rests while the model drafts `rest` tokens alone (twice as many after each rest
    that did not help, up to `max_rest`), then is tried again: counted in tokens, not calls, since drafting ahead
    asks for guesses several times a round. A check takes one guess more than were kept lately (`budget`), so a proposer
    right for a few tokens is not charged for its longer runs of guesses."""

    window: int = 16
    rest: int = 256
    max_rest: int = 4096
    _saved: deque = field(default_factory=deque)  # seconds each recent check saved (negative: lost)
    _kept_mean: float | None = None  # recent guesses kept a check, an exponential mean
    _resting: int = 0
    _next_rest: int = 0

    def allows(self) -> bool:
        return self._resting <= 0

    def drafted_alone(self, tokens: int) -> None:
        """The model drafted `tokens` without guesses: a rest passes."""
        self._resting = max(0, self._resting - tokens)

    def budget(self, k: int) -> int:
        """How many guesses a draft of k tokens checks (at most k - 1: the first token needs no guess)."""
        if self._kept_mean is None:
            return k - 1
        return max(1, min(k - 1, math.ceil(self._kept_mean) + 1))

    def record(self, kept: int, check_s: float, step_s: float | None, replaced: int = 0) -> None:
        """A check's outcome: guesses kept, the check's forward time, the model's single step time (None before
        any single step was timed, when the saving is not known yet) and the steps its forward replaced."""
        self._kept_mean = kept if self._kept_mean is None else 0.7 * self._kept_mean + 0.3 * kept
        if step_s is None:
            return
        self._saved.append((kept + replaced) * step_s - check_s)
        if len(self._saved) > self.window:
            self._saved.popleft()
        if len(self._saved) == self.window:
            if sum(self._saved) <= 0.0:
                self._resting = self._next_rest = min(max(self._next_rest * 2, self.rest), self.max_rest)
                self._saved.clear()
                self._kept_mean = None
            else:
                self._next_rest = 0  # paying again: the next rest starts short


class StackedDrafter:
    """Drafts with `model` (a KVDrafter), its guesses first proposed by `proposer` (any model-free drafter)."""

    def __init__(self, proposer, model, gate: GuessGate | None = None):
        self.proposer, self.model = proposer, model
        self.gate = gate or GuessGate()
        self.name = f"stack:{proposer.name}+{model.name}"
        self.checks = self.guessed = self.kept = 0  # lifetime counts, for the benchmark and the logs

    def constrain(self, mask) -> None:
        self.model.constrain(mask)  # the model draws the tokens; a guess the mask forbids is never kept

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        self.proposer.begin(context, sampling)
        self.model.begin(context, sampling)

    def _guesses(self, context: list[int], k: int) -> list[int]:
        return self.proposer.propose(context, self.gate.budget(k)).token_ids if k > 1 and self.gate.allows() else []

    def _checked(self, guesses: list[int], proposal: Proposal) -> None:
        if not guesses:
            self.gate.drafted_alone(len(proposal.token_ids))
        else:
            kept = self.model.guesses_kept
            self.gate.record(kept, self.model.check_s, self.model.step_s, self.model.check_replaced)
            self.checks, self.guessed, self.kept = self.checks + 1, self.guessed + len(guesses), self.kept + kept

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        guesses = self._guesses(context, k)
        proposal = self.model.propose(context, k, stop, guesses=guesses)
        self._checked(guesses, proposal)
        return proposal

    def step_ahead(self, context: list[int], limit: int) -> Proposal:
        """One step of drafting ahead (edge_client.draft_ahead), which a plain drafter takes a token at a time: the
        guesses checked in one forward, their kept run and the token after it, at most `limit` tokens."""
        guesses = self._guesses(context, limit)
        proposal = self.model.propose(context, len(guesses) + 1, guesses=guesses, upto_miss=True)
        self._checked(guesses, proposal)
        return proposal

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        self.proposer.accept(context, ahead)
        self.model.accept(context, ahead)

    def close(self) -> None:
        self.proposer.close()
        self.model.close()
