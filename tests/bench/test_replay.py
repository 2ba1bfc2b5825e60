"""The replayed devices and their load: drafting at the speed asked whatever the sleeps overrun, each prompt's
prefill charged once, the window's figures; and the first figures' table."""

from __future__ import annotations

import math

import pytest


def test_stolen_share_is_the_steal_ticks_over_all_ticks_between_two_readings():
    from bench.report import cpu_counters, stolen_share

    now = cpu_counters()
    assert now is None or (0 <= now[0] <= now[1])  # Linux: (steal, total) in ticks
    assert stolen_share((100, 1000), (130, 1300)) == pytest.approx(0.1)
    assert stolen_share(None, (130, 1300)) is None and stolen_share((100, 1000), (100, 1000)) is None


def test_replayed_drafting_carries_each_sleeps_overrun_into_the_next(monkeypatch):
    """Every benchmark device runs in one process, where a sleep ends only once its thread has the GIL back: each
    sleep of the replayed drafter overruns. Carried into the next sleep, the overrun leaves the drafting at the rate
    asked on average (a real device drafts on its own cores); the clock reports what was asked and what was taken.
    With plain sleeps, 10 tokens at 5 ms overrunning 2 ms each take 70 ms."""
    import bench.replay as bench

    now = [0.0]
    asked_sleeps = []

    def sleep(seconds):
        asked_sleeps.append(seconds)
        now[0] += seconds + 0.002  # every sleep comes back 2 ms late

    monkeypatch.setattr(bench.time, "sleep", sleep)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    clock = bench.DraftClock()
    full = list(range(100))
    drafter = bench.ReplayDrafter({n: full[n:n + 8] for n in range(2, 90)}, 0.005, full, clock=clock)
    for n in range(2, 12):
        assert drafter.propose(full[:n], 1).token_ids == [full[n]]
    assert now[0] == pytest.approx(10 * 0.005 + 0.002)  # one overrun left over, not ten
    assert asked_sleeps[0] == pytest.approx(0.005) and all(s == pytest.approx(0.003) for s in asked_sleeps[1:])
    assert clock.tokens == 10 and clock.asked == pytest.approx(0.05)
    assert clock.ms_per_token() == pytest.approx(5.2)
    # An overrun longer than a token's time is made good over the next tokens, which then take no sleep at all.
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: (asked_sleeps.append(seconds),
                                                               now.__setitem__(0, now[0] + seconds + 0.02)))
    asked_sleeps.clear()
    for n in range(12, 16):
        drafter.propose(full[:n], 1)
    assert asked_sleeps == [pytest.approx(0.003)]  # 20 ms late: the next three tokens' time is already spent
    assert drafter.owed == pytest.approx(0.005)


def test_reply_figures_take_the_median_and_90th_percentile_of_the_answered_verdicts():
    from bench.load import reply_figures

    nan = float("nan")
    replies = [(nan, nan)] + [(float(ms), float(ms) / 2) for ms in range(1, 11)]  # a first round answers nothing
    got = reply_figures(replies)
    assert got["device_reply_ms"] == pytest.approx([5.5, 9.1])
    assert got["device_reply_drafting_ms"] == pytest.approx([2.75, 4.55])
    assert reply_figures([(nan, nan)]) == {"device_reply_ms": None, "device_reply_drafting_ms": None}
    assert reply_figures([]) == {"device_reply_ms": None, "device_reply_drafting_ms": None}


def test_queue_figures_give_the_share_of_drafts_that_waited_through_a_step_and_their_median_wait():
    from bench.load import queue_figures

    got = queue_figures([0.0, 0.0, 12.0, 0.0, 30.0, 20.0, 0.0, 0.0])
    assert got == {"queued_drafts_share": 0.375, "queued_drafts_wait_ms": 20.0}
    assert queue_figures([0.0, 0.0]) == {"queued_drafts_share": 0.0, "queued_drafts_wait_ms": None}
    assert queue_figures([]) == {"queued_drafts_share": None, "queued_drafts_wait_ms": None}


