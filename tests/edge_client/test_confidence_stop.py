"""The adaptive draft's stop rule: a draft ends before K at a token the drafter is too unsure of.

The drafter reports its confidence in each token; the controller learns from the verdicts how often tokens of each
confidence are accepted, and a round's DraftStop ends the draft once the chance that the next token and all before
it are accepted is worth less than drafting and verifying it. Ending drafts early must leave the output
distribution untouched, with drafting ahead too, where tokens already drafted are cut from the next draft.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edge_client.adaptive import AdaptiveDraftLength, DraftStop, RoundSample
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.sampling import SamplingParams
from tests.edge_client.test_draft_ahead import (MISSENT, PROMPT, TOKENIZER, FakeClient, Q, TableDrafter,
                                                assert_follows_p, cycle)


class Forced(AdaptiveDraftLength):
    """K fixed at k_max, and a stop rule from the start: a token's chance of acceptance taken to be its
    confidence, the draft ended once the product falls below `threshold`."""

    def __init__(self, threshold: float, **kw):
        super().__init__(**kw)
        self.forced = threshold
        self.rules: list[DraftStop] = []

    def choose(self) -> int:
        return self.k_max

    def stop_rule(self):
        self.rules.append(DraftStop(lambda c: c, self.forced))
        return self.rules[-1]


def test_the_kv_drafter_reports_its_top_probability_and_stops_where_told():
    drafter = TableDrafter(cycle(1, 2, 3, 0))  # each row: 0.7 on the next token, 0.1 elsewhere
    drafter.begin(PROMPT, SamplingParams())
    p = drafter.propose(PROMPT, 4)
    assert p.token_ids == [0, 1, 2, 3]
    assert p.confidence == pytest.approx([0.7] * 4, abs=1e-6)
    rule = DraftStop(lambda c: c, 0.4)  # 0.7, then 0.49, then 0.343 < 0.4: stop before the third
    p = drafter.propose(PROMPT, 4, rule)
    assert p.token_ids == [0, 1] and rule.taken == 2
    assert drafter._evaluated == PROMPT + [0, 1]  # the token it stopped before was never fed to the model
    sampled = TableDrafter(Q)
    sampled.begin(PROMPT, SamplingParams(temperature=1.0, seed=3))
    p = sampled.propose(PROMPT, 1)
    assert p.confidence == pytest.approx([Q[PROMPT[-1]].max()], abs=1e-6)


def test_the_rule_always_takes_the_first_token():
    rule = DraftStop(lambda c: 0.0, 0.5)
    assert rule.take(0.01) and not rule.take(0.99)
    unknown = DraftStop(lambda c: 0.0, 0.5)
    assert all(unknown.take(None) for _ in range(5))  # a drafter without confidence is never stopped


def rounds(ctrl, n, chance, rng, k_conf=(0.15, 0.9), server_token_s=0.0035):
    """n rounds of K tokens whose confidences alternate from k_conf; a token of confidence c is accepted with
    probability chance(c). Returns the controller's last rule."""
    for _ in range(n):
        k = ctrl.k
        conf = tuple(k_conf[i % len(k_conf)] for i in range(k))
        accepted = 0
        while accepted < k and rng.random() < chance(conf[accepted]):
            accepted += 1
        ctrl.observe(RoundSample(k, accepted, 0.0, 0.006 + server_token_s * (k + 1), server_token_s, confidence=conf))


def goes(rule: DraftStop, confidences) -> int:
    """How many of these tokens a draft under `rule` sends: more() before drafting each after the first, then
    take() with its confidence."""
    n = 0
    for confidence in confidences:
        if (n and not rule.more()) or not rule.take(confidence):
            break
        n += 1
    return n


def test_the_controller_learns_what_each_confidence_is_worth():
    """Two drafters, both 15% sure of every third token: one whose unsure tokens are rejected (a weak drafter), one
    whose unsure tokens are accepted all the same (a quantized copy of the target). At a server where a verified
    token costs about half a committed one, the first is stopped before an unsure token, the second is not."""
    rng = np.random.default_rng(0)
    weak = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=True)
    strong = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=True)
    order = (0.9, 0.9, 0.15, 0.9)
    rounds(weak, 60, lambda c: 0.2 if c < 0.5 else 0.97, rng, k_conf=order)
    rounds(strong, 60, lambda c: 0.97, rng, k_conf=order)
    assert weak.accept_chance(0.15) < 0.35 and strong.accept_chance(0.15) > 0.85
    assert weak.k >= 3 and strong.k >= 4  # K alone would draft past the unsure token
    w, s = weak.stop_rule(), strong.stop_rule()
    assert w is not None and s is not None
    assert goes(w, order) == 2
    assert goes(s, order) == 4


