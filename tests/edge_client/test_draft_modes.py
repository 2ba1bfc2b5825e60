"""The controller's choice between the model's way and finished drafts, by what each measures (DraftModes)."""

from dataclasses import replace

import pytest

from edge_client.adaptive import FINISHED, MODEL, AdaptiveDraftLength, DraftModes, RoundCost, RoundSample
from edge_client.policy import DraftPolicy, FixedDraftLength
from edge_client.round import RoundRules


def play(ctrl, rate_of, rounds, accepted=lambda k: k):
    """`rounds` rounds in which whatever is played commits at `rate_of(mode)` tokens a second; the modes played."""
    played = []
    for _ in range(rounds):
        mode, k = ctrl.modes.mode, ctrl.k
        committed = accepted(k) + 1
        played.append(mode)
        ctrl.observe(RoundSample(k, accepted(k), 0.0, 0.03, 0.001, 0.01, committed=committed,
                                 cycle_s=committed / rate_of(mode)))
    return played


def ends_trial(modes, committed, cycle_s):
    """One round counted by `modes`; whether it ended a trial (the first round in a new mode is not counted)."""
    settling = modes.settling
    modes.count(committed, cycle_s)
    return not settling and modes.tokens == 0


def trials_until_a_winner(modes, committed, rate):
    """Rounds of `committed` tokens at `rate(mode, trials so far)` from the trials' start until a mode wins; the
    trials played, in order."""
    modes.count(committed, 0.05)  # the first measured round starts the trials
    trials = []
    while modes.best is None:
        mode = modes.mode
        if ends_trial(modes, committed, committed / rate(mode, trials)):
            trials.append(mode)
    return trials


def test_finished_drafts_that_commit_faster_than_the_models_way_are_played_at_the_models_best_k():
    """On a machine where the model's short rounds cost more than it prices them (the drafting slowed by each
    server step), drafts finished each round measure fastest: they are played at the K the model rates fastest for a
    finished round, never answering at once."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 50.0, FINISHED: 66.0}
    played = play(ctrl, rates.get, 120)
    # the model's way until it has a model (two rounds) and through the warm-up trial, then finished drafts as the
    # reference, the model's way beside them, and the finished drafts again
    assert played[:3] == [MODEL] * 3 and next(m for m in played if m != MODEL) == FINISHED
    assert ctrl.modes.best == FINISHED and not ctrl.model_played
    assert ctrl.k == ctrl.finished_k() == ctrl.best_k(ctrl.cost, finished=True)
    assert not ctrl.answers_at_once(8, 3, busy=True) and not ctrl.empty_after_miss(0.0)
    assert ctrl.stop_rule() is None


def test_the_finished_k_is_priced_drafting_ahead_no_further_than_itself():
    """A finished draft of K drafts ahead its bonus guess and K past it, no further. A drafter at 7 ms a token and a
    round trip of 10 ms plus 4 ms a token: a finished K = 2 has drafted its 3 tokens ahead (21 ms) before its verdict
    (22 ms), so the verdict finds no token half drafted, which the model's way, drafting ahead to K_max, has to
    finish. Priced so, one token finished is the faster round here, where the model's way rates K = 2 faster."""
    cost = RoundCost(0.8, 0.007, 0.004, 0.01, 0.0, 0.0, 0.0, True, 8)
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4, ahead=True)
    finished = replace(cost, k_max=2).seconds(2)
    assert finished == pytest.approx(0.022 + (1 - 0.8 ** 3) * 2 * 0.007)
    assert cost.seconds(2) == pytest.approx(finished + 0.0035)  # the half token the model's way finishes
    assert (ctrl.best_k(cost, finished=True), ctrl.best_k(cost)) == (1, 2)


def test_where_the_models_way_measures_fastest_it_is_played():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 70.0, FINISHED: 50.0}
    played = play(ctrl, rates.get, 80)
    assert ctrl.modes.last_best == MODEL and played[-60:].count(MODEL) >= 45
    while not ctrl.model_played:  # the other mode tried again
        play(ctrl, rates.get, 1)
    assert ctrl.k == ctrl.model_k  # the model's own K


