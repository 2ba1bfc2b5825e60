import pytest

from edge_client.adaptive import FINISHED, AdaptiveDraftLength, RoundCost, RoundSample
from edge_client.policy import DraftPolicy


def feed(ctrl, rounds, drafted, accepted, draft_s, rtt_s, server_token_s, sessions=1):
    for _ in range(rounds):
        k = ctrl.k
        ctrl.observe(RoundSample(k, min(accepted(k), k), draft_s * k, rtt_s + sessions * server_token_s * (k + 1),
                                 server_token_s, step_sessions=sessions))
    return ctrl.k


def test_high_acceptance_and_cheap_drafting_lengthen_the_draft():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4)
    assert feed(ctrl, 12, None, lambda k: k, draft_s=0.002, rtt_s=0.05, server_token_s=0.001) == 8


def test_low_acceptance_shortens_the_draft():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4)
    assert feed(ctrl, 16, None, lambda k: 0, draft_s=0.01, rtt_s=0.02, server_token_s=0.004) == 1


def test_a_loaded_server_shortens_the_draft_at_the_same_acceptance():
    light = AdaptiveDraftLength(k_max=8, k_initial=4)
    heavy = AdaptiveDraftLength(k_max=8, k_initial=4)
    # Every other round rejects after 2 tokens: alpha around 0.8.
    pattern = lambda k: 2 if pattern.n % 2 else k  # noqa: E731
    pattern.n = 0

    def acc(k):
        pattern.n += 1
        return pattern(k)

    k_light = feed(light, 16, None, acc, draft_s=0.005, rtt_s=0.03, server_token_s=0.001)
    k_heavy = feed(heavy, 16, None, acc, draft_s=0.005, rtt_s=0.03, server_token_s=0.03)
    assert k_heavy < k_light


def test_more_sessions_in_the_step_shorten_the_draft_at_the_same_token_cost():
    """Every session in the step lengthens its draft as this one does, so a token of K costs the step (which all of
    them wait for) one token per session: at 8 sessions the same per-token cost weighs 8 times."""
    alone = AdaptiveDraftLength(k_max=8, k_initial=8)
    shared = AdaptiveDraftLength(k_max=8, k_initial=8)
    always = lambda k: k - 1 if k > 1 else k  # noqa: E731  (alpha around 0.9 at K 8)
    k_alone = feed(alone, 16, None, always, draft_s=0.015, rtt_s=0.02, server_token_s=0.003)
    k_shared = feed(shared, 16, None, always, draft_s=0.015, rtt_s=0.02, server_token_s=0.003, sessions=8)
    assert k_shared < k_alone, (k_shared, k_alone)


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(k_max=0)
    assert AdaptiveDraftLength(k_max=3, k_initial=9).k == 3


def test_drafting_ahead_prefers_a_draft_ready_within_one_round_trip():
    """Acceptance about 0.9, 9 ms a drafted token, 25 ms round trip. Waiting for each verdict, K = 3 commits the
    most per second. Drafting ahead, a short draft is made again during the round trip whenever a round is accepted
    whole, so K = 2 comes out ahead (2 + 1 tokens of drafting fit in the round trip)."""
    chosen = {}
    for ahead in (False, True):
        ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=ahead)
        for i in range(16):
            # With drafting ahead, the drafting left on the critical path shrinks; the per-token time does not.
            ctrl.samples.append(RoundSample(4, 4 if i % 3 else 2, 0.0 if ahead else 0.036, 0.025, 0.001, 0.009))
        chosen[ahead] = ctrl.choose()
    assert chosen == {False: 3, True: 2}


def test_a_generations_first_draft_is_priced_with_nothing_drafted_ahead():
    """The samples above, drafting ahead: rounds play K = 2, but a generation's first draft has no round trip before
    it to draft in, so its K is the one that commits the most a second when drafted whole first (3). Before two
    rounds are seen, and while drafts are finished, the first draft is the K played."""
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
    assert ctrl.first_k == ctrl.k == 4
    for i in range(16):
        ctrl.observe(RoundSample(4, 4 if i % 3 else 2, 0.0, 0.025, 0.001, 0.009))
    assert (ctrl.k, ctrl.first_k) == (2, 3)
    ctrl.modes.mode = FINISHED
    ctrl.k = ctrl.played(ctrl.model_k)
    assert ctrl.first_k == ctrl.k == ctrl.finished_k()


