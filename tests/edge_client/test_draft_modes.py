"""The controller's choice between the model's way and a fixed K, by what each measures (DraftModes)."""

import pytest

from edge_client.adaptive import MODEL, AdaptiveDraftLength, DraftModes, RoundSample
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


def test_a_fixed_k_that_commits_faster_than_the_models_way_is_played_and_finishes_its_drafts():
    """On a machine where the model's short rounds cost more than it prices them (the drafting slowed by each
    server step), K = 8 finished each round measures fastest: it is played, at K = 8, never answering at once."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 50.0, 8: 66.0, 4: 60.0, 2: 55.0}
    played = play(ctrl, rates.get, 120)
    # the model's way until it has a model (two rounds) and through the warm-up trial, then the fixed K the model
    # rates fastest (4: every draft is kept, and a longer one lengthens the step) as the reference each other mode
    # is played beside, its neighbours 8 and 2 among them; K = 8, measured fastest, takes over
    assert played[:3] == [MODEL] * 3 and next(m for m in played if m != MODEL) == 4
    assert set(played[:40]) == {MODEL, 8, 4, 2}
    assert ctrl.modes.best == 8 and ctrl.k == 8
    assert not ctrl.answers_at_once(8, 3, busy=True) and not ctrl.empty_after_miss(0.0)
    assert ctrl.stop_rule() is None


def test_where_the_models_way_measures_fastest_it_is_played():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 70.0, 8: 50.0, 4: 55.0, 2: 52.0}
    played = play(ctrl, rates.get, 80)
    assert ctrl.modes.last_best == MODEL and played[-60:].count(MODEL) >= 45
    while not ctrl.model_played:  # a mode beside it tried again
        play(ctrl, rates.get, 1)
    assert ctrl.k == ctrl.model_k  # the model's own K


def test_halving_goes_on_while_it_measures_faster():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 40.0, 8: 50.0, 4: 55.0, 2: 60.0}
    play(ctrl, rates.get, 80)
    assert ctrl.modes.last_best == 2 and ctrl.k == 2


def test_a_fixed_k_played_drafts_ahead_no_further_than_a_fixed_k_device_would():
    """Under a fixed K the next draft is K long: drafting ahead stops after the bonus guess and K past it, as with
    --no-adaptive (drafting further is thrown away, and on a machine shared with the server it slows the step and
    leaves the drafter mid-token when the verdict comes). The model's way may answer with any K up to K_max, so it
    drafts ahead that far."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rules = RoundRules(DraftPolicy(max_draft_tokens=8), ctrl)
    assert ctrl.model_played and rules.ahead_limit(20) == 9
    play(ctrl, {MODEL: 40.0, 8: 50.0, 4: 55.0, 2: 60.0}.get, 80)
    assert ctrl.modes.best == 2 and not ctrl.model_played
    assert rules.ahead_limit(20) == 3 == RoundRules(DraftPolicy(draft_tokens=2, adaptive=False),
                                                    FixedDraftLength(2)).ahead_limit(20)
    assert rules.ahead_limit(2) == 2  # and never past the request's end


def test_after_a_spell_the_modes_beside_the_best_are_tried_again_and_a_change_is_followed():
    """The server's load changes (other devices come): after its spell of K = 8, the model's way is tried again and
    now measures faster, so it is played; while the best stays the best, each spell is twice as long."""
    modes = DraftModes(8)
    rates = {MODEL: 50.0, 8: 66.0, 4: 60.0, 2: 55.0}
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
    assert spells == [(8, first), (8, 2 * first), (8, 4 * first)]
    rates[MODEL] = 90.0
    rounds(5)
    assert spells[3:] == [(MODEL, first), (MODEL, 2 * first)]


def test_rounds_without_a_measured_time_leave_the_mode_alone():
    """A model of the device that times no round (cycle_s None) plays the model's way only."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    for _ in range(50):
        ctrl.observe(RoundSample(ctrl.k, ctrl.k, 0.0, 0.03, 0.001, 0.01))
    assert ctrl.model_played and ctrl.modes.rate == {}


def test_a_servers_bound_on_k_starts_the_trials_again_under_it():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    play(ctrl, {MODEL: 50.0, 8: 66.0, 4: 60.0, 2: 55.0}.get, 60)
    assert ctrl.modes.last_best == 8
    ctrl.cap(3)
    assert ctrl.modes.fixed == [3] and ctrl.k <= 3
    play(ctrl, {MODEL: 50.0, 3: 66.0}.get, 40)
    assert ctrl.modes.best == 3 and ctrl.k == 3


def test_a_floor_on_k_holds_under_a_fixed_k():
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    ctrl.at_least(3)
    play(ctrl, {MODEL: 40.0, 8: 50.0, 4: 55.0, 2: 60.0}.get, 80)
    assert ctrl.modes.last_best == 2 and ctrl.k == 3  # the session's floor wins over the fixed K played


def test_a_device_sharing_the_server_plays_the_models_way_whatever_a_fixed_k_gains_it():
    """Beside other sessions a longer draft can gain this device tokens a second that the others lose, waiting for a
    longer step: its own rate is the wrong measure there, and the model prices the others' wait. So with 4 sessions
    a step it plays the model's way though K = 8 would measure faster, and tries fixed K again once alone."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    rates = {MODEL: 50.0, 8: 66.0, 4: 60.0, 2: 55.0}

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
    assert ctrl.modes.last_best == 8 and ctrl.k == 8