def test_no_rule_until_enough_is_learned_nor_when_switched_off():
    rng = np.random.default_rng(1)
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=True)
    assert ctrl.stop_rule() is None
    rounds(ctrl, 1, lambda c: 1.0, rng)
    assert ctrl.stop_rule() is None  # 8 tokens seen, under CALIBRATION_MIN
    rounds(ctrl, 3, lambda c: 1.0, rng)
    assert ctrl.stop_rule() is not None
    off = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=False)
    rounds(off, 10, lambda c: 1.0, rng)
    assert off.stop_rule() is None
    blind = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=True)
    for _ in range(10):
        blind.observe(RoundSample(8, 8, 0.0, 0.04, 0.0035))  # a drafter without confidence
    assert blind.stop_rule() is None


def simulate(confidence_stop: bool, chance, seed: int) -> float:
    """Server seconds per committed token (6 ms a round + 3.5 ms a verified token, this CPU server's shape) over
    600 rounds of a drafter whose tokens are 15% or 90% sure, at random."""
    rng = np.random.default_rng(seed)
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=8, confidence_stop=confidence_stop)
    cost = committed = 0.0
    for _ in range(600):
        rule, drafted, accepted, conf = ctrl.stop_rule(), 0, 0, []
        alive = True
        for _ in range(ctrl.k):
            c = 0.15 if rng.random() < 0.3 else 0.9
            if rule is not None and ((drafted and not rule.more()) or not rule.take(c)):
                break
            conf.append(c)
            drafted += 1
            alive = alive and rng.random() < chance(c)
            accepted += alive
        rtt = 0.006 + 0.0035 * (drafted + 1)
        ctrl.observe(RoundSample(drafted, accepted, 0.0, rtt, 0.0035, confidence=tuple(conf)))
        cost += rtt
        committed += accepted + 1
    return cost / committed


def test_stopping_on_confidence_saves_server_time_only_where_confidence_tells():
    """Where unsure tokens are mostly rejected, ending drafts at them costs less server time per committed token
    than the same controller drafting K; where they are accepted anyway, the rule leaves the drafts (near) alone."""
    weak = lambda c: 0.2 if c < 0.5 else 0.97  # noqa: E731
    strong = lambda c: 0.97  # noqa: E731
    on = np.median([simulate(True, weak, s) for s in range(5)])
    off = np.median([simulate(False, weak, s) for s in range(5)])
    assert on < 0.95 * off, (on, off)
    on = np.median([simulate(True, strong, s) for s in range(5)])
    off = np.median([simulate(False, strong, s) for s in range(5)])
    assert on < 1.02 * off, (on, off)


async def _sampled_runs(n: int, threshold: float):
    MISSENT.clear()
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64))
    controllers = []

    async def one(i):
        ctrl = Forced(threshold, k_max=3, k_initial=3, ahead=True)
        controllers.append(ctrl)
        asked = Request(PROMPT, 12, SamplingParams(temperature=1.0, seed=i),
                        DraftPolicy(draft_tokens=3, adaptive=True, max_draft_tokens=3, draft_ahead=True))
        return await generate(FakeClient(20_000 + i, 0.003), TableDrafter(), TOKENIZER, asked, controller=ctrl)

    results = []
    for start in range(0, n, 200):
        results += await asyncio.gather(*[one(i) for i in range(start, min(n, start + 200))])
    return results, controllers


def test_drafts_ended_early_keep_the_target_distribution():
    """Sampled drafts (Q), drafting ahead, and a rule that ends most drafts after one or two tokens: every generated
    token, given the one before it, still follows P, and every drafted token goes out with its own q."""
    results, controllers = asyncio.run(_sampled_runs(1500, 0.3))
    assert all(len(r.token_ids) == 12 for r in results)
    assert not MISSENT, MISSENT[:3]
    drafted, rounds_ = sum(r.draft_tokens for r in results), sum(r.rounds for r in results)
    assert drafted < 0.8 * 3 * rounds_  # the rule ended many drafts before K = 3
    assert sum(r.ahead_tokens for r in results) > 0  # drafts made ahead were used (and cut by the rule)
    assert any(rule.taken == 1 for c in controllers for rule in c.rules)
    assert_follows_p(results)


@pytest.mark.parametrize("ahead", [False, True], ids=["waiting", "drafting-ahead"])
def test_greedy_drafts_end_at_the_rule_and_the_text_is_the_targets(ahead):
    """Every drafter token is 70% sure; with a chance equal to the confidence and a threshold of 0.4, a draft is
    two tokens (0.7, 0.49, then 0.343 < 0.4), whether drafted now or carried from drafting ahead."""
    sent: list[int] = []

    class Recording(FakeClient):
        async def open(self, msg, timeout=None, wait_for_ready=True):
            session = await super().open(msg, timeout, wait_for_ready)
            verify = session.verify

            async def recorded(round_, proposal):
                sent.append(len(proposal.token_ids))
                return await verify(round_, proposal)

            session.verify = recorded
            return session

    drafter = TableDrafter(cycle(1, 2, 3, 1))
    result = asyncio.run(
        generate(
            Recording(0, 0.004, max_tokens=30, target=cycle(1, 2, 3, 1)),
            drafter,
            TOKENIZER,
            Request(
                PROMPT,
                max_tokens=30,
                policy=DraftPolicy(draft_tokens=6, adaptive=True, max_draft_tokens=6, draft_ahead=ahead),
            ),
            controller=Forced(0.4, k_max=6, k_initial=6, ahead=ahead),
        )
    )
    want, last = [], PROMPT[-1]
    for _ in range(30):
        last = int(np.argmax(cycle(1, 2, 3, 1)[last]))
        want.append(last)
    assert result.token_ids == want
    assert set(sent[:-1]) == {2}, sent  # the last round may be shorter: the request ends
    if ahead:
        assert result.ahead_rounds > 2


