"""What scripts/bench_system.py reports from its runs: the median run per configuration, SLED / server-only per
repeat, capacity under the latency objective, and adaptive vs the best fixed K, on synthetic runs whose answers
are known."""

from __future__ import annotations

import math

import pytest

from scripts.bench_system import (drafting_bound, interpolate_cost, load_and_spread, pick_medians, report_tables,
                                  server_rate, step_cost_ratio, step_sizes)


def run(mode, n, rep, tok_s, p95=50.0, k=None, **extra):
    row = {"mode": mode, "devices": n, "repeat": rep, "system_tokens_per_s": tok_s,
           "per_device_tokens_per_s": tok_s / n, "p50_inter_token_ms": p95 / 2, "p95_inter_token_ms": p95,
           "acceptance_rate": 0.8, "mean_draft_tokens": 4.0, "drafted_ahead_share": 0.5, "server_step_ms": 40.0,
           "server_forward_ms": 38.0, "server_batch_sessions": float(n), "server_busy_share": 0.9}
    if k is not None:
        row["k"] = k
    row.update(extra)
    return row


def device_only(n, tok_s_each=60.0):
    return {"mode": "device-only", "devices": n, "system_tokens_per_s": n * tok_s_each,
            "per_device_tokens_per_s": tok_s_each, "p50_inter_token_ms": 16.7, "p95_inter_token_ms": 16.7,
            "acceptance_rate": 0.0, "mean_draft_tokens": 0.0, "server_step_ms": 0.0, "server_forward_ms": 0.0,
            "server_batch_sessions": 0.0, "server_busy_share": 0.0}


def synthetic_runs():
    """Two device counts, three repeats each, stored out of repeat order (as a reversed pass finishes)."""
    runs = {}
    for n, base, p95_sled, p95_server in ((4, 100.0, 40.0, 90.0), (16, 200.0, 120.0, 200.0)):
        runs[(n, "server-only")] = [run("server-only", n, r, base + d, p95_server) for r, d in ((2, 5), (0, 0), (1, -10))]
        for mode, scale in (("2", 1.2), ("4", 1.6), ("8", 1.4), ("adaptive", 1.5), ("no-ahead", 1.1)):
            name = {"adaptive": "sled", "no-ahead": "sled-no-ahead"}.get(mode, f"sled-k{mode}")
            runs[(n, mode)] = [run(name, n, r, (base + d) * scale, p95_sled, k=mode)
                               for r, d in ((1, -10), (2, 5), (0, 0))]
    return runs


def test_median_run_and_per_repeat_ratios_paired_by_repeat():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    assert [(r["mode"], r["devices"]) for r in rows] == [("server-only", 4), ("sled", 4), ("server-only", 16),
                                                         ("sled", 16)]
    server4, sled4 = rows[0], rows[1]
    assert server4["system_tokens_per_s"] == 100.0 and server4["repeat"] == 0  # the middle of 90, 100, 105
    assert server4["repeats_system_tokens_per_s"] == [100.0, 90.0, 105.0]  # repeat order
    assert sled4["system_tokens_per_s"] == pytest.approx(150.0)
    # each repeat against server-only's same repeat: 1.5x every time, whatever order the runs were stored in
    assert sled4["repeats_ratio_to_server_only"] == pytest.approx([1.5, 1.5, 1.5])
    assert [r["k"] for r in adaptive_rows if r["devices"] == 4] == ["2", "4", "8", "adaptive"]
    assert [(r["mode"], r["devices"]) for r in waiting_rows] == [("sled-no-ahead", 4), ("sled-no-ahead", 16)]


def test_tables_give_ratio_capacity_and_the_adaptive_verdict():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    t = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)
    sled16 = next(line for line in t["main"] if line.startswith("| 16 | sled |"))
    assert "| 300.0 |" in sled16 and "| 1.50x |" in sled16
    # p95: sled 40 and 120 ms, server-only 90 and 200 ms, device-only 16.7 ms, against 150 ms
    assert t["capacity"] == {"sled": 16, "server-only": 4, "device-only": 16}
    assert t["verdicts"][0] == ("4 devices: adaptive 150.0 tok/s vs best fixed K=4 160.0 (0.94x); "
                                "pass by pass 0.94x, 0.94x, 0.94x, median 0.94x")
    ahead4 = next(line for line in t["ahead"] if line.startswith("| 4 |"))
    assert "| 150.0 | 110.0 | 1.36x | 50% |" in ahead4
    assert "2.0 of 40.0 ms (5.0%)" in t["overhead"]  # step 40 ms, forward 38 ms, at 16 devices
    # device-only 4 x 60 and 16 x 60 tok/s against server-only's 100 and 200; a step of 40 ms is longer than a
    # drafting step (1/60 s, r·s 2.4), so a round's free token (the correction or the bonus) gains nothing over
    # drafting it: the drafters' own rate is the bound
    assert t["bound"].endswith("4 devices 2.40x (K 4.00, r·s 2.40), 16 devices 4.80x (K 4.00, r·s 2.40)\n")