def test_a_mode_tried_again_takes_over_only_where_clearly_faster():
    """After a spell, a mode tried again beside it takes over only where it scores above its reference by more than
    SWITCH_MARGIN."""
    for faster, taken in ((1.01, False), (1.15, True)):
        modes = DraftModes(8)
        rates = {MODEL: 50.0, 8: 66.0, 4: 60.0, 2: 55.0}
        while modes.best != 8:
            modes.count(4, 4 / rates[modes.mode])
        rates[4] = 66.0 * faster
        while modes.best is not None:  # the spell
            modes.count(4, 4 / rates[modes.mode])
        while modes.best is None:  # the trials beside it
            modes.count(4, 4 / rates[modes.mode])
        assert modes.best == (4 if taken else 8), faster


def test_a_weak_drafter_tries_no_k_its_model_finds_wasteful():
    """The model misses a round's own costs, not rejections: a drafter the target rejects at every token (K = 1 in
    the model) is not made to draft K = 8 for a trial, where nearly all of it would be thrown away."""
    ctrl = AdaptiveDraftLength.for_device(8, ahead=True)
    played = play(ctrl, {MODEL: 20.0, 8: 30.0, 4: 30.0, 2: 30.0}.get, 60, accepted=lambda k: 0)
    assert set(played[2:]) == {MODEL} and ctrl.k == 1


def test_a_challenger_lifted_by_one_sunk_reference_trial_is_played_again_and_not_believed():
    """K = 8 beats the model's way by more than MOVE_MARGIN and becomes the reference. One hard stretch of text (a new
    prompt's opening) sinks its trial right after K = 4's: K = 4 and then K = 2 score above the reference's mean.
    K = 4, the best, is played beside the reference once more and scores below it, then K = 2 likewise, and K = 8
    stays (believed at once, the sunk trial would have made K = 4 the winner)."""
    modes = DraftModes(8)
    rates = {MODEL: 60.0, 8: 80.0, 4: 66.0, 2: 64.0}
    modes.count(4, 0.05)  # the first measured round starts the trials
    trials, sunk = [], False
    while modes.best is None:
        mode, hard = modes.mode, modes.mode == 8 and modes.waiting == 4 and not sunk
        if ends_trial(modes, 4, 4 / (40.0 if hard else rates[mode])):
            trials.append(mode)
            sunk = sunk or hard
    assert trials == [MODEL, MODEL, 8, MODEL, 4, 8, 2, 8, 4, 8, 2, 8]  # the first trial warms up
    assert modes.best == 8 and modes.score[4] < 1.0 and modes.score[2] < 1.0


def test_the_first_trial_only_warms_up_and_nothing_is_scored_against_it():
    """A fresh drafter and session measure slow: the first trial, the model's way (played before the trials anyway),
    only warms up. The model's way, the reference, is measured again before K = 8 is scored against it, at its own
    rate (scored against the warm-up's, K = 8 would have won by more than it does)."""
    modes = DraftModes(8)
    rates = {MODEL: 60.0, 8: 80.0, 4: 66.0, 2: 64.0}
    trials = trials_until_a_winner(modes, 4, lambda mode, trials: 30.0 if not trials else rates[mode])
    assert trials == [MODEL, MODEL, 8, MODEL, 4, 8]
    assert modes.best == 8 and modes.rate[MODEL] == 60.0


def test_a_reference_a_challenger_clearly_beats_is_not_played_between_the_other_trials():
    """A device whose model's way is far slower than K = 4 and 2 (its rounds cost more than the model prices them):
    K = 4 beats it by more than MOVE_MARGIN in its trial and becomes the reference at once, so K = 2 is played
    beside K = 4, and the model's way only in the trials that scored K = 4 (beside it as the reference, it would
    have been played twice more)."""
    modes = DraftModes(4)
    rates = {MODEL: 40.0, 4: 52.0, 2: 56.0}
    trials = trials_until_a_winner(modes, 2, lambda mode, trials: rates[mode])
    assert trials == [MODEL, MODEL, 4, MODEL, 2, 4, 2, 4]  # K = 2 confirmed beside K = 4
    assert modes.best == 2


