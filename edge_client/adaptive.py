"""Adaptive draft length: each round, the K that maximizes expected committed tokens per second (in the spirit of
DSD's adaptive window).

With per-token acceptance alpha over the recent rounds, a round of k drafted tokens commits
(1 - alpha^(k+1)) / (1 - alpha) tokens on average and takes k * t_draft + rtt_fixed + c * (k + 1): t_draft is this
device's drafting time per token, c what one more token of K costs the step it rides in (the server's marginal token
cost times the sessions in the step, times the round trip's steps where the server queues the drafts). Drafting
ahead changes how much of the drafting the round trip hides. A device keeps one controller across its requests.

Optionally (confidence_stop) a draft ends within K at a token the drafter is too unsure of, priced against what one
committed token costs at this K (DraftStop). The model, its terms and the measurements behind them:
docs/device.md, "How long a draft is".
"""

from __future__ import annotations

import bisect
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
    confidence: tuple[float, ...] | None = None  # the drafter's confidence in each drafted token, if it has one
    step_s: float = 0.0  # the wall time of the step that verified this draft (0: not reported)
    queue_s: float = 0.0  # how long the draft waited at the server through earlier steps (not the batching window)
    # whether the draft went out at once when the verdict before it came, nothing left to draft or wait for (a late
    # one, sent after finishing a token and drafting the rest of K, queues because it is late: server_queues)
    prompt: bool = True
    # the device's own time from the verdict before to this draft going out, less the drafting it waited for: what a
    # round costs the device whatever it drafts (None: a session's first round, or not measured)
    device_s: float | None = None


# Confidence bins, by their upper edges: [0, 0.1), [0.1, 0.2), ... [0.9, 0.95), [0.95, 1].
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def confidence_bin(confidence: float) -> int:
    return bisect.bisect_right(CONFIDENCE_EDGES, confidence)


class DraftStop:
    """One round's stopping rule. A drafter asks `take(confidence)` of each token it has drafted (or the device of
    each token drafted ahead): whether it goes out; and `more()` before it drafts another: whether that is worth
    the drafting. A token already drafted costs the round only its share of the step (`keep`), one not yet drafted
    its drafting too (`threshold`); the next token's chance is taken as the average (`alpha`) until it is drafted
    and its confidence known."""

    def __init__(self, accept_chance: Callable[[float], float], threshold: float, keep: float | None = None,
                 alpha: float = 1.0):
        self.accept_chance, self.threshold, self.alpha = accept_chance, threshold, alpha
        self.keep = threshold if keep is None else min(keep, threshold)
        self.reach = 1.0  # chance that every token taken so far is accepted
        self.taken = 0
        self.ended = False

    def take(self, confidence: float | None) -> bool:
        if confidence is None:
            return True
        reach = self.reach * self.accept_chance(confidence)
        if self.ended or (self.taken and reach < self.keep):
            self.ended = True
            return False
        self.reach, self.taken = reach, self.taken + 1
        return True

    def more(self) -> bool:
        return not self.ended and self.reach * self.alpha >= self.threshold


@dataclass(frozen=True)
class RoundCost:
    """The controller's model of a round, from its recent rounds: what a draft of k tokens commits on average and how
    long its round takes, and whether a verdict is answered at once with the tokens ready or after drafting to K."""

    alpha: float  # per-token acceptance
    t_draft: float  # the drafter's time per token
    c: float  # what one more token of K adds to the round trip
    fixed: float  # the round trip without its tokens: the server's step and batching window, the link
    device: float  # the device's own time a round, drafting aside (its loop, the wire, the drafter's rollback)
    hidden: float  # the drafting after a verdict that waiting at the server hides anyway
    late: float  # what a draft that misses the batching window its verdict's step opened waits for the next step
    ahead: bool
    k_max: int

    def tokens(self, k: int) -> float:
        """Committed by a round that drafts k."""
        return (1 - self.alpha ** (k + 1)) / (1 - self.alpha)

    def seconds(self, k: int) -> float:
        """That round's time."""
        rtt = self.fixed + self.c * (k + 1)
        if not self.ahead:
            return self.device + max(0.0, k * self.t_draft - self.hidden) + rtt
        hit = self.alpha ** (k + 1)
        if rtt < (self.k_max + 1) * self.t_draft:  # still drafting ahead when the verdict comes
            rtt += self.t_draft / 2
        return (self.device + rtt + hit * max(0.0, (k + 1) * self.t_draft - rtt - self.hidden)
                + (1 - hit) * max(0.0, k * self.t_draft - self.hidden))

    def answer_now(self, k: int, ready: int, busy: bool) -> bool:
        """Whether a verdict answered at once with the `ready` tokens drafted (0: the server's token alone) commits
        more a second than a draft of k drafted to the end first, which also misses the batching window the verdict's
        step opened: each round costs the device and the server their fixed time, whatever it carries. A token the
        drafter is `busy` on counts as half drafted either way: finishing it is half a token's drafting, and answered
        at once it is half of the next draft's."""
        if ready >= k:
            return True
        part = 0.5 if busy else 0.0
        now = self.tokens(ready + part) / (self.device + self.fixed + self.c * (ready + 1))
        finished = self.tokens(k) / (self.device + self.fixed + self.c * (k + 1) + self.late
                                     + max(0.0, (k - ready - part) * self.t_draft - self.hidden))
        return now >= finished


