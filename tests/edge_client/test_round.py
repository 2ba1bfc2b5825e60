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


def adaptive(acceptance_rounds=0, queued=False) -> AdaptiveDraftLength:
    """An adaptive controller that has seen `acceptance_rounds` rounds of 4 tokens all accepted (acceptance near 1),
    each queued at the server when `queued` and sent at once."""
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
    for _ in range(acceptance_rounds):
        ctrl.observe(RoundSample(4, 4, 0.01, 0.02, 0.001, 0.005, 1, step_s=0.01, queue_s=0.005 if queued else 0.0))
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
    the verdict is in, and records what goes out at once."""

    def __init__(self):
        self.reached = threading.Event()
        self.sent: list[bool] = []

    def ahead_token(self, n, arrived):
        if n == 3:
            self.reached.set()
            arrived.wait(30)

    def sending(self, at_once):
        self.sent.append(at_once)


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