def test_where_a_win_is_not_confirmed_the_next_challenger_that_won_is_played_again():
    """Every challenger beat the reference, the model's way: the best first score, K = 8's, lifted by an easy stretch
    of text, loses when played again, and the next winner, K = 2, is played again and takes over, not the
    reference that every first score ranked below it."""
    modes = DraftModes(8)
    rates = {MODEL: 50.0, 8: 50.0, 4: 53.0, 2: 54.5}
    # K = 8's first trial meets easy text
    trials = trials_until_a_winner(modes, 4, lambda mode, trials: rates[mode] * (
        1.12 if mode == 8 and 8 not in trials else 1.0))
    assert trials == [MODEL, MODEL, 8, MODEL, 4, MODEL, 2, MODEL, 8, MODEL, 2, MODEL]
    assert modes.unconfirmed == {8} and modes.best == 2


def test_the_first_round_in_a_new_mode_is_not_counted():
    """Switching from K = 8 to a shorter K or the model's way, the first draft goes out with what K = 8 drafted
    ahead, a round far faster than the mode's own: not counted, every mode measures at its own rate and K = 8 stays
    (counted, the round lifts each challenger's trial above K = 8's)."""
    modes = DraftModes(8)
    rates = {MODEL: 60.0, 8: 80.0, 4: 66.0, 2: 64.0}
    modes.count(4, 0.05)  # the first measured round starts the trials
    last = modes.mode
    while modes.best is None:
        mode = modes.mode
        switched, last = mode != last, mode
        modes.count(4, 4 / (rates[mode] * (3.0 if switched and mode != 8 else 1.0)))
    assert modes.best == 8
    assert all(modes.rate[m] == pytest.approx(rates[m]) for m in modes.rate)


def test_a_trial_that_meets_easy_text_is_priced_by_its_drafts_not_by_its_luck():
    """Every mode commits 60 tokens a second on the usual text. K = 4's first trial meets a stretch the drafter gets
    all right: its rounds commit 6 tokens where the same drafts commit 4 on the recent text, at the same round time.
    Priced by what its drafts commit on average (the controller's PositionAcceptance), it scores even and the
    reference, the model's way, stays; counted as the text let it commit, it would have taken over."""

    def winner(priced: bool):
        modes = DraftModes(8)
        modes.count(4, 0.05)  # the first measured round starts the trials
        first = True  # K = 4's first trial not yet over
        while modes.best is None:
            mode = modes.mode
            easy = mode == 4 and first
            modes.count(6 if easy else 4, 4 / 60.0, 4.0 if priced else None)
            first = first and not (mode == 4 and modes.mode != 4)
        return modes

    priced = winner(True)
    assert priced.best == MODEL and priced.score[4] == pytest.approx(1.0)
    assert all(rate == pytest.approx(60.0) for rate in priced.rate.values())
    luck = winner(False)
    assert luck.best == 4  # its lucky trial beat the reference by more than MOVE_MARGIN: the reference at once


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


def test_the_reference_is_the_fixed_k_the_model_rates_fastest_so_a_tie_keeps_it():
    """After the warm-up the fixed K the model rates fastest is the reference, so a tie keeps it (a lone device's rounds
    cost what the model leaves out); the challengers are the model's way and the fixed K beside the reference: where
    K_max is the slowest (hard text), it is not tried. Without a model's rates, the model's way is the reference and
    K_max and its half are the challengers."""
    measured = {MODEL: 52.0, 8: 40.0, 4: 50.0, 2: 50.0}
    rated = DraftModes(8, rate={8: 40.0, 4: 50.0, 2: 55.0}.get)
    trials = trials_until_a_winner(rated, 4, lambda mode, done: measured[mode])
    assert trials == [MODEL, 2, MODEL, 2, 4, 2] and rated.best == 2  # the model's way within 5%: no win
    unrated = DraftModes(8)
    trials = trials_until_a_winner(unrated, 4, lambda mode, done: measured[mode])
    assert trials == [MODEL, MODEL, 8, MODEL, 4, MODEL] and unrated.best == MODEL


def test_a_fixed_k_that_wins_has_its_double_tried_too():
    """The model rates K = 2 fastest (its first rounds priced short drafts well), so 2 is the reference and the model's
    way and 4 the challengers; 4 wins by more than a sunk trial moves a score and becomes the reference, and its
    double, 8, never among the challengers, is tried beside it and wins: K climbs up as well as down."""
    measured = {MODEL: 50.0, 8: 70.0, 4: 60.0, 2: 48.0}
    modes = DraftModes(8, rate={8: 40.0, 4: 50.0, 2: 55.0}.get)
    trials = trials_until_a_winner(modes, 4, lambda mode, done: measured[mode])
    assert trials == [MODEL, 2, MODEL, 2, 4, 2, 8, 4] and modes.best == 8