def test_the_drafting_bound_counts_a_round_s_free_token_only_where_a_step_is_shorter_than_drafting_one():
    # 4 devices drafting 60 tok/s each, drafts of 4 tokens
    assert drafting_bound(240.0, 4.0, 4, 0.0) == pytest.approx(300.0)  # an instant server: 4 drafted commit 5
    assert drafting_bound(240.0, 4.0, 4, 5.0) == pytest.approx(240.0 * (1 + 0.7 / 4))  # r·s 0.3: 0.7 of it
    assert drafting_bound(240.0, 4.0, 4, 1000.0 / 60) == pytest.approx(240.0)  # a step as long as a drafting step
    assert drafting_bound(240.0, 4.0, 4, 40.0) == pytest.approx(240.0)
    assert math.isnan(drafting_bound(240.0, 0.0, 4, 5.0))  # no draft made: a starved run


def test_no_count_within_the_objective_gives_capacity_zero():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    t = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=10.0)
    assert t["capacity"] == {"sled": 0, "server-only": 0, "device-only": 0}


def test_adaptive_verdict_pairs_each_pass_with_the_best_fixed_k_of_that_pass():
    """Passes that drift: the median runs fall on different passes (adaptive's on pass 1, K=4's on pass 2), so
    their ratio (1.00x) differs from the pass-by-pass one, which pairs runs of the same pass whatever order they
    were stored in."""
    by_pass = {"server-only": [100.0, 60.0, 100.0], "2": [100.0, 60.0, 100.0], "4": [160.0, 100.0, 150.0],
               "8": [120.0, 80.0, 120.0], "adaptive": [150.0, 90.0, 160.0], "no-ahead": [100.0, 60.0, 100.0]}
    runs = {}
    for mode, values in by_pass.items():
        name = {"server-only": "server-only", "adaptive": "sled", "no-ahead": "sled-no-ahead"}.get(mode, f"sled-k{mode}")
        extra = {} if mode == "server-only" else {"k": mode}
        runs[(4, mode)] = [run(name, 4, rep, values[rep], **extra) for rep in (2, 0, 1)]
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    t = report_tables([4], rows + [device_only(4)], adaptive_rows, waiting_rows, slo_ms=150.0)
    # best fixed K by its median run: K=4 (150) over K=8 (120) and K=2 (100); per pass 150/160, 90/100, 160/150
    assert t["verdicts"] == ["4 devices: adaptive 150.0 tok/s vs best fixed K=4 150.0 (1.00x); "
                             "pass by pass 0.94x, 0.90x, 1.07x, median 0.94x"]


def test_the_stolen_line_gives_the_median_and_the_worst_run_with_its_pass():
    runs = synthetic_runs()
    for (n, mode), done in runs.items():
        for r in done:  # 1% everywhere, but 30% on 16 devices' K=8 run of the second pass (repeat 1)
            r["host_cpu_stolen_share"] = 0.30 if (n, mode, r["repeat"]) == (16, "8", 1) else 0.01
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    rows += [device_only(4), device_only(16)]
    t = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)
    # 2 counts x 6 configurations x 3 passes
    assert t["stolen"].startswith("- host CPU time taken by the hypervisor (steal, /proc/stat) during the windows: "
                                  "median 1.0% over 36 runs, highest 30.0% (16 devices, sled-k8, pass 2)")


def test_no_stolen_counts_give_no_stolen_line():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    assert report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)["stolen"] == ""


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
    import scripts.bench_system as bench

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