def test_drafting_beside_the_step_and_alone_are_priced_each_at_its_own_pace():
    """A device sharing the server's machine drafts slower while its draft is verified (20 ms a token beside the step)
    than after the verdict (10 ms alone). The round trip covers the tokens drafted beside the step; the rest of the
    next draft goes at the pace alone. Priced at one blended pace (15 ms), drafting after the verdict looks dear
    and the model keeps K at 1; priced at each pace, K = 4 commits the most a second (the fixed K that such a device
    measured fastest)."""
    blended = RoundCost(0.9, 0.015, 0.001, 0.02, 0.0, 0.0, 0.0, True, 8)
    paced = RoundCost(0.9, 0.015, 0.001, 0.02, 0.0, 0.0, 0.0, True, 8, t_ahead=0.02, t_alone=0.01)
    # K = 4: a round trip of 25 ms and the token being drafted then finished (10 ms): 1.75 tokens drafted ahead; a
    # hit (0.9^5) drafts the other 3.25 of the next draft and its bonus guess alone, a miss all 4
    hit = 0.9 ** 5
    assert paced.seconds(4) == pytest.approx(0.035 + hit * 3.25 * 0.01 + (1 - hit) * 4 * 0.01)

    def best(cost):
        return max(range(1, 9), key=lambda k: cost.tokens(k) / cost.seconds(k))

    assert (best(blended), best(paced)) == (1, 4)
    # the controller takes both paces from its rounds
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
    for i in range(16):
        ctrl.samples.append(RoundSample(4, 4 if i % 10 else 1, 0.0, 0.025, 0.001, 0.015, ahead_token_s=0.02,
                                        alone_token_s=0.01))
    ctrl.choose()
    assert (ctrl.cost.ahead_s, ctrl.cost.alone_s) == (pytest.approx(0.02), pytest.approx(0.01))


def test_the_drafters_own_speed_is_used_when_reported():
    # The critical-path drafting time is near zero when drafts come from drafting ahead: without the reported
    # per-token time, drafting would look free and K would go to its maximum.
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4)
    for _ in range(16):
        ctrl.samples.append(RoundSample(4, 3, 0.0, 0.025, 0.001, 0.05))
    assert ctrl.choose() < 4
    free = AdaptiveDraftLength(k_max=8, k_initial=4)
    for _ in range(16):
        free.samples.append(RoundSample(4, 3, 0.0, 0.025, 0.001))
    assert free.choose() >= 7


def test_configure_keeps_what_was_learned_within_the_new_bounds():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=8)
    feed(ctrl, 16, None, lambda k: 0, draft_s=0.01, rtt_s=0.02, server_token_s=0.004)
    assert ctrl.k == 1 and len(ctrl.samples) == 16
    ctrl.configure(4, ahead=True)
    assert (ctrl.k, ctrl.k_max, ctrl.ahead, len(ctrl.samples)) == (1, 4, True, 16)
    ctrl.model_k = 4  # the model's last choice
    ctrl.configure(2, ahead=False)
    assert (ctrl.k, ctrl.k_max) == (2, 2)
    with pytest.raises(ValueError, match="k_max"):
        ctrl.configure(0, ahead=False)


def test_samples_older_than_max_age_are_dropped_when_the_next_request_starts():
    now = [0.0]
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=8, max_age_s=60.0, clock=lambda: now[0])
    feed(ctrl, 16, None, lambda k: 0, draft_s=0.01, rtt_s=0.02, server_token_s=0.004)
    now[0] = 59.0
    ctrl.configure(8, ahead=True)
    assert len(ctrl.samples) == 16  # a request soon after: kept
    now[0] = 121.0
    ctrl.configure(8, ahead=True)
    assert len(ctrl.samples) == 0 and ctrl.k == 1  # idle for over a minute: measured again, from the last K


def test_a_controller_kept_by_the_device_carries_what_it_learned_into_the_next_request():
    """A drafter the target always rejects: the first request learns K = 1 after two rounds at K = 8. With the
    controller kept, the next request starts at K = 1; a fresh controller starts over at 8."""
    import asyncio

    from edge_client.generation import generate
    from edge_client.request import Request
    from tests.edge_client.test_draft_ahead import P_GREEDY, PROMPT, TOKENIZER, FakeClient, TableDrafter, cycle

    sent: list[list[int]] = []

    class Recording(FakeClient):
        async def open(self, msg, timeout=None, wait_for_ready=True):
            session = await super().open(msg, timeout, wait_for_ready)
            verify = session.verify

            async def recorded(round_, proposal):
                sent[-1].append(len(proposal.token_ids))
                return await verify(round_, proposal)

            session.verify = recorded
            return session

    async def request(controller):
        sent.append([])
        await generate(
            Recording(0, 0.001, max_tokens=12, target=P_GREEDY),
            TableDrafter(cycle(2, 3, 1, 0)),
            TOKENIZER,
            Request(PROMPT, max_tokens=12, policy=DraftPolicy(draft_ahead=False)),
            controller=controller,
        )

    async def main():
        kept = AdaptiveDraftLength(k_max=8, k_initial=8)
        await request(kept)
        await request(kept)
        await request(None)

    asyncio.run(main())
    first, second, fresh = sent
    # 0: a request's last token comes with the verdict alone, nothing drafted past the request's end.
    assert first[:2] == [8, 8] and first[-1] in (0, 1) and set(first[2:]) == {0, 1}
    assert second[0] == 1 and set(second) == {0, 1}
    assert fresh[:2] == [8, 8]


