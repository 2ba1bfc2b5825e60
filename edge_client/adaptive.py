"""Adaptive draft length: each round, the K that maximizes expected committed tokens per second (in the spirit of
DSD's adaptive window).

With per-token acceptance alpha over the recent rounds, a round of k drafted tokens commits
(1 - alpha^(k+1)) / (1 - alpha) tokens on average and takes k * t_draft + rtt_fixed + c * (k + 1): t_draft is this
device's drafting time per token, c what one more token of K costs the step it rides in (the server's marginal token
cost times the sessions in the step, times the round trip's steps where the server queues the drafts). Drafting
ahead changes how much of the drafting the round trip hides. A device keeps one controller across its requests.

A device that has the server to itself also measures the model's way against the model's best K finished each round,
and plays what commits the most a second (DraftModes): the model leaves out costs that only the rounds' own time shows.

Optionally (confidence_stop) a draft ends within K at a token the drafter is too unsure of, priced against what one
committed token costs at this K (DraftStop). The model, its terms and the measurements behind them:
docs/device.md, "How long a draft is".
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace


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
    committed: int = 0  # tokens the verdict committed: the accepted ones and its own
    # the time from the verdict before to this one: the round as the device lives it, everything the model leaves out
    # included (None: a session's first round, or not measured)
    cycle_s: float | None = None
    # the drafter's time per token drafted while the draft was verified (beside the server's step, on a shared
    # machine) and per token drafted before it went out (None: none drafted so)
    ahead_token_s: float | None = None
    alone_token_s: float | None = None


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
    # the drafter's time per token while a draft is verified and before one goes out, where they differ (a device
    # sharing the server's machine drafts slower beside its step): None, t_draft
    t_ahead: float | None = None
    t_alone: float | None = None

    @property
    def ahead_s(self) -> float:
        return self.t_draft if self.t_ahead is None else self.t_ahead

    @property
    def alone_s(self) -> float:
        return self.t_draft if self.t_alone is None else self.t_alone

    def tokens(self, k: int) -> float:
        """Committed by a round that drafts k."""
        return (1 - self.alpha ** (k + 1)) / (1 - self.alpha)

    def seconds(self, k: int) -> float:
        """That round's time. Drafting ahead, the round trip covers the tokens drafted meanwhile (at the drafter's
        pace beside the step); the rest of the next draft is drafted after the verdict, at its pace alone."""
        rtt = self.fixed + self.c * (k + 1)
        alone, beside = self.alone_s, self.ahead_s
        if not self.ahead:
            return self.device + max(0.0, k * alone - self.hidden) + rtt
        hit = self.alpha ** (k + 1)
        if rtt < (self.k_max + 1) * beside:  # still drafting ahead when the verdict comes: that token is finished
            rtt += beside / 2
        drafted = min(rtt / beside, self.k_max + 1.0) if beside > 0 else self.k_max + 1.0
        return (self.device + rtt + hit * max(0.0, (k + 1 - drafted) * alone - self.hidden)
                + (1 - hit) * max(0.0, k * alone - self.hidden))

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
                                     + max(0.0, (k - ready - part) * self.alone_s - self.hidden))
        return now >= finished


class PositionAcceptance:
    """How often a draft's token at each position is accepted, given that the tokens before it were: counted over the
    recent rounds of every mode, fading by FADE a round (about 200 rounds of memory). What a round of d drafted tokens
    commits on this average text (`committed`) prices a trial's rounds by their drafts, not by the stretch of text they
    happened to meet."""

    FADE = 0.995
    PRIOR_WEIGHT = 2.0  # each position pulled toward the average acceptance by this many tokens
    MIN_TOKENS = 16.0  # tokens seen, all positions together, before it prices a round

    def __init__(self):
        self.seen: list[float] = []  # tokens drafted at each position whose prefix was accepted
        self.hit: list[float] = []  # of those, accepted

    def observe(self, drafted: int, accepted: int) -> None:
        self.seen = [n * self.FADE for n in self.seen]
        self.hit = [n * self.FADE for n in self.hit]
        while len(self.seen) < drafted:
            self.seen.append(0.0)
            self.hit.append(0.0)
        for j in range(min(accepted + 1, drafted)):
            self.seen[j] += 1.0
            self.hit[j] += 1.0 if j < accepted else 0.0

    def chances(self, drafted: int) -> list[float]:
        """P(the token at each position up to `drafted`, from 0, is accepted | those before it were)."""
        mean = (sum(self.hit) + 0.5) / (sum(self.seen) + 1.0)  # what a position not seen yet is taken at
        return [(self.hit[j] + self.PRIOR_WEIGHT * mean) / (self.seen[j] + self.PRIOR_WEIGHT)
                if j < len(self.seen) else mean for j in range(drafted)]

    def committed(self, drafted: int) -> float | None:
        """What a round of `drafted` tokens commits on average (its accepted tokens and the verdict's own), or None
        while too little is seen."""
        if sum(self.seen) < self.MIN_TOKENS:
            return None
        total, reach = 1.0, 1.0
        for p in self.chances(drafted):
            reach *= p
            total += reach
        return total


# DraftModes' two ways of drafting: K chosen each round by RoundCost with verdicts answered at once where it pays, and
# the K that RoundCost rates fastest for a round drafted to its end before it goes out.
MODEL = "model"
FINISHED = "finished"


class DraftModes:
    """Which way of drafting the controller plays, chosen by what each one measures: the model's way (MODEL) against
    the model's best K finished before each draft goes out (FINISHED). The model prices a round by its parts; a round
    also costs what only its own time shows (a shared machine's cores and memory slowing the drafting while the server
    steps, the device's Python), and answering at once borrows the next round's drafting. Where the device drafts far
    slower than the server verifies, answering at once is what keeps the server from waiting on it.

    So the two are compared in trials (TRIAL_TOKENS committed tokens, TRIAL_ROUNDS rounds at least), measured in
    committed tokens a second from verdict to verdict, after one trial that only warms up. Where the controller knows
    what each round's draft commits on the recent text of every mode (PositionAcceptance), a trial's tokens are counted
    so, not as the text it met let them be accepted. The text moves a trial's rate more than the mode does (an easy
    prompt, then a hard one), so the challenger is played between two trials of the reference (at first FINISHED, so
    that a tie keeps it; then the mode being played) and scored against their mean: both see the same stretch of text.
    One hard stretch (a new prompt's opening, a passage the drafter misses) can sink one reference trial and lift the
    challenger beside it, so a challenger that scores above 1 + SWITCH_MARGIN is played again between two fresh trials
    of the reference and takes over only where that second score is above it too. The winner is played for a spell,
    after which the other is tried again; the spell doubles while the same mode wins. The warm-up trial is the model's
    way, played before the trials anyway."""

    TRIAL_TOKENS = 16
    TRIAL_ROUNDS = 3
    FIRST_SPELL = 256  # committed tokens
    # A challenger's lead over its reference that counts: a trial's rate moves by far more than the modes differ, and
    # a wrong switch costs a whole spell.
    SWITCH_MARGIN = 0.05

    def __init__(self, try_finished: bool = True, rated: Callable[[], bool] = lambda: False):
        self.try_finished = try_finished  # False: the model's way alone
        self.rated = rated  # whether the controller has a model to choose the finished K by
        self.rate: dict[str, float] = {}  # each mode's committed tokens a second, as last measured
        self.score: dict[str, float] = {}  # this set of trials' challenger, over its reference's trials
        self.best: str | None = None  # the mode played for a spell, None during trials
        self.last_best: str | None = None  # the last winner
        self.spell = self.FIRST_SPELL
        self.tokens, self.seconds, self.rounds = 0, 0.0, 0  # the current trial's or spell's
        self.priced = 0.0  # its tokens as its drafts commit on average, where known (else as committed)
        self.reference = MODEL  # a set of trials': the other mode, the challenger, is scored against it
        self.waiting: str | None = None  # the challenger just measured, scored once the reference is again
        self.confirming = False  # whether the challenger won its trial and is being played again
        self.before = 0.0  # the reference's last trial rate
        # the model's way until the first round is counted (a model of the device that times none plays it alone)
        self.mode, self.started = MODEL, False
        self.warming = True  # the first trial only warms up: a fresh drafter, session and text measure slow
        self.settling = False  # whether the next round is the first in a new mode (not counted)

    @property
    def challenger(self) -> str:
        return FINISHED if self.reference == MODEL else MODEL

    def trials(self, reference: str) -> None:
        """Start a set of trials: the reference, then the other mode, then the reference again."""
        self.reference, self.score = reference, {}
        self.waiting, self.confirming, self.before = None, False, 0.0
        self.mode, self.best = reference, None

    def count(self, committed: int, cycle_s: float, expected: float | None = None) -> None:
        """A round played in the current mode: its tokens, its time and what its draft commits on average (None:
        not known). The first round after the mode changes is not counted: its draft was drafted ahead under the
        mode before (the model's way then sends at once what a long K drafted ahead, a round faster than its own)."""
        if self.settling:
            self.settling = False
            return
        mode = self.mode
        self._count(committed, cycle_s, committed if expected is None else expected)
        self.settling = self.mode != mode

    def _count(self, committed: int, cycle_s: float, expected: float) -> None:
        if not self.try_finished:  # the model's way alone
            return
        if not self.started:  # the first measured round: the trials begin, the warm-up trial the model's way
            self.started = True
            self.trials(MODEL)
            return
        self.tokens, self.seconds, self.rounds = self.tokens + committed, self.seconds + cycle_s, self.rounds + 1
        self.priced += expected
        goal = self.spell if self.best is not None else self.TRIAL_TOKENS
        if self.tokens < goal or self.rounds < self.TRIAL_ROUNDS:
            return
        rate = self.priced / self.seconds if self.seconds > 0 else 0.0
        self.tokens, self.seconds, self.rounds, self.priced = 0, 0.0, 0, 0.0
        if self.warming:  # the trials proper start with the reference: the finished K, where the model rates one
            self.warming = False
            self.trials(FINISHED if self.rated() else MODEL)
            return
        self.rate[self.mode] = rate
        if self.best is not None:  # the spell is over: the other mode is tried against it
            self.trials(self.best)
            return
        if self.mode != self.reference:  # the challenger: the reference again, to score it against both
            self.waiting, self.mode = self.mode, self.reference
            return
        if self.waiting is not None:
            self.score[self.waiting] = self.rate[self.waiting] / max((self.before + rate) / 2, 1e-9)
            self.waiting = None
        self.before = rate
        won = self.score.get(self.challenger, 0.0) > 1 + self.SWITCH_MARGIN
        if won and not self.confirming:  # played again beside a fresh reference trial: this one may have sunk
            self.confirming, self.score = True, {}
            return
        if not self.score:
            self.mode = self.challenger
            return
        best = self.challenger if won else self.reference  # won twice, or the reference stays
        self.spell = self.spell * 2 if best == self.last_best else self.FIRST_SPELL
        self.last_best = self.best = self.mode = best


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
    TRY_FINISHED = True  # whether finished drafts are tried against the model's way (DraftModes)
    # A device whose recent steps held this many sessions on average shares the server: it plays the model's way, which
    # prices what its draft costs the others in the step (c x sessions); its own measured rate would not (a longer
    # draft can gain it tokens a second that the others lose, waiting for a longer step).
    SHARED_SESSIONS = 1.5

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
        self.modes = self.new_modes()  # the model's way or finished drafts, by what each measures
        self.positions = PositionAcceptance()  # what a draft commits on the recent text, whichever mode drafted it
        self.model_k = self.k  # the model's last choice
        self.shared = False  # whether the server's recent steps held other sessions too (SHARED_SESSIONS)

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
        if self.last_observed is not None and self.clock() - self.last_observed > self.max_age_s:
            self.samples.clear()
            self.cost = None
            self.modes = self.new_modes()
            self.positions = PositionAcceptance()
        self.model_k = min(max(self.model_k, self.k_min), k_max)
        self.k = self.played(self.model_k)

    def cap(self, server_max: int) -> bool:
        news = server_max < self.k_max and server_max != self.server_max
        self.server_max = server_max
        self.k_max = min(self.k_max, server_max)
        self.k_min = min(self.k_min, self.k_max)
        self.model_k = min(self.model_k, self.k_max)
        self.k = self.played(self.model_k)
        return news

    def at_least(self, k: int) -> None:
        self.k_min = max(self.k_min, min(k, self.k_max))
        self.model_k = max(self.model_k, self.k_min)
        self.k = self.played(self.model_k)

    def new_modes(self) -> DraftModes:
        return DraftModes(self.TRY_FINISHED, lambda: self.cost is not None)

    @property
    def model_played(self) -> bool:
        """Whether the model's way is played now, not finished drafts (DraftModes; always while the server is
        shared)."""
        return self.shared or self.modes.mode == MODEL

    @property
    def ahead_k(self) -> int:
        """The longest next draft that drafting ahead prepares: K_max in the model's way (it may answer with any K up
        to it), the K played where drafts are finished, which drafts no more than a fixed K's device would (drafting
        past it is thrown away, and takes the machine from the server's step where the two share it)."""
        return self.k_max if self.model_played else self.k

    @property
    def first_k(self) -> int:
        """A generation's first draft: drafted while the session opens, with no draft ahead before it and no verdict
        to answer, so the model's way prices it as a round drafted whole before it goes out (the K played otherwise)."""
        if not self.model_played or self.cost is None:
            return self.k
        return self.best_k(replace(self.cost, ahead=False, hidden=0.0, late=0.0))

    def finished_k(self) -> int:
        """The K whose round, drafted to its end before it goes out, commits the most a second in the model: drafting
        ahead then prepares no more than that K (its bonus guess and K past it). The model's K until it has a model."""
        if self.cost is None:
            return self.model_k
        return self.best_k(self.cost, finished=True)

    def best_k(self, cost: RoundCost, finished: bool = False) -> int:
        """The K whose round commits the most a second in `cost`, within the bounds; `finished`: drafting ahead no
        further than that K."""
        def rate(k: int) -> float:
            return cost.tokens(k) / (replace(cost, k_max=k) if finished else cost).seconds(k)
        return max(range(self.k_min, self.k_max + 1), key=rate)

    def played(self, k: int) -> int:
        """The K to draft: the model's `k`, or where drafts are finished, the model's best K for them."""
        return k if self.model_played else self.finished_k()

    def empty_after_miss(self, threshold: float) -> bool:
        return self.model_played and self.acceptance() >= threshold

    def answers_at_once(self, k: int, ready: int, busy: bool) -> bool:
        """Whether a verdict goes out at once with the `ready` tokens drafted rather than after drafting to k
        (RoundCost.answer_now); at once until two rounds are seen; never where drafts are finished."""
        return self.model_played and (self.cost is None or self.cost.answer_now(k, ready, busy))

    def observe(self, sample: RoundSample) -> None:
        played = self.modes  # the modes this round was played under
        expected = self.positions.committed(sample.drafted)  # priced by the rounds before it
        if sample.drafted > 0:
            self.positions.observe(sample.drafted, sample.accepted)
            self.samples.append(sample)
            shared = sum(max(s.step_sessions, 1) for s in self.samples) / len(self.samples) >= self.SHARED_SESSIONS
            if shared != self.shared:  # the trials start afresh whenever the device has the server to itself again
                self.shared, self.modes = shared, self.new_modes()
            self.last_observed = self.clock()
            self.learn_confidence(sample)
            self.model_k = self.choose()
        if sample.cycle_s is not None and not self.shared and self.modes is played and self.cost is not None:
            self.modes.count(sample.committed, sample.cycle_s, expected)
        self.k = self.played(self.model_k)

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
        """This round's rule for stopping a draft before K, or None (off, too little learned yet, or drafts
        finished)."""
        if (not self.confidence_stop or not self.model_played or self.threshold <= 0
                or sum(self.seen) < self.CALIBRATION_MIN):
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
            return self.model_k
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
        beside = [s.ahead_token_s for s in self.samples if s.ahead_token_s is not None]
        alone = [s.alone_token_s for s in self.samples if s.alone_token_s is not None]
        self.cost = cost = RoundCost(alpha, t_draft, c, fixed, sum(devices) / len(devices) if devices else 0.0,
                                     hidden, late, self.ahead, self.k_max,
                                     sum(beside) / len(beside) if beside else None,
                                     sum(alone) / len(alone) if alone else None)
        tokens, seconds = cost.tokens, cost.seconds
        k = self.best_k(cost)
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
        self.threshold = min((c + cost.alone_s) * rate, self.alpha ** (k + 1))
        self.keep = min(c * rate, self.threshold)
        return k