def test_the_server_side_counts_tokens_per_second_of_server_step_time():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    # 4 devices: SLED 150 tok/s with the server busy 75% of the window, server-only 100 tok/s busy 80%: never idle,
    # at the same steps, they would commit 200 and 125 tok/s, so without cheaper steps SLED / server-only can reach
    # 1.60x, however fast the devices draft (the measured 1.50x only because SLED left the server idler)
    by = {(r["mode"], r["devices"]): r for r in rows}
    by[("sled", 4)]["server_busy_share"], by[("server-only", 4)]["server_busy_share"] = 0.75, 0.8
    t = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)
    assert "4 devices sled 200.0, server-only 125.0 (1.60x), 16 devices sled 333.3, server-only 222.2 (1.50x)\n" \
        == t["server_side"].split("draft: ")[1]
    assert math.isnan(server_rate(device_only(4)))  # a server never busy commits nothing per second of its steps


COSTS = {1: 10.0, 4: 10.0, 8: 12.0, 16: 16.0, 32: 32.0}  # flat to 4 tokens, then 0.5 ms a token to 16, then 1 ms


def test_step_cost_is_interpolated_between_the_sizes_timed_and_extended_past_them():
    assert interpolate_cost(COSTS, 4.5) == pytest.approx(10.25)
    assert interpolate_cost(COSTS, 24) == pytest.approx(24.0)
    assert interpolate_cost(COSTS, 40) == pytest.approx(40.0)  # along 16 -> 32
    assert interpolate_cost({4: 7.0}, 12) == 7.0


def test_the_ratio_at_the_steps_cost_alone():
    """Server-only at 4.5 tokens a step and 4 committed spends c(4.5) / 4 = 2.5625 ms a committed token; SLED,
    forwarding 16.5 tokens a step for 13.2 committed (F = 1.25), at best 1 ms a forwarded token (16 tokens, where
    4 devices' drafts reach), so at those costs SLED / server-only is 2.5625 / 1.25 = 2.05x. One device's drafts fill
    at most 9 tokens a step: there the best is 8 tokens at 1.5 ms, and the ratio 2.5625 / 1.875."""
    base = {"server_step_tokens": 4.5, "server_committed_per_step": 4.0}
    sled = {"server_step_tokens": 16.5, "server_committed_per_step": 13.2}
    at_cost, base_ms, sled_ms, best_n = step_cost_ratio(COSTS, sled, base, devices=4)
    assert (base_ms, sled_ms, best_n) == (pytest.approx(2.5625), pytest.approx(1.0), 16)
    assert at_cost == pytest.approx(2.05)
    at_cost, _, sled_ms, best_n = step_cost_ratio(COSTS, sled, base, devices=1)
    assert (sled_ms, best_n) == (pytest.approx(1.5), 8)
    assert at_cost == pytest.approx(2.5625 / 1.875)
    # a starved run (nothing committed in its window) gives nan, as the tables show it, and raises nothing
    starved = {"server_step_tokens": 0.0, "server_committed_per_step": 0.0}
    assert math.isnan(step_cost_ratio(COSTS, starved, base, devices=4)[0])
    assert math.isnan(step_cost_ratio(COSTS, sled, starved, devices=4)[0])


def test_the_report_gives_the_ratio_at_cost_alone_for_each_timing_of_the_steps_alone():
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    for r in rows:
        if r["mode"] in ("sled", "server-only"):
            r["server_step_tokens"], r["server_committed_per_step"] = ((16.5, 13.2) if r["mode"] == "sled"
                                                                       else (4.5, 4.0))
    slower = {n: 2 * c for n, c in COSTS.items()}  # everything twice as slow: the same ratio at 4 devices
    t = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0,
                      costs=[("before the runs", COSTS), ("after them", slower)])
    assert "(ms at n tokens; before the runs: 1 10.0, 4 10.0, 8 12.0, 16 16.0, 32 32.0; after them: 1 20.0, " in t["alone"]
    assert ("4 devices: server-only 4.5 tokens a step, 4.0 committed; SLED 1.25 forwarded per committed; at the cost alone "
            "before the runs 2.05x (server-only 2.56 ms per committed token; SLED 1.00 ms per forwarded token at 16), "
            "after them 2.05x (server-only 5.12 ms per committed token; SLED 2.00 ms per forwarded token at 16); "
            "measured 1.50x; 16 devices: ") in t["alone"]
    assert report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)["alone"] == ""


