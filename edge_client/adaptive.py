"""Adaptive draft length: each round, the K that maximizes expected committed tokens per second.

In the spirit of DSD's adaptive window control. With per-token acceptance alpha (estimated over the
recent rounds), a round with k drafted tokens commits (1 - alpha^(k+1)) / (1 - alpha) tokens on
average and takes k * t_draft + rtt_fixed + c * (k + 1), where t_draft is this device's measured
drafting time per token, c what one more token of K costs the step this draft rides in, and rtt_fixed the
rest of the round trip (network, queueing, the step's cost at no tokens). Low acceptance, slow drafting or a
loaded server shorten the draft; the opposite lengthens it.

c is the server's marginal cost of one more token in a step (the slope of its step time over step tokens on
recent steps, reported in every Verdict) times the sessions in the step (also in the Verdict): every device in
the step runs this controller on much the same figures, so one more token of K from this device is one more from
each, and the step, which every one of them waits for, grows by that many tokens. Counting only its own token (the
earlier form) kept K at 8 at a saturated CPU server where shorter drafts commit more per verified token:
scripts/sim_rounds.py's model of this machine's server at 32 devices (20 ms a step + 2.9 ms a token, match 0.94)
gave 0.92x of the best fixed K before, 0.98x after (tests/test_sim_rounds.py). In the system benchmark one run
had K = 2 best at 32 devices (235.8 tok/s against adaptive's 217.4 at K 7.9); the next, with this change, had K = 8
best, and adaptive stayed near K 7.8: no measurable effect there. A round trip under saturation spans more than
one step, each growing with the others' K, which this model still counts as fixed.

With drafting ahead (the device drafts on while its draft is verified), a round that is accepted whole with the
bonus token the drafter guessed (probability about alpha^(k+1)) leaves the next draft made during the round
trip, so only max(0, (k+1) * t_draft - rtt) of drafting is left before it goes out; any other round drafts all k
after the verdict. Drafting ahead thus favours drafts short enough to be ready within one round trip, but not
shorter than that by much: a verdict that comes while a token is being drafted ahead waits for that token (half a
token on average), which a draft long enough to keep the drafter busy anyway does not notice (tests/test_sim_rounds.py:
without it, one device at a launch-bound server chose 2-3 tokens, under 0.9x the best fixed K).

A device keeps one controller across its requests (`generate(..., controller=)`): acceptance, drafting time and
round trip describe the device, its drafter and the server, not one request. A fresh controller per request
guesses from its first two or three rounds every time; at a loaded server, where each round costs a long round
trip, those short guessed drafts cost 5-10% of system throughput in the benchmark at 16 devices.
After an idle spell longer than max_age_s (120 s) the next request measures afresh, starting from the last K.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundSample:
    drafted: int
    accepted: int
    draft_s: float  # time spent drafting this round
    rtt_s: float  # Draft sent -> Verdict received (not -> the token being drafted ahead then is done)
    server_token_s: float  # the server's marginal cost of one more token
    draft_token_s: float | None = None  # the drafter's time per token over all its drafting, ahead included
    step_sessions: int = 1  # sessions in the step that verified this draft (0, from a server that sends none: 1)


class AdaptiveDraftLength:
    def __init__(self, k_max: int = 8, k_min: int = 1, k_initial: int = 4, window: int = 16, ahead: bool = False,
                 max_age_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_max, self.k_min, self.ahead = k_max, k_min, ahead
        self.k = min(max(k_initial, k_min), k_max)
        self.samples: deque[RoundSample] = deque(maxlen=window)
        self.max_age_s, self.clock = max_age_s, clock
        self.last_observed: float | None = None

    @classmethod
    def for_device(cls, max_draft_tokens: int, ahead: bool) -> AdaptiveDraftLength:
        """A device's new controller: K starts at its bound (optimistic: a poor drafter is cut back after two
        rounds)."""
        k = max(max_draft_tokens, 1)
        return cls(k_max=k, k_initial=k, ahead=ahead)

    def configure(self, k_max: int, ahead: bool) -> None:
        """A new request's bounds and mode; what was learned stays, unless the device has been idle for longer
        than max_age_s: the server's load and round trip may have changed since, so the samples are dropped
        (the last K stays as the first guess)."""
        if k_max < self.k_min:
            raise ValueError(f"need k_max >= k_min = {self.k_min}, got {k_max}")
        self.k_max, self.ahead = k_max, ahead
        self.k = min(max(self.k, self.k_min), k_max)
        if self.last_observed is not None and self.clock() - self.last_observed > self.max_age_s:
            self.samples.clear()

    def observe(self, sample: RoundSample) -> None:
        if sample.drafted > 0:
            self.samples.append(sample)
            self.last_observed = self.clock()
            self.k = self.choose()

    def acceptance(self) -> float:
        accepted = sum(s.accepted for s in self.samples)
        rejected = sum(1 for s in self.samples if s.accepted < s.drafted)
        return min(max((accepted + 0.5) / (accepted + rejected + 1.0), 0.01), 0.995)

    def choose(self) -> int:
        if len(self.samples) < 2:
            return self.k
        alpha = self.acceptance()
        timed = [s.draft_token_s for s in self.samples if s.draft_token_s is not None]
        if timed:
            t_draft = sum(timed) / len(timed)
        else:
            t_draft = sum(s.draft_s for s in self.samples) / sum(s.drafted for s in self.samples)
        sessions = sum(max(s.step_sessions, 1) for s in self.samples) / len(self.samples)
        c = sessions * sum(s.server_token_s for s in self.samples) / len(self.samples)
        fixed = max(0.0, sum(s.rtt_s - c * (s.drafted + 1) for s in self.samples) / len(self.samples))

        def goodput(k: int) -> float:
            tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
            rtt = fixed + c * (k + 1)
            if not self.ahead:
                return tokens / (k * t_draft + rtt)
            hit = alpha ** (k + 1)
            if rtt < (self.k_max + 1) * t_draft:  # still drafting ahead when the verdict comes
                rtt += t_draft / 2
            return tokens / (rtt + hit * max(0.0, (k + 1) * t_draft - rtt) + (1 - hit) * k * t_draft)

        return max(range(self.k_min, self.k_max + 1), key=goodput)