def test_finished_drafts_draft_ahead_no_further_than_a_fixed_k_device_would():
    """Where drafts are finished the next draft is K long: drafting ahead stops after the bonus guess and K past it,
    as with --no-adaptive (drafting further is thrown away, and on a machine shared with the server it slows the
    step and leaves the drafter mid-token when the verdict comes). The model's way may answer with any K up to
    K_max, so it drafts ahead that far."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rules = RoundRules(DraftPolicy(max_draft_tokens=8), ctrl)
    assert ctrl.model_played and rules.ahead_limit(20) == 9
    play(ctrl, {MODEL: 40.0, FINISHED: 60.0}.get, 80, accepted=lambda k: k // 2)
    assert ctrl.modes.best == FINISHED and not ctrl.model_played and ctrl.k < 8
    assert rules.ahead_limit(20) == ctrl.k + 1 == RoundRules(DraftPolicy(draft_tokens=ctrl.k, adaptive=False),
                                                             FixedDraftLength(ctrl.k)).ahead_limit(20)
    assert rules.ahead_limit(2) == 2  # and never past the request's end


def test_after_a_spell_the_other_mode_is_tried_again_and_a_change_is_followed():
    """The server's load changes (other devices come): after its spell of finished drafts, the model's way is tried
    again and now measures faster, so it is played; while the best stays the best, each spell is twice as long."""
    modes = DraftModes(rated=lambda: True)
    rates = {MODEL: 50.0, FINISHED: 66.0}
    spells = []  # each spell as it starts: its mode and length

    def rounds(until):
        for _ in range(5000):
            if len(spells) == until:
                return
            modes.count(4, 4 / rates[modes.mode])
            if modes.best is not None and modes.tokens == 0 and (modes.best, modes.spell) not in spells[-1:]:
                spells.append((modes.best, modes.spell))

    rounds(3)
    first = DraftModes.FIRST_SPELL
    assert spells == [(FINISHED, first), (FINISHED, 2 * first), (FINISHED, 4 * first)]
    rates[MODEL] = 90.0
    rounds(5)
    assert spells[3:] == [(MODEL, first), (MODEL, 2 * first)]


def test_rounds_without_a_measured_time_leave_the_mode_alone():
    """A model of the device that times no round (cycle_s None) plays the model's way only."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    for _ in range(50):
        ctrl.observe(RoundSample(ctrl.k, ctrl.k, 0.0, 0.03, 0.001, 0.01))
    assert ctrl.model_played and ctrl.modes.rate == {}


def test_finished_drafts_keep_within_a_servers_bound_and_a_sessions_floor():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    play(ctrl, {MODEL: 50.0, FINISHED: 66.0}.get, 60)
    assert ctrl.modes.last_best == FINISHED and ctrl.k == ctrl.finished_k() == 3  # the round trip drafts 3
    ctrl.cap(2)
    assert ctrl.k == 2 and ctrl.modes.last_best == FINISHED  # the trials' verdict stands under the bound
    play(ctrl, {MODEL: 50.0, FINISHED: 66.0}.get, 40)
    assert ctrl.k == 2
    weak = AdaptiveDraftLength.for_device(8, ahead=True)
    weak.at_least(3)
    play(weak, {MODEL: 40.0, FINISHED: 60.0}.get, 80, accepted=lambda k: 0)
    assert weak.modes.last_best == FINISHED and weak.finished_k() == 3 == weak.k  # the session's floor wins