def test_the_round_trip_ends_when_the_verdict_comes_not_when_the_token_drafted_ahead_is_done():
    """Each token drafted ahead costs 200 ms on a clock the test moves, and a token in progress when its round's verdict
    comes ends only after the device has taken that verdict in. The round trip the controller learns is the server's
    (no time on that clock), not the server's plus the rest of the token in progress (200 ms). The device waits for
    that token before its next round (answer_at_once off), so no later round's flight holds it either."""
    import asyncio
    import threading

    from edge_client import generation
    from edge_client.request import Callbacks, Request
    from edge_client.round import RoundHooks
    from tests.edge_client.test_draft_ahead import (P_GREEDY, PROMPT, TOKENIZER, FakeClient, FakeSession,
                                                    TableDrafter, cycle)

    now, came, taken = [0.0], [0], [0]  # the clock; verdicts come, verdicts the device has timed
    moved = threading.Condition()
    held = []  # per token drafted ahead before its verdict came: whether it was in progress when the device took it in

    class Hooks(RoundHooks):
        began = 0  # verdicts the device had taken in when its drafting thread began drafting past a draft sent

        def clock(self):  # the device's first reading after a verdict comes is its arrival time
            with moved:
                if came[0] > taken[0] and threading.current_thread() is threading.main_thread():
                    taken[0] = came[0]
                    moved.notify_all()
                return now[0]

        def ahead_token(self, n, arrived):
            with moved:
                if n == 1:
                    self.began = taken[0]
                if taken[0] == self.began:  # its verdict not in yet: it ends after the device takes it in
                    held.append(moved.wait_for(lambda: taken[0] > self.began, timeout=30))
                now[0] += 0.2

    class Sent(FakeSession):
        async def verify(self, round_, proposal):
            verdict = await super().verify(round_, proposal)
            came[0] += 1
            return verdict

    class Client(FakeClient):
        async def open(self, msg, timeout=None, wait_for_ready=True):
            session = await super().open(msg, timeout, wait_for_ready)
            session.__class__ = Sent
            return session

    seen: list[RoundSample] = []

    class Watching(AdaptiveDraftLength):
        def observe(self, sample):
            seen.append(sample)
            super().observe(sample)

    asyncio.run(
        generation.generate(
            Client(0, 0.05, max_tokens=8, target=P_GREEDY),
            TableDrafter(cycle(2, 3, 1, 0)),
            TOKENIZER,
            Request(PROMPT, max_tokens=8, policy=DraftPolicy(draft_ahead=True, answer_at_once=False)),
            controller=Watching(k_max=2, k_initial=2, ahead=True),
            callbacks=Callbacks(hooks=Hooks()),
        )
    )
    assert held and all(held)  # tokens were drafted ahead, each in progress when its verdict came
    assert seen and all(s.rtt_s == 0.0 for s in seen), [round(s.rtt_s, 3) for s in seen]


def test_the_controller_learns_the_step_time_and_the_queue_wait_each_verdict_reports():
    import asyncio

    from edge_client.generation import generate
    from edge_client.request import Request
    from tests.edge_client.test_draft_ahead import P_GREEDY, PROMPT, TOKENIZER, FakeClient, TableDrafter, cycle

    seen: list[RoundSample] = []

    class Watching(AdaptiveDraftLength):
        def observe(self, sample):
            seen.append(sample)
            super().observe(sample)

    asyncio.run(
        generate(
            FakeClient(0, 0.001, max_tokens=8, target=P_GREEDY, queue_ms=6.0),
            TableDrafter(cycle(2, 3, 1, 0)),
            TOKENIZER,
            Request(PROMPT, max_tokens=8),
            controller=Watching(k_max=2, k_initial=2),
        )
    )
    # The fake server reports a 4 ms step that the draft queued 6 ms for.
    assert seen and all(s.step_s == pytest.approx(0.004) and s.queue_s == pytest.approx(0.006) for s in seen)


