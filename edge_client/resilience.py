"""When the server is away: how long to wait, when to try again, what to say, and what to do meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .transport import VerifyError

# Refusals worth reconnecting for; anything else (bad input, mismatch, auth) fails at once.
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "ABORTED", "NOT_FOUND",
                       "RESOURCE_EXHAUSTED"})
FALLBACKS = ("wait", "local", "fail")
# The shortest wait an Open gets under the wait policy, near its deadline: long enough to reach a server that is up.
MIN_OPEN_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Resilience:
    fallback: str = "wait"  # wait | local | fail, while the server is unreachable
    wait_deadline_s: float = 120.0  # `wait` gives up after this long without the server
    round_timeout_s: float = 30.0  # deadline of one round (Draft -> Verdict) and of an Open
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 4.0

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        for name in ("wait_deadline_s", "round_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def local(self) -> bool:
        """The drafter goes on alone while the server is away (its tokens marked unverified)."""
        return self.fallback == "local"


class Outage:
    """One generation's view of its server: since when it is away (None while it answers), when to try again, and the
    messages that say so (`on_status`)."""

    def __init__(self, policy: Resilience, address: str, on_status: Callable[[str], None] | None = None):
        self.policy, self.address, self.on_status = policy, address or "(no address)", on_status
        self.since: float | None = None  # time.monotonic() at the start of the attempt that found the server gone
        self.next_attempt = 0.0
        self.backoff = policy.backoff_initial_s

    def _say(self, message: str) -> None:
        if self.on_status is not None:
            self.on_status(message)

    def open_timeout(self) -> float:
        """How long an Open may take. Under the wait policy it waits for the server to come up, for the round timeout
        at most and never past the wait deadline, which counts from the start of the first attempt that failed."""
        if self.policy.fallback != "wait":
            return self.policy.round_timeout_s
        waited = 0.0 if self.since is None else time.monotonic() - self.since
        return max(MIN_OPEN_TIMEOUT_S, min(self.policy.round_timeout_s, self.policy.wait_deadline_s - waited))

    @property
    def waits_for_ready(self) -> bool:
        """The first attempt fails at once where the server is down, so the outage is told at once; the attempts
        after it, under the wait policy, wait for the server to come up (bounded by open_timeout)."""
        return self.policy.fallback == "wait" and self.since is not None

    def failed(self, err: VerifyError, began: float) -> None:
        """The server is unreachable since `began` (the start of the attempt that failed, unless an outage is already
        under way): raise where the policy gives up, else set when to try again."""
        if err.code not in TRANSIENT:
            raise err
        now = time.monotonic()
        # a server that cannot be reached, or one that turns sessions away for now (full, shutting down)
        state = "unreachable" if err.unreachable else "unavailable"
        if self.policy.fallback == "fail":
            raise VerifyError(err.code, f"verify server {self.address} {state} ({err.message}); "
                                        "fallback policy is fail")
        if self.since is None:
            self.since = began
            then = (f"waiting up to {self.policy.wait_deadline_s:g}s for it" if self.policy.fallback == "wait"
                    else "going on with the drafter alone, its tokens marked unverified, until it is back")
            self._say(f"verify server {self.address} {state} ({err.code}: {err.message}); {then}")
        waited = now - self.since
        left = self.policy.wait_deadline_s - waited
        if self.policy.fallback == "wait" and left <= 0:
            raise VerifyError("DEADLINE_EXCEEDED", f"verify server {self.address} {state} for {waited:.1f}s, "
                                                   f"past the wait deadline of {self.policy.wait_deadline_s:g}s: "
                                                   f"{err.message}")
        self.next_attempt = now + (min(self.backoff, left) if self.policy.fallback == "wait" else self.backoff)
        self.backoff = min(self.backoff * 2, self.policy.backoff_max_s)

    def opened(self, reopened: bool, context_tokens: int, server: str | None = None) -> None:
        """A session opened (on `server`, where the device has several): say so where the server had been away, and
        forget the outage."""
        if self.since is not None:
            after = f"after {time.monotonic() - self.since:.1f}s"
            where = server or self.address
            self._say(f"verify server {where} reopened the session {after} with its whole context "
                      f"({context_tokens} tokens)" if reopened
                      else f"verify server {where} opened the session {after}")
        self.since, self.backoff = None, self.policy.backoff_initial_s

    def until_next_attempt(self) -> float:
        return self.next_attempt - time.monotonic()