def test_the_devices_cpu_line_gives_each_count_s_reported_runs():
    runs = synthetic_runs()
    for (n, mode), done in runs.items():
        for r in done:  # the median runs are repeat 0; other repeats carry figures that must not show
            r["devices_cpu_cores"] = (0.12 if mode == "adaptive" else 0.08 if mode == "server-only" else 0.5) \
                if r["repeat"] == 0 else 0.9
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    rows += [device_only(4), device_only(16)]
    line = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)["devices_cpu"]
    assert line.startswith("- CPU the replayed devices took on this host during the reported runs")
    assert line.endswith(": 4 devices sled 0.12, server-only 0.08; 16 devices sled 0.12, server-only 0.08\n")
    for r in rows:
        r.pop("devices_cpu_cores", None)  # rows from before the field: no line
    assert report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)["devices_cpu"] == ""


def test_step_sizes_count_a_step_once_over_the_verdicts_of_its_sessions():
    """Each verdict reports its step's (tokens, ms, sessions): two sessions' verdicts of one 16-token step make one
    step, and a third verdict of a 16-token step whose other session's round fell outside the window half of one."""
    steps = [(16, 30.0, 2), (16, 30.0, 2), (4, 20.0, 1), (4, 22.0, 1), (16, 34.0, 2)]
    assert step_sizes(steps) == [[4, 2.0, 21.0], [16, 1.5, pytest.approx(94 / 3)]]
    assert step_sizes([]) == []


def test_load_and_spread_part_a_run_s_steps_from_their_cost_alone():
    """With COSTS, one step of 1 token and one of 16 cost 10 + 16 = 26 ms alone; two steps of their mean size, 8.5
    tokens, 2 x 12.25 = 24.5: the spread 26 / 24.5. Taking 15 and 24 ms under load, 39 ms: the load 39 / 26."""
    load, spread, mean = load_and_spread(COSTS, [[1, 1.0, 15.0], [16, 1.0, 24.0]])
    assert (load, spread, mean) == (pytest.approx(1.5), pytest.approx(26 / 24.5), pytest.approx(8.5))
    load, spread, mean = load_and_spread(COSTS, [[4, 3.0, 10.0]])  # one size, at its cost alone
    assert (load, spread, mean) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(4.0))
    assert all(math.isnan(x) for x in load_and_spread(COSTS, []))


def test_the_report_gives_each_mode_s_load_and_spread_for_each_timing_of_the_steps_alone():
    runs = synthetic_runs()
    for (n, mode), done in runs.items():
        for r in done:  # the median runs are repeat 0; the others carry sizes that must not show
            sizes = [[1, 1.0, 15.0], [16, 1.0, 24.0]] if mode == "adaptive" else [[4, 3.0, 10.0]]
            r["server_step_sizes"] = sizes if r["repeat"] == 0 else [[32, 1.0, 99.0]]
            r["server_step_tokens"], r["server_committed_per_step"] = 4.5, 4.0
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    rows += [device_only(4), device_only(16)]
    slower = {n: 2 * c for n, c in COSTS.items()}
    alone = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0,
                          costs=[("before the runs", COSTS), ("after them", slower)])["alone"]
    line = alone.splitlines()[-1]
    assert line.startswith("- the steps under load against the steps' cost alone")
    assert line.endswith(
        ": 4 devices: sled (steps of 8.5 tokens) 1.50x and 1.06x before the runs, 0.75x and 1.06x after them; "
        "server-only (steps of 4.0 tokens) 1.00x and 1.00x before the runs, 0.50x and 1.00x after them; "
        "16 devices: sled (steps of 8.5 tokens) 1.50x and 1.06x before the runs, 0.75x and 1.06x after them; "
        "server-only (steps of 4.0 tokens) 1.00x and 1.00x before the runs, 0.50x and 1.00x after them")
    for r in rows:
        r.pop("server_step_sizes", None)  # rows from before the field: no such line
    alone = report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0, costs=[("before the runs", COSTS)])
    assert "the steps under load" not in alone["alone"]


def test_reply_figures_take_the_median_and_90th_percentile_of_the_answered_verdicts():
    from scripts.bench_system import reply_figures

    nan = float("nan")
    replies = [(nan, nan)] + [(float(ms), float(ms) / 2) for ms in range(1, 11)]  # a first round answers nothing
    got = reply_figures(replies)
    assert got["device_reply_ms"] == pytest.approx([5.5, 9.1])
    assert got["device_reply_drafting_ms"] == pytest.approx([2.75, 4.55])
    assert reply_figures([(nan, nan)]) == {"device_reply_ms": None, "device_reply_drafting_ms": None}
    assert reply_figures([]) == {"device_reply_ms": None, "device_reply_drafting_ms": None}


