"""The device's round through its public interface: RoundRules' decisions in counts, and Round played with a table
drafter against a verdict the test writes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from edge_client.adaptive import AdaptiveDraftLength, RoundSample
from edge_client.codec import Verdict
from edge_client.policy import DraftPolicy, FixedDraftLength
from edge_client.result import GenerationResult
from edge_client.round import Round, RoundHooks, RoundRules
from edge_client.sampling import SamplingParams
from tests.edge_client.test_draft_ahead import EOS, PROMPT, TableDrafter, cycle, greedy_chain


def adaptive(acceptance_rounds=0, queued=False, draft_token_s=0.02, device_s=0.0, sessions=1,
             step_s=0.01) -> AdaptiveDraftLength:
    """An adaptive controller that has seen `acceptance_rounds` rounds of 4 tokens all accepted (acceptance near 1),
    each queued at the server when `queued` and sent at once: a round trip of 15 ms and 1 ms a token of the step
    (each session's), drafting at `draft_token_s` a token, the device's own time `device_s` a round."""
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
    for _ in range(acceptance_rounds):
        ctrl.observe(RoundSample(4, 4, 0.01, 0.015 + sessions * 0.001 * 5, 0.001, draft_token_s, sessions,
                                 step_s=step_s, queue_s=0.005 if queued else 0.0, device_s=device_s))
    return ctrl


def test_a_hit_answered_at_once_goes_out_with_what_was_drafted_ahead_k_at_most():
    rules = RoundRules(DraftPolicy(), adaptive())
    assert rules.verdict_came()
    assert rules.answer(4, hit=True, ahead=2, busy=True) == 2
    assert rules.answer(4, hit=True, ahead=7, busy=False) == 4
    assert rules.answer(4, hit=True, ahead=0, busy=True) is None  # nothing past the bonus: draft the rest first


def test_a_miss_goes_out_empty_only_while_the_drafter_is_busy_and_the_acceptance_is_high():
    strong = RoundRules(DraftPolicy(), adaptive(acceptance_rounds=8))
    assert strong.verdict_came()
    assert strong.answer(4, hit=False, ahead=0, busy=True) == 0
    assert strong.answer(4, hit=False, ahead=0, busy=False) is None
    fresh = RoundRules(DraftPolicy(), adaptive())  # no rounds seen: acceptance 0.5, under the threshold
    fresh.verdict_came()
    assert fresh.answer(4, hit=False, ahead=0, busy=True) is None
    never = RoundRules(DraftPolicy(empty_after_miss=None), adaptive(acceptance_rounds=8))
    never.verdict_came()
    assert never.answer(4, hit=False, ahead=0, busy=True) is None


def test_a_verdict_waits_for_the_rest_of_k_where_a_round_costs_more_than_answering_at_once_gains():
    """Drafting at 5 ms a token, with the device's own 10 ms and the server's 15 ms in every round: a hit answered
    at once with one token drafted ahead commits about 2 tokens in a round of 27 ms, where drafting the other 3 of
    K = 4 first commits about 4.85 in 45 ms; a miss answered with an empty draft commits 1 in 26 ms. So both wait for
    the rest of K. Beside 7 more sessions in 50 ms steps, a draft finished first misses the batching window its
    verdict's step opens and waits most of a step for the next: then answering at once pays again."""
    alone = RoundRules(DraftPolicy(), adaptive(acceptance_rounds=8, draft_token_s=0.005, device_s=0.01))
    assert alone.verdict_came()
    assert alone.answer(4, hit=True, ahead=1, busy=True) is None
    assert alone.answer(4, hit=False, ahead=0, busy=True) is None
    assert alone.answer(4, hit=True, ahead=4, busy=True) == 4  # nothing left to draft: out at once
    shared = RoundRules(DraftPolicy(), adaptive(acceptance_rounds=8, draft_token_s=0.005, device_s=0.01, sessions=8,
                                                step_s=0.05))
    assert shared.verdict_came()
    assert shared.answer(4, hit=True, ahead=1, busy=True) == 1
    slow = RoundRules(DraftPolicy(), adaptive(acceptance_rounds=8, draft_token_s=0.03, device_s=0.01))
    assert slow.verdict_came()  # drafting at 30 ms a token, alone: the rest of K costs more than a round
    assert slow.answer(4, hit=True, ahead=1, busy=True) == 1 and slow.answer(4, hit=False, ahead=0, busy=True) == 0


@pytest.mark.parametrize("rules", [
    RoundRules(DraftPolicy(answer_at_once=False), adaptive(acceptance_rounds=8)),
    RoundRules(DraftPolicy(adaptive=False), FixedDraftLength(4)),
    RoundRules(DraftPolicy(), adaptive(acceptance_rounds=8, queued=True)),
], ids=["answer-at-once-off", "fixed-k", "server-queues"])
def test_no_verdict_is_answered_at_once_where_the_policy_or_the_server_says_not(rules):
    rules.verdict_came()  # a fixed K takes the verdict at once too, but finishes its token before it drafts
    assert rules.answer(4, hit=True, ahead=3, busy=True) is None
    assert rules.answer(4, hit=False, ahead=0, busy=True) is None


def test_the_draft_and_the_drafting_ahead_stop_at_the_request_end():
    rules = RoundRules(DraftPolicy(), adaptive())
    assert rules.draft_length(10) == 4
    assert rules.draft_length(3) == 2  # the verdict's own token is the third
    assert rules.draft_length(1) == 0
    assert rules.ahead_limit(20) == 9  # the next draft of at most 8, and its bonus guess first
    assert rules.ahead_limit(3) == 3
    assert RoundRules(DraftPolicy(draft_ahead=False), adaptive()).ahead_limit(20) == 0


class Held(RoundHooks):
    """Holds the drafting thread before its third token drafted ahead (the bonus guess and one past it drafted) until
    the verdict is in, and then on that token until the next draft is about to go out: the verdict is answered while
    the drafter is still on it, however the threads are scheduled. Records what goes out at once."""

    def __init__(self):
        self.reached, self.answered = threading.Event(), threading.Event()
        self.sent: list[bool] = []

    def ahead_token(self, n, arrived):
        if n == 3:
            self.reached.set()
            arrived.wait(30)
            self.answered.wait(30)

    def sending(self, at_once):
        self.sent.append(at_once)
        if len(self.sent) == 2:
            self.answered.set()


def test_a_round_played_by_hand_carries_a_hit_into_the_next_draft_and_commits_the_target_text():
    """Two rounds driven through Round.play with verdicts the test writes: the drafter (its argmax after t is
    succ[t]) is the target; the first verdict, held until the drafter has drafted two tokens ahead, accepts
    the whole draft with the drafter's own next token, so the second draft goes out at once with the token drafted
    ahead past that bonus (K = 2, one token ahead: 1 token, as RoundRules.answer says)."""
    chain = greedy_chain(cycle(1, 2, 3, 1), 12)

    async def main():
        drafter = TableDrafter(cycle(1, 2, 3, 1))
        drafter.begin(PROMPT, SamplingParams())
        hooks, result = Held(), GenerationResult(prompt_token_ids=list(PROMPT))
        ctrl = AdaptiveDraftLength(k_max=2, k_initial=2, ahead=True)
        rnd = Round(drafter, RoundRules(DraftPolicy(draft_tokens=2, max_draft_tokens=2), ctrl), PROMPT, result,
                    max_tokens=12, stop_ids=frozenset({EOS}), hooks=hooks)
        drafts = []

        async def send(proposal):
            drafts.append(list(proposal.token_ids))
            if len(drafts) == 1:
                await asyncio.get_running_loop().run_in_executor(None, hooks.reached.wait, 30)
            n = len(result.token_ids)
            return Verdict(len(drafts) - 1, len(proposal.token_ids), chain[n + len(proposal.token_ids)], False, None)

        for _ in range(2):
            verdict, committed = await rnd.play(send)
            result.token_ids.extend(committed)
            rnd.commit(committed)
        await rnd.settle()
        return rnd, result, drafts, hooks

    rnd, result, drafts, hooks = asyncio.run(main())
    assert drafts[0] == chain[:2]
    assert drafts[1] == chain[3:4]  # the token drafted ahead past the bonus, out at once
    assert hooks.sent == [False, True]
    assert result.answered_at_once == 1 and result.rounds == 2
    assert rnd.context == PROMPT + chain[:5]


def test_a_round_times_its_drafting_beside_the_verification_apart_from_the_drafting_before_it_goes_out():
    """RoundSample.ahead_token_s and alone_token_s: on a clock that only the drafter moves, 20 ms a token it evaluates
    while a draft is verified and 5 ms before one goes out (a device sharing the server's machine drafts slower
    beside its step), each round reports the two paces apart; the pace over all its drafting lies between. Each
    verdict comes once the drafting ahead is done (the drafter is never caught mid-token, whatever the threads'
    order) and misses the draft's last token, so the next draft is drafted afresh before it goes out."""
    chain = greedy_chain(cycle(1, 2, 3, 1), 16)

    class Clock(RoundHooks):
        def __init__(self):
            self.now, self.ahead, self.ended = 0.0, False, threading.Event()

        def clock(self):
            return self.now

        def ahead_begins(self):
            self.ahead = True

        def ahead_ends(self):
            self.ahead = False
            self.ended.set()

    hooks = Clock()

    class Clocked(TableDrafter):
        def _eval(self, tokens):
            hooks.now += (0.02 if hooks.ahead else 0.005) * len(tokens)
            return super()._eval(tokens)

    class Recorded(FixedDraftLength):
        def __init__(self, k):
            super().__init__(k)
            self.samples: list[RoundSample] = []

        def observe(self, sample):
            self.samples.append(sample)

    async def main():
        drafter = Clocked(cycle(1, 2, 3, 1))
        drafter.begin(PROMPT, SamplingParams())
        result = GenerationResult(prompt_token_ids=list(PROMPT))
        ctrl = Recorded(3)
        rnd = Round(drafter, RoundRules(DraftPolicy(draft_tokens=3, adaptive=False), ctrl), PROMPT, result,
                    max_tokens=16, stop_ids=frozenset({EOS}), hooks=hooks)

        async def send(proposal):
            hooks.ended.clear()  # the last round's drafting ahead ended before this draft went out
            await asyncio.get_running_loop().run_in_executor(None, hooks.ended.wait, 30)
            # the target's token at the missed one is the drafter's own: the text stays the target's
            n, k = len(result.token_ids), len(proposal.token_ids)
            return Verdict(0, k - 1, chain[n + k - 1], False, None)

        for _ in range(3):
            verdict, committed = await rnd.play(send)
            result.token_ids.extend(committed)
            rnd.commit(committed)
        await rnd.settle()
        return ctrl.samples

    samples = asyncio.run(main())
    assert len(samples) == 3
    for s in samples[1:]:  # the first round's drafting before it went out also read the prompt
        assert s.ahead_token_s == pytest.approx(0.02) and s.alone_token_s == pytest.approx(0.005)
        assert s.alone_token_s < s.draft_token_s < s.ahead_token_s