def test_drafting_use_splits_the_window_into_drafting_idle_at_request_ends_and_idle_inside():
    """A window of 10 s from t=100: the drafter drafts 100-103 and 104-106 in one request, whose final verdict comes at
    106.5, and 108-112 in the next (past the window's end at 110). Busy 3 + 2 + 2 = 7 s; the gap holding the final
    verdict, 106-108, is idle at a request's end (2 s); 103-104 is idle inside the request (1 s)."""
    from bench.load import drafting_use

    spans = [(108.0, 112.0), (100.0, 103.0), (104.0, 106.0)]  # any order
    busy, ends = drafting_use(spans, [106.5], 100.0, 110.0)
    assert busy == pytest.approx(0.7) and ends == pytest.approx(0.2)
    # A gap only partly inside the window counts only there: a request that ended before the window opened at 107,
    # and a final verdict past the window's end (a request cut there) adds nothing.
    busy, ends = drafting_use(spans, [106.5, 115.0], 107.0, 110.0)
    assert busy == pytest.approx(2 / 3) and ends == pytest.approx(1 / 3)
    # A final verdict that came while the drafter was on a token: the idle time starts once that token is done.
    busy, ends = drafting_use([(100.0, 106.0), (107.0, 110.0)], [105.9], 100.0, 110.0)
    assert busy == pytest.approx(0.9) and ends == pytest.approx(0.1)
    # A request that drafted nothing puts two ends in one gap, which counts once.
    assert drafting_use(spans, [106.5, 107.0], 100.0, 110.0) == pytest.approx((0.7, 0.2))
    # No drafting at all after the last request's end: idle to the window's end.
    assert drafting_use([(100.0, 105.0)], [105.0], 100.0, 110.0) == pytest.approx((0.5, 0.5))
    assert all(math.isnan(x) for x in drafting_use([], [], 100.0, 100.0))


def test_a_replayed_request_spends_its_prompt_s_prefill_once_before_its_first_token(monkeypatch):
    """A real drafter feeds a new request's prompt (past the system prompt its KV cache kept) at its first propose:
    the replay sleeps that time once, before the first token's, and the clock keeps it apart from the tokens', so
    the per-token figure stays the drafting rate. An overrun of the prefill's sleep is carried like any other."""
    import bench.replay as bench

    now, sleeps = [0.0], []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds + 0.001

    monkeypatch.setattr(bench.time, "sleep", sleep)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    clock = bench.DraftClock()
    full = list(range(100))
    drafter = bench.ReplayDrafter({n: full[n:n + 8] for n in range(2, 90)}, 0.005, full, clock=clock, prefill_s=0.03)
    assert drafter.propose(full[:2], 2).token_ids == [2, 3]
    assert sleeps == [pytest.approx(0.04)]  # the prefill and two tokens, in one sleep
    for n in (4, 5):
        drafter.propose(full[:n], 1)
    assert sleeps[1:] == [pytest.approx(0.004), pytest.approx(0.004)]  # no second prefill; the overrun carried
    # the first sleep took 41 ms: the prefill is charged its 30, the two tokens the 11 left (the overrun theirs)
    assert clock.prefills == 1 and clock.prefill_asked == pytest.approx(0.03)
    assert clock.tokens == 4 and clock.asked == pytest.approx(0.02) and clock.took == pytest.approx(0.011 + 0.01)
    assert clock.prefill_share() == pytest.approx(0.03 / (0.03 + 0.021))
    assert math.isnan(bench.DraftClock().prefill_share())
    # A prefill's sleep that overruns much, its overrun paid back by the token-only sleeps after it: the tokens'
    # rate stays at least the rate asked. Sharing out the prefill's sleep as asked gave the prefill 0.8 of its 15 ms
    # overrun and the tokens the whole payback: 8.3 ms a token for 10 asked.
    now[0], sleeps[:] = 0.0, []
    overrun = [0.015]

    def slow_once(seconds):
        sleeps.append(seconds)
        now[0] += seconds + (overrun.pop() if overrun else 0.0)  # the first sleep overruns, no other

    monkeypatch.setattr(bench.time, "sleep", slow_once)
    paid = bench.DraftClock()
    drafter = bench.ReplayDrafter({n: full[n:n + 8] for n in range(2, 90)}, 0.010, full, clock=paid, prefill_s=0.04)
    drafter.propose(full[:2], 1)
    for n in range(3, 9):
        drafter.propose(full[:n], 1)
    # the overrun paid back: the next token's sleep skipped, 5 ms off the one after it
    assert sleeps[:3] == [pytest.approx(0.05), pytest.approx(0.005), pytest.approx(0.010)]
    assert paid.tokens == 7 and paid.ms_per_token() >= 10.0 - 1e-9
    assert paid.ms_per_token() == pytest.approx(10.0)  # everything paid back: exactly the rate asked
    # Without a prefill (the default) the first token is like any other.
    plain = bench.ReplayDrafter({2: [2, 3]}, 0.005, full)
    sleeps.clear()
    plain.propose(full[:2], 1)
    assert sleeps == [pytest.approx(0.005)]
    # A recorded proposal of no tokens drafts nothing and sleeps nothing, and the clock counts it so (it divided 0 by
    # 0 while sharing out a prefill that was not there).
    empty_clock = bench.DraftClock()
    empty = bench.ReplayDrafter({2: []}, 0.005, full, clock=empty_clock)
    assert empty.propose(full[:2], 4).token_ids == []
    assert empty_clock.tokens == 0 and empty_clock.asked == 0 and empty_clock.prefills == 0