def reported_by(fields) -> tuple[dict, list[dict]]:
    """synthetic_runs() with `fields(mode, median)` set on every run (the median runs are repeat 0; the other
    repeats' figures must not show), reported at 4 and 16 devices: the rows by (mode, count), and the rows, which a
    test may edit and report again with rereport()."""
    runs = synthetic_runs()
    for (n, mode), done in runs.items():
        for r in done:
            r.update(fields(mode, r["repeat"] == 0))
    picked = pick_medians(runs)
    return rereport(picked), picked


def rereport(picked) -> dict:
    rows, adaptive_rows, waiting_rows = picked
    return report_tables([4, 16], rows + [device_only(4), device_only(16)], adaptive_rows, waiting_rows,
                         slo_ms=150.0)["by"]


def test_the_reply_line_gives_each_count_s_reported_runs_against_the_batching_window():
    from scripts.bench_system import reply_line

    by, picked = reported_by(lambda mode, median: {
        "device_reply_ms": [4.0, 9.0] if median and mode == "adaptive" else [0.5, 1.5] if median else [99, 99],
        "device_reply_drafting_ms": [3.0, 8.0] if median and mode == "adaptive" else [0.0, 0.0]})
    line = reply_line([4, 16], by, 3.0)
    assert "the server's batching window was 3 ms: " in line
    assert line.endswith(": 4 devices sled 4.0 / 9.0 (3.0 / 8.0), server-only 0.5 / 1.5 (0.0 / 0.0); "
                         "16 devices sled 4.0 / 9.0 (3.0 / 8.0), server-only 0.5 / 1.5 (0.0 / 0.0)\n")
    for r in picked[0]:
        r.pop("device_reply_ms", None)  # rows from before the field: no line
    assert reply_line([4, 16], rereport(picked), 3.0) == ""


def test_queue_figures_give_the_share_of_drafts_that_waited_through_a_step_and_their_median_wait():
    from scripts.bench_system import queue_figures

    got = queue_figures([0.0, 0.0, 12.0, 0.0, 30.0, 20.0, 0.0, 0.0])
    assert got == {"queued_drafts_share": 0.375, "queued_drafts_wait_ms": 20.0}
    assert queue_figures([0.0, 0.0]) == {"queued_drafts_share": 0.0, "queued_drafts_wait_ms": None}
    assert queue_figures([]) == {"queued_drafts_share": None, "queued_drafts_wait_ms": None}


def test_the_queued_line_gives_each_count_s_reported_runs():
    from scripts.bench_system import queued_line

    by, picked = reported_by(lambda mode, median: {
        "queued_drafts_share": (0.55 if mode == "adaptive" else 0.1) if median else 0.99,
        "queued_drafts_wait_ms": (25.0 if mode == "adaptive" else None) if median else 99.0})
    line = queued_line([4, 16], by)
    assert line.startswith("- drafts that reached the server while another step ran")
    assert line.endswith("queue_ms): 4 devices sled 55% (25.0 ms), server-only 10%; "
                         "16 devices sled 55% (25.0 ms), server-only 10%\n")
    for r in picked[0]:
        r.pop("queued_drafts_share", None)  # rows from before the field: no line
    assert queued_line([4, 16], rereport(picked)) == ""


def test_the_answer_table_sets_answering_at_once_against_finishing_first_pass_by_pass():
    """`sled` against `sled-finish-first` (the device that finished its token before answering a verdict): the median
    runs' tok/s and ratio, sessions a step and median reply of each, and the ratio of each pass; the no-ahead table
    keeps its own rows, and without finish-first rows there is no table."""
    runs = synthetic_runs()
    for n in (4, 16):
        for r in runs[(n, "adaptive")]:
            r["device_reply_ms"] = [0.2, 0.9]
        runs[(n, "finish-first")] = [run("sled-finish-first", n, rep, tok, k="finish-first",
                                         server_batch_sessions=n / 2, device_reply_ms=[9.1, 40.0])
                                     for rep, tok in ((1, 90.0), (2, 150.0), (0, 100.0))]
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    t = report_tables([4, 16], rows + [device_only(4), device_only(16)], adaptive_rows, waiting_rows, slo_ms=150.0)
    # sled at 4 devices: 150 (pass 0), 135 (pass 1), 157.5 (pass 2); finishing first 100, 90, 150
    assert t["answer"][2] == "| 4 | 150.0 | 100.0 | 1.50x | 4.0 / 2.0 | 0.2 / 9.1 | 1.50x, 1.50x, 1.05x |"
    assert [line.split(" |")[0] for line in t["ahead"][2:]] == ["| 4", "| 16"]  # no-ahead rows only
    assert "| 150.0 | 110.0 | 1.36x |" in t["ahead"][2]
    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    assert report_tables([4, 16], rows + [device_only(4), device_only(16)], adaptive_rows, waiting_rows,
                         slo_ms=150.0)["answer"] == []


