"""What one generation gives back: its tokens and text, and the figures of its rounds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_verified: list[bool] = field(default_factory=list)
    text: str = ""
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    loosely_accepted_tokens: int = 0  # of accepted_tokens, accepted by a loose verification rule (not the target's own)
    reconnects: int = 0
    round_times: list[float] = field(default_factory=list)  # seconds per round (draft + verify)
    round_tokens: list[int] = field(default_factory=list)  # tokens committed per round
    # per verified round, the server's step that verified it as its verdict says: (tokens, ms, sessions)
    round_steps: list[tuple[int, float, int]] = field(default_factory=list)
    # per verified round, how fast the device answered the verdict before it: (ms from that verdict's arrival to this
    # round's draft going out, ms of it spent finishing the token being drafted ahead when it came); nan for a
    # session's first round, which answers no verdict
    round_replies: list[tuple[float, float]] = field(default_factory=list)
    # per verified round, how long its draft waited at the server through earlier steps (Verdict.queue_ms): more than
    # 0 where it arrived while another step ran
    round_queue_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    finish_reason: str | None = None
    drafter: str = ""
    ahead_rounds: int = 0  # rounds whose draft was (partly) made while the previous round was verified
    ahead_tokens: int = 0  # tokens of those drafts made ahead
    # rounds whose draft went out of tokens drafted ahead at once, while the drafter was still on its next token
    answered_at_once: int = 0
    forced_tokens: int = 0  # drafted by the request's constraint alone (edge_client.constrained)

    @property
    def unverified_tokens(self) -> int:
        return self.token_verified.count(False)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        # vLLM: 1 + accepted / drafts, one draft per round.
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "drafter": self.drafter,
            "finish_reason": self.finish_reason,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "loosely_accepted_tokens": self.loosely_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "elapsed_s": self.elapsed_s,
            "tokens_per_second": self.tokens_per_second,
            "reconnects": self.reconnects,
            "mean_draft_tokens": self.draft_tokens / self.rounds if self.rounds else 0.0,
            "ahead_rounds": self.ahead_rounds,
            "ahead_tokens": self.ahead_tokens,
            "answered_at_once": self.answered_at_once,
            "forced_tokens": self.forced_tokens,
            "unverified_tokens": self.unverified_tokens,
            "unverified_token_indices": [i for i, ok in enumerate(self.token_verified) if not ok],
        }