def test_a_prompt_prefills_the_tokens_past_what_it_shares_with_the_prompt_before_it():
    """Devices take the prompts in turn, so a request follows the prompt before it (the first follows the last);
    the drafter keeps their common prefix and prefills the rest, whose last token costs a drafting step."""
    from bench.replay import prefill_tokens

    system = [1, 2, 3, 4]
    # the first after the third, of which it is a prefix: only its last token, fed again, a drafting step
    assert prefill_tokens([system + [5, 6, 7], system + [8, 9], system + [5, 6, 7, 10]]) == [0, 1, 3]
    assert prefill_tokens([system + [5]]) == [0]  # one prompt after itself: nothing new but its last token
    assert prefill_tokens([[7, 8], [9]]) == [1, 0]


def test_measured_prefill_is_each_counted_request_s_first_token_over_a_drafting_step_per_prompt_token(monkeypatch):
    """A fake drafter whose propose costs 10 ms plus 3 ms for each context token past its KV cache but the last: the
    measure recovers 3 ms per token from the second pass (the first finds a cache from elsewhere)."""
    import bench.replay as bench

    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    class Fake:
        def __init__(self):
            self.cached = [99]

        def propose(self, context, k):
            new = len(context) - bench.common_prefix(self.cached, context)
            now[0] += 0.010 + 0.003 * max(0, new - 1)
            self.cached = list(context) + [context[-1] + 100]
            return bench.Proposal([context[-1] + 100])

    system = [1, 2, 3]
    prompts = [system + [10, 11, 12], system + [20, 21], system + [30, 31, 32, 33]]
    per, samples = bench.measure_prefill(Fake(), prompts, 0.010, tokens=4)
    assert per == pytest.approx(0.003)
    assert samples == pytest.approx([3.0, 3.0, 3.0])  # one a prompt, the second pass only


def test_first_table_takes_each_modes_median_pass_and_pairs_the_ratios_by_pass():
    """sled-bench first: per session count, each mode's row is its median pass by system tok/s, and the per-pass
    ratios pair SLED with the server-only run of the same pass, not with the median one."""
    from bench.first import first_table

    def row(drafter, p, tok_s, n=1):
        return {"drafter": drafter, "sessions": n, "pass": p, "system_tokens_per_s": tok_s, "acceptance_rate": 0.9,
                "mean_acceptance_length": 4.5, "mean_batch_sessions": float(p)}

    rows = [row("llama-cpp", 1, 30.0), row("none", 1, 40.0), row("none", 2, 20.0), row("llama-cpp", 2, 10.0),
            row("llama-cpp", 3, 50.0), row("none", 3, 25.0), row("llama-cpp", 1, 90.0, 4), row("none", 1, 45.0, 4)]
    lines = first_table(rows, [1, 4]).splitlines()
    assert len(lines) == 4
    # medians: SLED 30.0 (pass 1), server-only 25.0 (pass 3); batch columns show which pass each row came from
    assert lines[2] == "| 1 | 30.0 | 25.0 | 1.20x | 0.90 | 4.50 | 1.0 | 3.0 | 0.75x, 0.50x, 2.00x |"
    assert lines[3] == "| 4 | 90.0 | 45.0 | 2.00x | 0.90 | 4.50 | 1.0 | 1.0 | 2.00x |"
    # an even number of passes: the lower middle one
    two = first_table([row("llama-cpp", 1, 30.0), row("none", 1, 40.0), row("llama-cpp", 2, 20.0),
                       row("none", 2, 10.0)], [1]).splitlines()
    assert two[2].startswith("| 1 | 20.0 | 10.0 | 2.00x |")