def test_the_afresh_table_sets_an_empty_draft_after_a_miss_against_drafting_k_afresh():
    """`sled` against `sled-afresh-after-miss` (the device that drafted K afresh after every miss), in its own table
    with its own column names, apart from the finish-first table (none here) and the no-ahead one."""
    runs = synthetic_runs()
    for n in (4, 16):
        for r in runs[(n, "adaptive")]:
            r["device_reply_ms"] = [0.2, 0.9]
        runs[(n, "afresh-after-miss")] = [run("sled-afresh-after-miss", n, rep, tok, k="afresh-after-miss",
                                              server_batch_sessions=n * 0.75, device_reply_ms=[0.3, 30.0])
                                          for rep, tok in ((1, 120.0), (2, 140.0), (0, 125.0))]
    rows, adaptive_rows, waiting_rows = pick_medians(runs)
    t = report_tables([4, 16], rows + [device_only(4), device_only(16)], adaptive_rows, waiting_rows, slo_ms=150.0)
    assert t["afresh"][0].startswith("| devices | empty draft tok/s | drafted afresh tok/s | ratio |")
    # sled at 4 devices: 150 (pass 0), 135 (pass 1), 157.5 (pass 2); afresh 125, 120, 140 (median 125)
    assert t["afresh"][2] == "| 4 | 150.0 | 125.0 | 1.20x | 4.0 / 3.0 | 0.2 / 0.3 | 1.20x, 1.12x, 1.12x |"
    assert t["answer"] == []
    assert [line.split(" |")[0] for line in t["ahead"][2:]] == ["| 4", "| 16"]


def test_drafting_use_splits_the_window_into_drafting_idle_at_request_ends_and_idle_inside():
    """A window of 10 s from t=100: the drafter drafts 100-103 and 104-106 in one request, whose final verdict comes at
    106.5, and 108-112 in the next (past the window's end at 110). Busy 3 + 2 + 2 = 7 s; the gap holding the final
    verdict, 106-108, is idle at a request's end (2 s); 103-104 is idle inside the request (1 s)."""
    from scripts.bench_system import drafting_use

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


def test_the_drafting_line_gives_busy_idle_and_what_each_drafted_token_brought():
    from scripts.bench_system import drafting_use_line

    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    by = {(r["mode"], r["devices"]): r for r in rows}
    # 4 devices: sled commits 150 tok/s, 37.5 a device; its drafters reached 10 ms/token (100 tok/s) and drafted
    # 75% of the window: 75 tokens' drafting time a second brought 37.5 committed, 0.50 each
    by[("sled", 4)].update(drafting_busy_share=0.75, drafting_idle_at_request_ends_share=0.2, drafting_ms_per_token=10.0)
    line = drafting_use_line([4, 16], by)
    assert line.endswith(": 4 devices busy 75%, idle 20% around requests' ends and 5% inside them, 0.50 committed "
                         "per token drafted (100.0 × 0.75 × 0.50 = 37.5 tok/s a device)\n")
    assert "16 devices" not in line  # a row without the record (from before it) is left out
    assert report_tables([4, 16], rows, adaptive_rows, waiting_rows, slo_ms=150.0)["drafting"] == line
    del by[("sled", 4)]["drafting_busy_share"]
    assert drafting_use_line([4, 16], by) == ""


