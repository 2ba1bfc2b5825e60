"""How a device drafts: one frozen policy, and the draft-length controller it builds (fixed or adaptive), which the
round loop asks the same questions whatever its kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sled.verification import Verification

from .adaptive import AdaptiveDraftLength, DraftStop, RoundSample
from .sampling import SamplingParams

# The acceptance from which a miss answered at once gets an empty draft (docs/device.md, "Drafting ahead").
EMPTY_AFTER_MISS = 0.8


class DraftLength(Protocol):
    """What the round loop asks of a draft-length controller."""

    k: int  # this round's draft length
    k_max: int  # the longest draft
    ahead_k: int  # the longest next draft that drafting ahead prepares: it stops one past it (after the bonus guess)
    first_k: int  # a generation's first draft, drafted while its session opens

    def cap(self, server_max: int) -> bool:
        """No draft longer than the server takes; whether that cuts the drafts and this controller had not heard it
        (a device tells its user once, not at each reconnect or request)."""

    def at_least(self, k: int) -> None:
        """No draft shorter than k where that is possible (a loose rule may judge a token by the ones after it)."""

    def observe(self, sample: RoundSample) -> None:
        """A round's verdict, what was drafted and how long it all took."""

    def stop_rule(self) -> DraftStop | None:
        """This round's confidence stop, or None (every draft K long)."""

    def empty_after_miss(self, threshold: float) -> bool:
        """Whether a miss answered at once gets an empty draft (the server's token alone)."""

    def answers_at_once(self, k: int, ready: int, busy: bool) -> bool:
        """Whether a verdict is answered at once with the `ready` tokens drafted (a hit's drafted ahead, K at most;
        none after a miss) rather than after drafting a draft of k; `busy`: the drafter is on a token meanwhile."""

    def server_queues(self) -> bool:
        """Whether the server queues this device's drafts (then finishing a draft first costs no time)."""


class FixedDraftLength:
    """K tokens every round: learns nothing, stops no draft early, finishes each draft to K."""

    def __init__(self, k: int):
        self.k = self.k_max = k

    @property
    def ahead_k(self) -> int:
        return self.k_max

    @property
    def first_k(self) -> int:
        return self.k

    def cap(self, server_max: int) -> bool:
        cut = server_max < self.k
        self.k = self.k_max = min(self.k, server_max)
        return cut

    def at_least(self, k: int) -> None:
        pass  # a fixed K is the user's choice

    def observe(self, sample: RoundSample) -> None:
        pass

    def stop_rule(self) -> DraftStop | None:
        return None

    def empty_after_miss(self, threshold: float) -> bool:
        return False

    def answers_at_once(self, k: int, ready: int, busy: bool) -> bool:
        return False

    def server_queues(self) -> bool:
        return False


@dataclass(frozen=True)
class DraftPolicy:
    """How a device drafts. With `adaptive`, K is chosen each round in 1..max_draft_tokens and draft_tokens only says
    whether to draft at all (0: the server decodes every token); without it, K is draft_tokens."""

    draft_tokens: int = 4
    adaptive: bool = True
    max_draft_tokens: int = 8
    draft_ahead: bool = True  # draft on while a draft is verified (edge_client.draft_ahead)
    confidence_stop: bool = False  # the adaptive K ends a draft at a token the drafter is too unsure of
    answer_at_once: bool = True  # answer a verdict without waiting for the token being drafted ahead
    empty_after_miss: float | None = EMPTY_AFTER_MISS  # None: a miss always gets K drafted afresh
    mask_drafts: bool = True  # under a request's constraint, a model drafter draws only what it allows
    forced_tokens: bool = True  # ... and the tokens it forces are drafted without the drafter
    # How the server verifies: a rule of sled/verification.py as NAME[:KEY=VALUE,...] (parameters left out take the
    # server's), or None for the server's default.
    verification: str | None = None

    def __post_init__(self) -> None:
        if self.draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {self.draft_tokens}")
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be at least 1, got {self.max_draft_tokens}")
        if self.empty_after_miss is not None and not 0 <= self.empty_after_miss <= 1:
            raise ValueError(f"empty_after_miss must be in [0, 1], got {self.empty_after_miss}")
        self.rule  # parses it: ValueError naming what is wrong

    @property
    def rule(self) -> Verification | None:
        """The verification rule asked for, None for the server's default."""
        return None if self.verification is None else Verification.parse(self.verification)

    def check(self, sampling: SamplingParams) -> None:
        """This policy's preconditions for a request: ValueError where its verification rule cannot apply."""
        rule = self.rule
        if rule is not None:
            rule.check(sampling.greedy)

    @property
    def drafts(self) -> bool:
        """Whether anything is drafted; without drafts the server decodes and streams every token."""
        return self.draft_tokens > 0

    @property
    def ahead(self) -> bool:
        return self.draft_ahead and self.drafts

    def controller(self, kept: AdaptiveDraftLength | None = None) -> DraftLength:
        """This policy's controller; an adaptive one continues `kept` (a device keeps one across its requests)."""
        if not self.adaptive or not self.drafts:
            return FixedDraftLength(self.draft_tokens)
        if kept is None:
            return AdaptiveDraftLength.for_device(self.max_draft_tokens, self.draft_ahead, self.confidence_stop)
        kept.configure(self.max_draft_tokens, self.draft_ahead)
        kept.confidence_stop = self.confidence_stop
        return kept