def test_a_device_sharing_the_server_plays_the_models_way_whatever_finishing_gains_it():
    """Beside other sessions a longer draft can gain this device tokens a second that the others lose, waiting for a
    longer step: its own rate is the wrong measure there, and the model prices the others' wait. So with 4 sessions
    a step it plays the model's way though finished drafts would measure faster, and tries them again once alone."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 50.0, FINISHED: 66.0}

    def rounds(n, sessions):
        played = []
        for _ in range(n):
            k, played = ctrl.k, played + [ctrl.model_played]
            ctrl.observe(RoundSample(k, k, 0.0, 0.03, 0.001, 0.01, step_sessions=sessions, committed=k + 1,
                                     cycle_s=(k + 1) / rates[ctrl.modes.mode]))
        return played

    assert all(rounds(80, sessions=4)[2:])  # once two rounds tell it the steps are shared
    assert ctrl.modes.rate == {}
    rounds(80, sessions=1)
    assert ctrl.modes.last_best == FINISHED and not ctrl.model_played


def test_a_mode_tried_again_takes_over_only_where_clearly_faster():
    """After a spell, the other mode tried beside it takes over only where it scores above its reference by more
    than SWITCH_MARGIN, twice."""
    for faster, taken in ((1.01, False), (1.15, True)):
        modes = DraftModes(rated=lambda: True)
        rates = {MODEL: 50.0, FINISHED: 66.0}
        while modes.best != FINISHED:
            modes.count(4, 4 / rates[modes.mode])
        rates[MODEL] = 66.0 * faster
        while modes.best is not None:  # the spell
            modes.count(4, 4 / rates[modes.mode])
        while modes.best is None:  # the trials beside it
            modes.count(4, 4 / rates[modes.mode])
        assert modes.best == (MODEL if taken else FINISHED), faster


def test_a_challenger_lifted_by_one_sunk_reference_trial_is_played_again_and_not_believed():
    """One hard stretch of text (a new prompt's opening) sinks the finished drafts' trial right after the model's
    way's: the model's way scores above the reference's mean by more than SWITCH_MARGIN, is played again between
    two fresh trials of the reference, scores below them, and the finished drafts stay (believed at once, the sunk
    trial would have made the model's way the winner)."""
    modes = DraftModes(rated=lambda: True)
    rates = {MODEL: 60.0, FINISHED: 66.0}
    modes.count(4, 0.05)  # the first measured round starts the trials
    trials, sunk = [], False
    while modes.best is None:
        mode, hard = modes.mode, modes.mode == FINISHED and modes.waiting == MODEL and not sunk
        if ends_trial(modes, 4, 4 / (40.0 if hard else rates[mode])):
            trials.append(mode)
            sunk = sunk or hard
    assert trials == [MODEL, FINISHED, MODEL, FINISHED, FINISHED, MODEL, FINISHED]  # the first trial warms up
    assert modes.best == FINISHED and modes.score[MODEL] < 1.0


def test_the_first_trial_only_warms_up_and_nothing_is_scored_against_it():
    """A fresh drafter and session measure slow: the first trial, the model's way (played before the trials anyway),
    only warms up. Without a model to choose a finished K by, the model's way is the reference, measured again
    before finished drafts are scored against it, at its own rate (scored against the warm-up's, they would have won
    by far more than they do)."""
    modes = DraftModes()
    rates = {MODEL: 60.0, FINISHED: 80.0}
    trials = trials_until_a_winner(modes, 4, lambda mode, trials: 30.0 if not trials else rates[mode])
    assert trials == [MODEL, MODEL, FINISHED, MODEL, MODEL, FINISHED, MODEL]
    assert modes.best == FINISHED and modes.rate[MODEL] == 60.0


def test_with_a_model_the_finished_drafts_are_the_reference_so_a_tie_keeps_them():
    """After the warm-up, with the model's rates, finished drafts are the reference, so a tie keeps them (a lone
    device's rounds cost what the model leaves out); without, the model's way is, and keeps a tie."""
    measured = {MODEL: 52.0, FINISHED: 50.0}
    rated = DraftModes(rated=lambda: True)
    assert trials_until_a_winner(rated, 4, lambda mode, done: measured[mode]) == [MODEL, FINISHED, MODEL, FINISHED]
    assert rated.best == FINISHED  # the model's way within 5%: no win
    unrated = DraftModes()
    assert trials_until_a_winner(unrated, 4, lambda mode, done: measured[mode]) == [MODEL, MODEL, FINISHED, MODEL]
    assert unrated.best == MODEL


def test_the_first_round_in_a_new_mode_is_not_counted():
    """Switching from finished drafts of 8 to the model's way, the first draft goes out with what K = 8 drafted
    ahead, a round far faster than the mode's own: not counted, every mode measures at its own rate and the finished
    drafts stay (counted, the round lifts the model's way's trials above theirs)."""
    modes = DraftModes(rated=lambda: True)
    rates = {MODEL: 60.0, FINISHED: 66.0}
    modes.count(4, 0.05)  # the first measured round starts the trials
    last = modes.mode
    while modes.best is None:
        mode = modes.mode
        switched, last = mode != last, mode
        modes.count(4, 4 / (rates[mode] * (3.0 if switched and mode == MODEL else 1.0)))
    assert modes.best == FINISHED
    assert all(modes.rate[m] == pytest.approx(rates[m]) for m in modes.rate)


def test_a_trial_that_meets_easy_text_is_priced_by_its_drafts_not_by_its_luck():
    """Both modes commit 60 tokens a second on the usual text. The finished drafts' trials meet a stretch the drafter
    gets all right: their rounds commit 6 tokens where the same drafts commit 4 on the recent text, at the same round
    time. Priced by what their drafts commit on average (the controller's PositionAcceptance), they score even and
    the reference, the model's way, stays; counted as the text let them commit, they would have taken over."""

    def winner(priced: bool):
        modes = DraftModes()
        modes.count(4, 0.05)  # the first measured round starts the trials
        while modes.best is None:
            easy = modes.mode == FINISHED
            modes.count(6 if easy else 4, 4 / 60.0, 4.0 if priced else None)
        return modes

    priced = winner(True)
    assert priced.best == MODEL and priced.score[FINISHED] == pytest.approx(1.0)
    assert all(rate == pytest.approx(60.0) for rate in priced.rate.values())
    assert winner(False).best == FINISHED


def test_the_controller_prices_each_round_by_the_rounds_before_it(monkeypatch):
    """What AdaptiveDraftLength hands DraftModes with each round: what its draft commits on the acceptance by
    position of the rounds before it, not what this round's text let it commit."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    counted = []
    monkeypatch.setattr(DraftModes, "count", lambda self, committed, cycle_s, expected=None: counted.append(
        (committed, expected)))
    for _ in range(30):  # the usual text: drafts of 8 with three tokens right, the fourth wrong
        ctrl.observe(RoundSample(8, 3, 0.0, 0.03, 0.001, 0.01, committed=4, cycle_s=0.1))
    before = ctrl.positions.committed(8)
    ctrl.observe(RoundSample(8, 8, 0.0, 0.03, 0.001, 0.01, committed=9, cycle_s=0.1))  # a lucky round
    assert counted[-1] == (9, before) and before < 4.5
    assert counted[0][1] is None  # nothing seen yet: the round counts as it committed


def test_the_acceptance_by_position_prices_a_draft_by_its_recent_rounds():
    from edge_client.adaptive import PositionAcceptance

    pos = PositionAcceptance()
    assert pos.committed(4) is None  # nothing seen yet
    for _ in range(40):
        pos.observe(4, 2)  # two accepted, the third rejected, the fourth never reached
    p = pos.chances(8)
    assert p[0] > 0.95 and p[1] > 0.95 and p[2] < 0.05
    assert p[3] == pytest.approx(p[7])  # unseen positions: the average acceptance
    assert pos.chances(3) == p[:3]  # a position's chance does not depend on how far the draft reaches
    assert pos.committed(0) == 1.0  # the verdict's own token
    assert pos.committed(2) == pytest.approx(1 + p[0] + p[0] * p[1])
    assert 2.9 < pos.committed(8) < 3.1  # past the third token nearly nothing more
    for _ in range(2000):  # the text changes: now every token is accepted, and the old rounds fade
        pos.observe(4, 4)
    assert pos.committed(4) > 4.9
