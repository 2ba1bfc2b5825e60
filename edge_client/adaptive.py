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
best, and adaptive stayed near K 7.8: no measurable effect there.

A round trip at a busy server spans more than its own step: the draft first waits through the steps before it
(the server reports that wait, Verdict.queue_ms, from the draft's arrival to the end of the step before its own),
and every other device's K lengthens those steps as much. So c is multiplied by the round trip's steps: one plus
the queue wait in units of the step (at a saturated server two groups of sessions take turns, and a round trip is
about two steps). Counted as fixed (the earlier form), that half of the round trip kept drafts near 6 tokens at 32
devices where the whole system commits the most at K = 2: the system benchmark (3dc934c, a slow day) found adaptive
at 0.81x the best fixed K by median runs, 0.84x by its pass-paired median; sim_rounds 0.91-0.94x; with the wait
counted, 1.01x there (tests/test_sim_rounds.py).

With drafting ahead (the device drafts on while its draft is verified), a round that is accepted whole with the
bonus token the drafter guessed (probability about alpha^(k+1)) leaves the next draft made during the round
trip, so only max(0, (k+1) * t_draft - rtt) of drafting is left before it goes out; any other round drafts all k
after the verdict. Drafting ahead thus favours drafts short enough to be ready within one round trip, but not
shorter than that by much: a verdict that comes while a token is being drafted ahead waits for that token (half a
token on average), which a draft long enough to keep the drafter busy anyway does not notice (tests/test_sim_rounds.py:
without it, one device at a launch-bound server chose 2-3 tokens, under 0.9x the best fixed K).
The device no longer waits in either way (edge_client/generation.py): it answers a verdict at once with what was
drafted ahead, K at most, after a hit (after a miss it drafts K afresh). K is then the cap of the drafts, which are otherwise as long as
the drafting during the round trip made them; the model above still prices the waits, and was not redone for it.

Where the server queues the drafts (most recent ones sent at once waited through an earlier step: `server_queues`),
the device's drafting after a verdict delays its next draft only by what outlasts that wait: sent sooner, the draft
would have waited as much longer. The model takes the mean wait off that drafting (HIDE_QUEUE), and the device then
finishes its token and drafts the rest of K rather than answering at once. On the emulated GPU step profile (a server
padded to 14 ms + 0.1 ms a token, 32 devices drafting at 11.8 ms/token: the two sections '32 devices, a GPU's step
profile emulated on this CPU' of docs/benchmarks.md) adaptive went from 0.94x the best fixed K (K = 4) to 0.98x in
each of 3 passes, its drafts from 2.7 tokens to 3.9 (at 8.3 ms/token: 0.99x, the third such section). On
this CPU server, where the steps' cost grows with their tokens, the main section's rerun after it (at c209104) gave
1.01x, 1.08x, 0.98x and 1.01x the best fixed K at 1, 4, 16 and 32 devices (1.01x, 1.07x, 0.96x, 0.98x before), and
the next (at dad8f34) 1.01x, 1.06x, 0.99x and 1.02x.

A device keeps one controller across its requests (`generate(..., controller=)`): acceptance, drafting time and
round trip describe the device, its drafter and the server, not one request. A fresh controller per request
guesses from its first two or three rounds every time; at a loaded server, where each round costs a long round
trip, those short guessed drafts cost 5-10% of system throughput in the benchmark at 16 devices.
After an idle spell longer than max_age_s (120 s) the next request measures afresh, starting from the last K.

Stopping on low confidence (in the spirit of llama.cpp's minimum draft probability, `--draft-p-min`): K is the most a
round drafts; within it, a draft ends at a token that is not worth it. A model drafter reports its confidence in each
token (its top-1 probability there). The controller learns, from the verdicts, how often a token of each confidence is
accepted once the tokens before it were (bins of confidence, counts that fade over about 200 rounds): the same
confidence means different odds for different drafters (a quantized copy of the target is accepted at 0.76 where it is
10-20% sure; a 2-bit one at 0.32). Two questions, each priced at the time one committed token costs at this K: whether
to draft another token (while the chance that the tokens so far are all accepted, times the average token's, is worth
its drafting and its share of the step), and whether a token already drafted goes out (while the chance that it and
every token before it are accepted is worth its share of the step alone: ending a draft before a token drafted anyway,
ahead or to read its confidence, does not spare its drafting, only moves it to the next round). The drafting price is
capped at the average token's chance to the power K + 1, so that a draft of average tokens always reaches the chosen K
and confidence only ends the drafts whose own tokens are worse (tests/edge_client/test_confidence_stop.py): drafting
ahead makes a round's time anything but linear in k, and priced at what one more token adds to a round on average, the
rule first ended drafts at 1.6 tokens at 4 devices in the system benchmark, 0.73x the best fixed K
(scripts/sim_rounds.py --confidence reproduces it: 0.82-0.86x; tests/test_sim_rounds.py). A fixed threshold cannot tell
drafters apart: llama.cpp's 0.75 cuts the Q4_1 drafter's drafts (K 8) to 1.6 tokens, accepted at 0.95 where 8 are
accepted at 0.82. `scripts/replay_confidence.py` replays the target's greedy outputs (16 chat prompts, 64 tokens; the
drafter's proposals and confidences recorded at every prefix) with each round's cost modelled (this machine's CPU
server: 6 ms a round + 3.5 ms a verified token; or device-bound: 30 ms + 16 ms a drafted token; waiting, not drafting
ahead). The time per committed token with the rule, against this controller without it: Q4_1 drafter 0.975x and 0.978x
(drafts of 5.1 tokens instead of 6.5, and 4.0 instead of 4.9), a 2-bit requantized one 0.972x and 0.995x; against the
best fixed K 0.985x, 1.000x, 0.966x, 0.997x. llama.cpp's 0.75 at K 8 (the token below it drafted, then dropped) costs
1.23x and 1.39x the rule's time with Q4_1, 0.99x and 1.28x with the 2-bit one. The first token is always drafted; a
drafter with no confidence (n-gram, replayed synthetic drafts) is never stopped.

The rule is off by default on a device (`confidence_stop=False`; the agent's `--confidence-stop` turns it on). In
scripts/bench_system.py on this 2-core machine at 32 devices (one pass per configuration, 8 s windows), the rule cut
the drafts the controller sized at K about 8 to a third of that, mostly tokens drafted ahead whose share of the step
the server's load priced above their chance, and the adaptive K fell further behind the best fixed K than with the
rule off (figures in commit 8a4ca57's message; the controller's samples and the rule-off run came from probes, not
commands in the repo). Its pricing charges a token cut from a draft its whole
share of the step, though a cut only defers that token (the next round drafts it again and sends it first): what a
cut saves is the tokens after it, and only where it is rejected, while every cut adds a round, whose step slot and
round-trip overheads the price leaves out. It stays an option until that pricing is redone.
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

    def __init__(self, k_max: int = 8, k_min: int = 1, k_initial: int = 4, window: int = 16, ahead: bool = False,
                 max_age_s: float = 120.0, clock: Callable[[], float] = time.monotonic, confidence_stop: bool = False):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_max, self.k_min, self.ahead = k_max, k_min, ahead
        self.k = min(max(k_initial, k_min), k_max)
        self.samples: deque[RoundSample] = deque(maxlen=window)
        self.max_age_s, self.clock = max_age_s, clock
        self.last_observed: float | None = None
        self.confidence_stop = confidence_stop
        self.seen = [0.0] * (len(CONFIDENCE_EDGES) + 1)  # tokens drafted at each confidence, their prefix accepted
        self.hit = [0.0] * (len(CONFIDENCE_EDGES) + 1)  # of those, accepted
        self.threshold = 0.0  # DraftStop's: a token's marginal cost over the time one committed token costs
        self.keep = 0.0  # the same for a token already drafted: its share of the step alone
        self.alpha = 1.0  # the acceptance the thresholds were set at

    @classmethod
    def for_device(cls, max_draft_tokens: int, ahead: bool, confidence_stop: bool = False) -> AdaptiveDraftLength:
        """A device's new controller: K starts at its bound (optimistic: a poor drafter is cut back after two
        rounds)."""
        k = max(max_draft_tokens, 1)
        return cls(k_max=k, k_initial=k, ahead=ahead, confidence_stop=confidence_stop)

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
        had queued (scripts/sim_rounds.py, devices started out of step). While it finishes first, its drafts that
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

        def tokens(k: int) -> float:  # committed by a round that drafts k
            return (1 - alpha ** (k + 1)) / (1 - alpha)

        def seconds(k: int) -> float:  # that round's time
            rtt = fixed + c * (k + 1)
            if not self.ahead:
                return max(0.0, k * t_draft - hidden) + rtt
            hit = alpha ** (k + 1)
            if rtt < (self.k_max + 1) * t_draft:  # still drafting ahead when the verdict comes
                rtt += t_draft / 2
            return (rtt + hit * max(0.0, (k + 1) * t_draft - rtt - hidden)
                    + (1 - hit) * max(0.0, k * t_draft - hidden))

        k = max(range(self.k_min, self.k_max + 1), key=lambda k: tokens(k) / seconds(k))
        # The stop rule's thresholds: what one more token adds to the round's time (its share of the step, and its
        # drafting where it is not drafted yet) over what one committed token costs at this K. A drafted token goes
        # out while P(it and all before it accepted) is at least its threshold; another is drafted while that
        # chance times the average acceptance is. With every token at the average alpha and a round's time linear
        # in k (waiting), drafting ends at about this K: at the best K, alpha^(K+1) is under the threshold and
        # alpha^K over it. Drafting ahead makes the round's time anything but linear in k (drafting is hidden up to
        # the round trip, then not), so the marginal price can exceed alpha^K, even alpha^1: priced so, the rule
        # ended the drafts at 1.6 tokens at 4 devices in the system benchmark (drafting at 24.5 ms/token) where the
        # controller chose 4-8, 0.73x the best fixed K. So the threshold is capped at alpha^(K+1/2): a draft of
        # average tokens reaches the chosen K, and confidence only ends the drafts whose own tokens are worse.
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