def test_a_replayed_request_spends_its_prompt_s_prefill_once_before_its_first_token(monkeypatch):
    """A real drafter feeds a new request's prompt (past the system prompt its KV cache kept) at its first propose:
    the replay sleeps that time once, before the first token's, and the clock keeps it apart from the tokens', so
    the per-token figure stays the drafting rate. An overrun of the prefill's sleep is carried like any other."""
    import scripts.bench_system as bench

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
    from scripts.bench_system import prefill_tokens

    system = [1, 2, 3, 4]
    # the first after the third, of which it is a prefix: only its last token, fed again, a drafting step
    assert prefill_tokens([system + [5, 6, 7], system + [8, 9], system + [5, 6, 7, 10]]) == [0, 1, 3]
    assert prefill_tokens([system + [5]]) == [0]  # one prompt after itself: nothing new but its last token
    assert prefill_tokens([[7, 8], [9]]) == [1, 0]


def test_measured_prefill_is_each_counted_request_s_first_token_over_a_drafting_step_per_prompt_token(monkeypatch):
    """A fake drafter whose propose costs 10 ms plus 3 ms for each context token past its KV cache but the last: the
    measure recovers 3 ms per token from the second pass (the first finds a cache from elsewhere)."""
    import scripts.bench_system as bench

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


def test_device_only_pays_each_request_s_prefill_and_the_section_says_what_was_charged():
    from scripts.bench_system import device_only_rate, prefill_line

    # 64 tokens at 10 ms and prefills of 40 and 20 ms (30 on average): 64 tokens in 670 ms
    assert device_only_rate(0.010, [0.04, 0.02], 64) == pytest.approx(64 / 0.67)
    assert device_only_rate(0.010, [], 64) == pytest.approx(100.0)
    line = prefill_line([10, 17, 12], 2.9, "measured here")
    assert "2.90 ms per prompt token" in line and "(measured here)" in line and "10-17 tokens a prompt" in line
    assert line.endswith("so 29-49 ms a request\n")
    assert "not charged" in prefill_line([10, 17], 0.0, None)


def test_the_drafting_line_takes_the_prompts_prefill_off_the_time_busy_on_tokens():
    from scripts.bench_system import drafting_use_line

    rows, adaptive_rows, waiting_rows = pick_medians(synthetic_runs())
    rows += [device_only(4), device_only(16)]
    by = {(r["mode"], r["devices"]): r for r in rows}
    # busy 75% of the window, a fifth of it prefilling: 60% on tokens at 100 tok/s brought 37.5, 0.625 each
    by[("sled", 4)].update(drafting_busy_share=0.75, drafting_idle_at_request_ends_share=0.2, drafting_ms_per_token=10.0,
                           drafting_prefill_share=0.2)
    line = drafting_use_line([4, 16], by)
    assert line.endswith(": 4 devices busy 75% (15% of the window prefilling prompts), idle 20% around requests' ends "
                         "and 5% inside them, 0.62 committed per token drafted (100.0 × 0.60 × 0.62 = 37.5 tok/s a "
                         "device)\n")


def test_the_link_line_names_the_link_and_its_relay_s_cpu():
    from scripts.bench_system import link_line
    from scripts.linkemu import LinkSpec

    by = {("sled", 4): {"link_cpu_cores": 0.031}, ("server-only", 4): {"link_cpu_cores": 0.052},
          ("sled", 32): {"link_cpu_cores": None}, ("server-only", 32): {"link_cpu_cores": 0.2}}
    line = link_line(LinkSpec(delay_ms=20, jitter_ms=5, rate_mbit=50), [4, 32], by)
    assert line.startswith("- network: each device reached the server over its own emulated link, 20 ms ± 5 ms each "
                           "way, 50 Mbit/s (`--link`")
    assert "a round trip takes about 40 ms more than on loopback" in line
    assert line.endswith(": 4 devices sled 0.03, server-only 0.05\n")  # 32 devices: a run without the figure
    assert link_line(None, [4], by) == ""  # loopback: no line


def test_bench_system_refuses_a_bad_link_before_starting_anything():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_system.py"
    for argv, message in ((["--link", "latency=3"], "--link: unknown link setting 'latency'"),
                          (["--link", "delay_ms=-1"], "--link: link settings must be positive"),
                          (["--link", "delay_ms=5", "--match-only"], "--match-only records along loopback")):
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_first_table_takes_each_modes_median_pass_and_pairs_the_ratios_by_pass():
    """bench_first.py: per session count, each mode's row is its median pass by system tok/s, and the per-pass
    ratios pair SLED with the server-only run of the same pass, not with the median one."""
    from scripts.bench_first import first_table

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