def test_a_round_trip_that_queues_through_other_steps_counts_their_growth_too():
    """A saturated server: each draft waits through the step before its own (a round trip of about two steps), and
    every device's K lengthens both, so one more token of K costs the round trip twice what it costs one step.
    Priced at one step (the earlier form, which is what a controller that is not told the queue wait does), 16
    sessions at 20 ms + 4.3 ms a token with acceptance about 0.9 keep K at 8 here, where the whole system commits
    the most at K 2 (`sled-bench sim-rounds` compares the controller with the best fixed K)."""
    def k_after(queue_reported):
        ctrl = AdaptiveDraftLength(k_max=8, k_initial=8, ahead=True)
        for i in range(16):
            k = ctrl.k
            step = 0.020 + 16 * 0.0043 * (k + 1)
            accepted = k if i % 4 else k // 2  # about 0.9 a token
            ctrl.observe(RoundSample(k, accepted, 0.0, 2 * step + 0.002, 0.0043, 0.034, 16,
                                     step_s=step, queue_s=step if queue_reported else 0.0))
        return ctrl.k

    blind, told = k_after(False), k_after(True)
    assert told < blind, (told, blind)
    assert told <= 3, told


def test_drafting_that_a_queue_wait_covers_does_not_count_against_a_longer_draft(monkeypatch):
    """A GPU-like server whose steps follow each other (24 ms, nearly flat in their tokens: 0.1 ms a token, 14
    sessions a step), each draft waiting 13 ms through the step before its own, and a device drafting at 11.8 ms a
    token (the emulated GPU profile of docs/benchmarks.md). Drafting one token more after a verdict sends the draft
    later, but it then waits as much less: the round trip measured includes the wait. Counted, the controller drafts
    longer than a controller that charges every token of drafting after the verdict to the round (the earlier form)."""
    def k_after(hide):
        monkeypatch.setattr(AdaptiveDraftLength, "HIDE_QUEUE", hide)
        ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
        for i in range(16):
            ctrl.observe(RoundSample(4, 4 if i % 6 else 1, 0.0, 0.046, 0.0001, 0.0118, 14, step_s=0.024,
                                     queue_s=0.013))
        return ctrl.k

    assert k_after(True) > k_after(False) >= 4


def test_only_drafts_sent_at_once_tell_whether_the_server_queues():
    """A draft sent late (after finishing a token and drafting the rest of K) waits for the step its verdict's window
    opened whatever the server's load: those do not count, however many of them queued. With fewer than QUEUED_MIN
    drafts sent at once left among the recent rounds, the answer is no, so the device answers at once again."""
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)

    def observe(queue_s, prompt):
        ctrl.observe(RoundSample(4, 4, 0.0, 0.05, 0.0001, 0.01, 8, step_s=0.024, queue_s=queue_s, prompt=prompt))

    for _ in range(AdaptiveDraftLength.QUEUED_MIN):
        observe(0.01, True)
    assert ctrl.server_queues()
    for _ in range(ctrl.samples.maxlen - AdaptiveDraftLength.QUEUED_MIN):
        observe(0.01, False)  # late drafts, all queued: the judgment stands on the ones sent at once
    assert ctrl.server_queues()
    observe(0.01, False)  # one of those sent at once leaves the recent rounds: too few left to tell
    assert not ctrl.server_queues()
    for _ in range(4):
        observe(0.0, True)  # sent at once and not queued; the older ones sent at once leave the recent rounds
    assert not ctrl.server_queues()
    for _ in range(4):
        observe(0.01, True)  # of the 8 recent ones sent at once, 4 queued: half
    assert ctrl.server_queues()


def test_the_server_queues_the_drafts_when_most_recent_rounds_waited_through_a_step():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)

    def observe(queue_s):
        ctrl.observe(RoundSample(4, 4, 0.0, 0.05, 0.0001, 0.01, 8, step_s=0.024, queue_s=queue_s))

    for _ in range(AdaptiveDraftLength.QUEUED_MIN - 1):
        observe(0.01)
    assert not ctrl.server_queues()  # too few rounds to tell
    observe(0.01)
    assert ctrl.server_queues()
    for _ in range(5):  # of the last 8 rounds, 3 waited
        observe(0.0)
    assert not ctrl.server_queues()
    for _ in range(3):
        observe(0.0)
    for _ in range(3):  # 3 of 8
        observe(0.01)
    assert not ctrl.server_queues()
    observe(0.01)  # 4 of 8: half
    assert ctrl.server_queues()
