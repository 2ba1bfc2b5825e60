"""One generation as it enters the device (the CLI, the daemon, a benchmark): built once there and passed whole."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sled.constraints import Constraint

from .policy import DraftPolicy
from .round import RoundHooks
from .sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    """What to generate: the prompt, how many tokens at most, how to sample, draft and verify, and what else stops
    it; `client_id` names the device to the server (logs, metrics); `constraint` what the text must match
    (structured output, enforced by the server). Checked when built."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    policy: DraftPolicy = DraftPolicy()
    stop_token_ids: Sequence[int] = ()
    client_id: str = ""
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: nothing to continue")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be at least 1")
        self.policy.check(self.sampling)


@dataclass(frozen=True)
class Callbacks:
    """Who hears a generation: on_text(piece, verified) sees the text as it is committed; on_status(message) hears
    when the server is found unreachable and when it is back, and when it caps K; should_stop() is asked each round;
    `hooks` watch its rounds (edge_client.round.RoundHooks)."""

    on_text: Callable[[str, bool], None] | None = None
    on_status: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None
    hooks: RoundHooks | None = None