class AdaptiveDraftLength:
    # The confidence counts fade by this much a round (about 200 rounds of memory); a bin is used once the tokens
    # seen in all bins together reach CALIBRATION_MIN, each bin pulled toward its own confidence by PRIOR_WEIGHT.
    CALIBRATION_FADE = 0.995
    CALIBRATION_MIN = 16.0
    PRIOR_WEIGHT = 2.0
    # The server queues this device's drafts when at least this share of its last QUEUED_WINDOW rounds (QUEUED_MIN at
    # least) waited through an earlier step: drafting on then costs the round no time until the wait is used up.
    QUEUED_SHARE = 0.5
    QUEUED_MIN = 4
    QUEUED_WINDOW = 8
    HIDE_QUEUE = True  # the model counts the queue wait as hiding the drafting done after a verdict

    WINDOW = 16  # the recent rounds K is chosen from

    def __init__(self, k_max: int = 8, k_min: int = 1, k_initial: int = 4, ahead: bool = False,
                 max_age_s: float = 120.0, clock: Callable[[], float] = time.monotonic, confidence_stop: bool = False):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_max, self.k_min, self.ahead = k_max, k_min, ahead
        self.k = min(max(k_initial, k_min), k_max)
        self.samples: deque[RoundSample] = deque(maxlen=self.WINDOW)
        self.max_age_s, self.clock = max_age_s, clock
        self.last_observed: float | None = None
        self.confidence_stop = confidence_stop
        self.seen = [0.0] * (len(CONFIDENCE_EDGES) + 1)  # tokens drafted at each confidence, their prefix accepted
        self.hit = [0.0] * (len(CONFIDENCE_EDGES) + 1)  # of those, accepted
        self.threshold = 0.0  # DraftStop's: a token's marginal cost over the time one committed token costs
        self.keep = 0.0  # the same for a token already drafted: its share of the step alone
        self.alpha = 1.0  # the acceptance the thresholds were set at
        self.server_max: int | None = None  # the bound on K the last server opened with: a bound is news once
        self.cost: RoundCost | None = None  # the last choice's model of a round, None until two rounds are seen

    @classmethod
    def for_device(cls, max_draft_tokens: int, ahead: bool, confidence_stop: bool = False) -> AdaptiveDraftLength:
        """A device's new controller: K starts at its bound (optimistic: a poor drafter is cut back after two
        rounds)."""
        k = max(max_draft_tokens, 1)
        return cls(k_max=k, k_initial=k, ahead=ahead, confidence_stop=confidence_stop)

    def configure(self, k_max: int, ahead: bool, k_min: int = 1) -> None:
        """A new request's bounds and mode (a session's own floor, its verification rule's, is set again at its
        open: at_least); what was learned stays, unless the device has been idle for longer than max_age_s: the
        server's load and round trip may have changed since, so the samples are dropped (the last K stays as the
        first guess)."""
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_max, self.k_min, self.ahead = k_max, k_min, ahead
        self.k = min(max(self.k, self.k_min), k_max)
        if self.last_observed is not None and self.clock() - self.last_observed > self.max_age_s:
            self.samples.clear()
            self.cost = None

    def cap(self, server_max: int) -> bool:
        news = server_max < self.k_max and server_max != self.server_max
        self.server_max = server_max
        self.k_max = min(self.k_max, server_max)
        self.k_min = min(self.k_min, self.k_max)
        self.k = min(self.k, self.k_max)
        return news

    def at_least(self, k: int) -> None:
        self.k_min = max(self.k_min, min(k, self.k_max))
        self.k = max(self.k, self.k_min)

    def empty_after_miss(self, threshold: float) -> bool:
        return self.acceptance() >= threshold

    def answers_at_once(self, k: int, ready: int, busy: bool) -> bool:
        """Whether a verdict goes out at once with the `ready` tokens drafted rather than after drafting to k
        (RoundCost.answer_now); at once until two rounds are seen."""
        return self.cost is None or self.cost.answer_now(k, ready, busy)

    def observe(self, sample: RoundSample) -> None:
        if sample.drafted > 0:
            self.samples.append(sample)
            self.last_observed = self.clock()
            self.learn_confidence(sample)
            self.k = self.choose()

    def learn_confidence(self, sample: RoundSample) -> None:
        """Count the drafted tokens whose prefix was accepted (the first rejected one included) by confidence."""
        if not sample.confidence:
            return
        self.seen = [n * self.CALIBRATION_FADE for n in self.seen]
        self.hit = [n * self.CALIBRATION_FADE for n in self.hit]
        for i, confidence in enumerate(sample.confidence[:min(sample.accepted + 1, sample.drafted)]):
            b = confidence_bin(confidence)
            self.seen[b] += 1.0
            self.hit[b] += 1.0 if i < sample.accepted else 0.0

    def accept_chance(self, confidence: float) -> float:
        """How often a token drafted at this confidence is accepted, given that the tokens before it were."""
        b = confidence_bin(confidence)
        return (self.hit[b] + self.PRIOR_WEIGHT * confidence) / (self.seen[b] + self.PRIOR_WEIGHT)

    def stop_rule(self) -> DraftStop | None:
        """This round's rule for stopping a draft before K, or None (off, or too little learned yet)."""
        if not self.confidence_stop or self.threshold <= 0 or sum(self.seen) < self.CALIBRATION_MIN:
            return None
        return DraftStop(self.accept_chance, self.threshold, self.keep, self.alpha)

    def server_queues(self) -> bool:
        """Whether most recent drafts reached the server while another step ran and waited for it (Verdict.queue_ms):
        a draft sent sooner would only have waited longer, so answering a verdict at once with a shorter draft
        gains nothing there. Only the drafts that went out at once count (RoundSample.prompt): a device that
        finishes its drafts sends them after the batching window its verdict's step opens, and they wait for that
        step whatever the server's load; counted, they held a device at finishing first once most of its drafts
        had queued (bench/sim_rounds.py, devices started out of step). While it finishes first, its drafts that
        went out at once leave the recent rounds (the last `window`), and with fewer than QUEUED_MIN of them left it
        answers at once again, which tells it afresh whether such drafts queue."""
        recent = [s for s in self.samples if s.prompt][-self.QUEUED_WINDOW:]
        return (len(recent) >= self.QUEUED_MIN
                and sum(1 for s in recent if s.queue_s > 0) >= self.QUEUED_SHARE * len(recent))

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
        # Steps a round trip waits through: its own, and the time it queued for it in units of a step (the steps
        # before it, which every other device's K lengthens as much).
        spans = sum(1.0 + (s.queue_s / s.step_s if s.step_s > 0 else 0.0) for s in self.samples) / len(self.samples)
        c = spans * sessions * sum(s.server_token_s for s in self.samples) / len(self.samples)
        fixed = max(0.0, sum(s.rtt_s - c * (s.drafted + 1) for s in self.samples) / len(self.samples))
        # The device's drafting after a verdict delays its next draft, but where drafts wait at the server through
        # an earlier step anyway, only by what outlasts that wait: the round trip measured includes the wait.
        hidden = sum(s.queue_s for s in self.samples) / len(self.samples) if self.HIDE_QUEUE else 0.0
        devices = [s.device_s for s in self.samples if s.device_s is not None]
        stepped = [s.step_s for s in self.samples if s.step_s > 0]
        # A draft that misses the batching window its verdict's step opens waits for the step the others are in.
        late = (sum(stepped) / len(stepped)) * (1.0 - 1.0 / sessions) if stepped else 0.0
        self.cost = cost = RoundCost(alpha, t_draft, c, fixed, sum(devices) / len(devices) if devices else 0.0,
                                     hidden, late, self.ahead, self.k_max)
        tokens, seconds = cost.tokens, cost.seconds
        k = max(range(self.k_min, self.k_max + 1), key=lambda k: tokens(k) / seconds(k))
        # The stop rule's thresholds: what one more token adds to the round's time (its share of the step, and its
        # drafting where it is not drafted yet) over what one committed token costs at this K. A drafted token goes
        # out while P(it and all before it accepted) is at least its threshold; another is drafted while that
        # chance times the average acceptance is. With every token at the average alpha and a round's time linear
        # in k (waiting), drafting ends at about this K: at the best K, alpha^(K+1) is under the threshold and
        # alpha^K over it. Drafting ahead makes the round's time anything but linear in k (drafting is hidden up to
        # the round trip, then not), so the marginal price can exceed alpha^K, even alpha^1, and end every draft
        # early. So the threshold is capped at alpha^(K+1/2): a draft of average tokens reaches the chosen K, and
        # confidence only ends the drafts whose own tokens are worse.
        # A token already drafted is kept at its step share alone: ending a draft before a token that is drafted
        # anyway (drafted ahead, or drafted to read its confidence) does not spare its drafting, only delays it
        # to the next round, which then drafts it again.
        rate = tokens(k) / seconds(k)
        # The average token's chance in the rule's own terms (the confidence counts, not the recent rounds' alpha:
        # the two can differ by more than a token's worth of slack, and then average drafts end early).
        self.alpha = sum(self.hit) / sum(self.seen) if sum(self.seen) > 0 else alpha
        self.threshold = min((c + t_draft) * rate, self.alpha ** (k + 1))
        self.keep = min(c * rate, self.threshold)
        return k