def test_the_replayed_drafter_stops_where_the_recorded_one_would():
    from bench.replay import ReplayDrafter

    full = [5, 6, 7, 8, 9, 10]
    replay = ReplayDrafter({2: [7, 8, 9, 10]}, 0.0, full, {2: [0.9, 0.9, 0.2, 0.9]})
    assert replay.propose(full[:2], 4).token_ids == [7, 8, 9, 10]
    p = replay.propose(full[:2], 4, DraftStop(lambda c: c, 0.5))
    assert p.token_ids == [7, 8] and p.confidence == [0.9, 0.9]


def test_the_switch_is_a_device_setting(tmp_path):
    from edge_client.cli import build_parser, edge_config
    from edge_client.config import load_edge_config

    assert load_edge_config().confidence_stop is False  # off by default (README: it cut drafts short under load)
    assert load_edge_config(confidence_stop=True).confidence_stop is True
    with pytest.raises(ValueError, match="confidence_stop must be true or false"):
        load_edge_config(confidence_stop="off")
    assert AdaptiveDraftLength.for_device(8, True).confidence_stop is False
    assert AdaptiveDraftLength.for_device(8, True, confidence_stop=True).confidence_stop is True
    # The daemon's flag overrides its YAML, both ways; no flag leaves the YAML's word.
    yaml_off = tmp_path / "device.yaml"
    yaml_off.write_text("confidence_stop: false\n")
    parse = build_parser().parse_args
    assert edge_config(parse(["serve", "--config", str(yaml_off)])).confidence_stop is False
    assert edge_config(parse(["serve", "--config", str(yaml_off), "--confidence-stop"])).confidence_stop is True
    assert edge_config(parse(["serve", "--no-confidence-stop"])).confidence_stop is False
    yaml_on = tmp_path / "on.yaml"
    yaml_on.write_text("confidence_stop: true\n")
    assert edge_config(parse(["serve", "--config", str(yaml_on)])).confidence_stop is True
    assert edge_config(parse(["serve", "--config", str(yaml_on), "--no-confidence-stop"])).confidence_stop is False


def test_a_drafted_token_goes_out_at_its_step_share_and_another_is_drafted_only_where_worth_its_drafting():
    rule = DraftStop(lambda c: c, 0.5, keep=0.2, alpha=0.9)
    assert rule.take(0.9) and rule.more()  # 0.9, and the next one expected at 0.81
    assert rule.take(0.6)  # 0.54: drafted already, worth its share of the step
    assert not rule.more()  # the next expected at 0.486: not worth drafting
    rule = DraftStop(lambda c: c, 0.5, keep=0.2, alpha=0.9)
    assert rule.take(0.9) and not rule.take(0.2)  # 0.18 < 0.2: not even worth verifying
    assert not rule.more() and not rule.take(1.0)  # ended: nothing more goes out


def drafted_at_average(ctrl: AdaptiveDraftLength, confidence: float) -> int:
    """How far this round's rule lets a draft of tokens all of one confidence go, up to K."""
    rule, n = ctrl.stop_rule(), 0
    assert rule is not None
    while n < ctrl.k and (n == 0 or rule.more()) and rule.take(confidence):
        n += 1
    return n


@pytest.mark.parametrize("draft_s,sessions,ahead", [(0.010, 1, True), (0.015, 2, True), (0.015, 2, False),
                                                    (0.015, 8, True)])
def test_a_draft_of_average_tokens_reaches_the_chosen_k(draft_s, sessions, ahead):
    """A CPU server (20 ms a step + 2.9 ms a verified token) with 1-8 sessions a step, drafting at 10-15 ms a
    token, every token 90% sure and the target rejecting about one in twelve. Whatever K the controller chooses,
    the rule must not end a draft of such average tokens before it. It did, in all four: drafting ahead, one more
    token was priced at what it adds to a round on average, there more than a committed token's worth; and the
    rule compared the learned chances of its confidence bins with the recent rounds' acceptance, which can differ
    by more than a token."""
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=8, ahead=ahead, confidence_stop=True)
    position = 0
    for _ in range(40):
        k = ctrl.k
        accepted = 0
        while accepted < k and (position + accepted) % 12 != 11:
            accepted += 1
        position += accepted + 1
        ctrl.observe(RoundSample(k, accepted, draft_s * k, 0.020 + sessions * 0.0029 * (k + 1), 0.0029, draft_s,
                                 sessions, (0.9,) * k))
    assert ctrl.k > 1
    assert drafted_at_average(ctrl, 0.9) == ctrl.k, (ctrl.k, ctrl.threshold)
