"""sled-bench fleet's model: acceptance by position from recorded drafts, the roofline's arithmetic, a step cost
recovered by its fit, and the fleet's behaviour where the answer is known (a server-only token a step, SLED bounded
by its drafting, the KV pool as a bound)."""

import math

import pytest

from bench.fleet import (GPUS, SHAPES, Devices, Fleet, LinearCost, Roofline, Server, Workload,
                         acceptance_by_position, capacity, fit_cost, fit_gap, speed_of)

WORK = Workload(prompts=(40, 50), cached=20, tokens=32)


def test_acceptance_by_position_counts_each_position_after_the_ones_before_it_were_right():
    full = [0, 1, 2, 3, 4, 5, 6]
    tables = [{2: [2, 3, 9], 3: [3, 9, 5], 4: [9, 5, 6]}]  # right 2, right 1, right 0 tokens
    got = acceptance_by_position(tables, [full], k=3)
    assert got == pytest.approx((2 / 3, 1 / 2, 0.0))


def test_a_replayed_draft_is_judged_along_its_prompts_text():
    import random

    full = [0, 1, 2, 3, 4, 5, 6, 7]
    table = {2: [2, 3, 4], 3: [3, 9, 5], 5: [5, 6, 7]}
    devices = Devices(0.01, 0.0, (0.0,), replay=((table, full),))
    rng = random.Random(0)
    assert devices.judge(0, 2, 2, rng) == (2, True)  # both right, and the drafter's next token (4) is the text's
    assert devices.judge(0, 3, 3, rng) == (1, False)  # the second token is wrong
    assert devices.judge(0, 5, 3, rng) == (3, False)  # all right; past what was recorded the bonus is drawn (0.0)
    assert devices.judge(2, 2, 1, rng) == (1, True)  # prompts past the recorded ones wrap around
    assert devices.judge(0, 4, 3, rng) == (0, False)  # no draft recorded here: drawn by position (0.0)
    sure = Devices(0.01, 0.0, (1.0,))  # nothing replayed: drawn by position
    assert sure.judge(0, 4, 3, rng) == (3, True)


def test_a_fleet_replaying_its_prompts_meets_each_prompts_own_misses():
    """Two prompts, one whose drafts are all right and one whose drafts all miss at their first token, on a server
    whose step is slow beside the drafting: replayed, the second prompt's requests commit a token a step and set the
    p95 TPOT; drawn at the pooled acceptance by position instead, every request meets misses alike."""
    lens, tokens = (40, 50), 32
    fulls = [list(range(n + tokens + 1)) for n in lens]
    right = {n: fulls[0][n:n + 8] for n in range(lens[0], lens[0] + tokens)}
    wrong = {n: [-1] * 8 for n in range(lens[1], lens[1] + tokens)}
    accept = acceptance_by_position([right, wrong], fulls)
    server = Server(LinearCost(0.020, 0.0, 0.0), kv_tokens=10 ** 6, window_s=0.001)
    replayed = Fleet("sled", 2, Devices(0.002, 0.0, accept, replay=((right, fulls[0]), (wrong, fulls[1]))),
                     WORK, server).run(30.0, 2.0)
    drawn = Fleet("sled", 2, Devices(0.002, 0.0, accept), WORK, server).run(30.0, 2.0)
    assert replayed["p95_tpot_ms"] >= 20.0  # a token a step
    assert replayed["p95_tpot_ms"] > 1.5 * drawn["p95_tpot_ms"]


def test_the_roofline_reads_the_weights_once_a_step_and_splits_them_over_tensor_parallel():
    h200, b8, b70 = GPUS["h200"], SHAPES["llama-8b"], SHAPES["llama-70b"]
    assert b8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    one = Roofline(h200, b8)(1, 1, 0)
    assert one == pytest.approx(b8.weight_bytes / 4.8e12 + h200.launch_ms / 1000)
    # past the ridge, FLOPs decide: 4096 tokens cost 2 * params * 4096 / peak
    assert Roofline(h200, b8)(4096, 1, 0) == pytest.approx(2 * 8.03e9 * 4096 / 989e12 + h200.launch_ms / 1000)
    tp = Roofline(h200, b70, tp=4)
    assert tp(1, 1, 0) == pytest.approx(b70.weight_bytes / 4 / 4.8e12 + h200.launch_ms / 1000
                                        + 2 * 80 * h200.allreduce_us * 1e-6)
    assert tp.kv_tokens() == int((141e9 * 4 * 0.9 - b70.weight_bytes) / b70.kv_bytes_per_token)


def test_the_step_cost_fit_recovers_its_coefficients():
    truth = LinearCost(0.012, 0.0004, 0.0007)
    rows = [{"server_step_tokens": t, "server_batch_sessions": s, "server_step_ms": truth(t, s, 0) * 1000}
            for t, s in ((2, 1), (10, 2), (30, 4), (60, 8), (120, 16), (45, 3))]
    fit = fit_cost(rows)
    assert (fit.fixed_s, fit.token_s, fit.session_s) == pytest.approx((0.012, 0.0004, 0.0007), rel=1e-6)


def test_server_only_gets_a_token_a_step():
    server = Server(LinearCost(0.010, 0.0, 0.0), kv_tokens=10 ** 6, window_s=0.003)
    row = Fleet("server-only", 1, Devices(0.01, 0.0, (1.0,), rtt_s=0.0002), WORK, server).run(30.0, 2.0)
    assert row["p50_tpot_ms"] == pytest.approx(10.0, rel=0.01)
    # a request is a prefill step, then a step a token
    assert row["system_tokens_per_s"] == pytest.approx(100 * 32 / 33, rel=0.05)


def test_sled_commits_what_is_drafted_and_never_beats_its_drafting():
    fast = Server(LinearCost(0.001, 0.0, 0.0), kv_tokens=10 ** 6, window_s=0.001)
    sure = Fleet("sled", 1, Devices(0.010, 0.0, (1.0,), rtt_s=0.0002), WORK, fast).run(30.0, 2.0)
    # every token accepted: the device commits about a token per drafting step (the verdict's bonus adds some)
    assert 90 <= sure["system_tokens_per_s"] <= 200
    wrong = Fleet("sled", 1, Devices(0.010, 0.0, (0.0,), rtt_s=0.0002), WORK, fast).run(30.0, 2.0)
    assert wrong["system_tokens_per_s"] < 0.6 * sure["system_tokens_per_s"]


def test_a_launch_bound_server_favours_sled_and_a_slow_drafter_favours_server_only():
    launch_bound = Server(LinearCost(0.030, 0.00001, 0.0), kv_tokens=10 ** 6)
    quick, slow = Devices(0.004, 0.001, (0.95,)), Devices(0.120, 0.03, (0.95,))
    sled = Fleet("sled", 8, quick, WORK, launch_bound).run(30.0, 2.0)
    base = Fleet("server-only", 8, quick, WORK, launch_bound).run(30.0, 2.0)
    assert sled["system_tokens_per_s"] > 2 * base["system_tokens_per_s"]
    lagging = Fleet("sled", 8, slow, WORK, launch_bound).run(30.0, 2.0)
    assert lagging["system_tokens_per_s"] < base["system_tokens_per_s"]


def test_the_kv_pool_bounds_the_count_and_is_named():
    server = lambda n: Server(LinearCost(0.001, 0.0, 0.0), kv_tokens=5 * WORK.slot(), window_s=0.001)  # noqa: E731
    rows, caps = capacity(Devices(0.005, 0.001, (0.9,)), WORK, server, {"p95_tpot_ms": 1e9, "p95_ttft_ms": 1e9},
                          seconds=5.0)
    assert [c["bound"] for c in caps] == ["kv memory", "kv memory"]
    # 8 devices do not fit: the counts between 4 and 8 are bisected to the last that does
    assert [c["devices"] for c in caps] == [5, 5] and max(r["devices"] for r in rows) == 5
    assert all(not math.isnan(r["p95_tpot_ms"]) for r in rows)


def test_the_hosts_gap_between_steps_comes_from_server_only_rows_and_slows_every_step():
    rows = [{"mode": "server-only", "server_step_ms": 10.0, "server_busy_share": 0.5, "server_batch_sessions": 1.0},
            {"mode": "server-only", "server_step_ms": 20.0, "server_busy_share": 0.5, "server_batch_sessions": 5.0},
            {"mode": "sled", "server_step_ms": 10.0, "server_busy_share": 0.1,  # SLED's server waits for drafts
             "server_batch_sessions": 3.0}]
    assert fit_gap(rows) == pytest.approx((0.0075, 0.0025))  # 10 ms at 1 session, 20 ms at 5
    devices = Devices(0.01, 0.0, (1.0,), rtt_s=0.0002)
    tight = Server(LinearCost(0.010, 0.0, 0.0), kv_tokens=10 ** 6)
    loose = Server(LinearCost(0.010, 0.0, 0.0), kv_tokens=10 ** 6, gap_s=0.005)
    assert Fleet("server-only", 1, devices, WORK, loose).run(20.0, 2.0)["p50_tpot_ms"] == pytest.approx(15.0, rel=0.01)
    assert Fleet("server-only", 1, devices, WORK, tight).run(20.0, 2.0)["p50_tpot_ms"] == pytest.approx(10.0, rel=0.01)


def test_the_fit_weighs_each_step_size_by_its_steps_where_the_rows_report_them():
    rows = [{"server_step_sizes": [[1, 50.0, 10.5], [5, 20.0, 12.5]]}, {"server_step_sizes": [[9, 5.0, 14.5]]}]
    fit = fit_cost(rows)
    assert (fit.fixed_s, fit.token_s) == pytest.approx((0.010, 0.0005), rel=1e-6)


def test_the_fit_finds_a_floor_under_its_line_where_small_steps_cost_the_same():
    # a CPU step: the weights' read (18 ms) until the arithmetic passes it, then 6 ms + 1.5 ms a token
    truth = LinearCost(0.006, 0.0015, 0.0, 0.018)
    sizes = [[t, n, truth(t, 0, 0) * 1000] for t, n in ((1, 400), (2, 300), (4, 500), (8, 200), (16, 90), (30, 20),
                                                         (48, 8), (64, 5))]
    fit = fit_cost([{"server_step_sizes": sizes}])
    assert (fit.floor_s, fit.fixed_s, fit.token_s) == pytest.approx((0.018, 0.006, 0.0015), rel=1e-6)
    # a line alone would put a one-token step far under its 18 ms
    line = fit_cost([{"server_step_ms": ms, "server_step_tokens": t, "server_batch_sessions": 1}
                     for t, _, ms in sizes])
    assert line(1, 1, 0) < 0.9 * truth(1, 1, 0)


def test_a_count_run_while_the_host_was_slower_gets_its_own_speed_against_the_fit():
    fit = LinearCost(0.006, 0.0015, 0.0, 0.018)
    slow = {"server_step_sizes": [[1, 30.0, 18 * 1.25], [40, 10.0, 66 * 1.25]]}  # every step 1.25x the fit's
    assert speed_of(slow, fit) == pytest.approx(1.25)
    assert speed_of({"server_step_sizes": []}, fit) == 1.0
    assert fit.scaled(1.25)(40, 2, 0) == pytest.approx(1.25 * fit(40, 2, 0))


@pytest.mark.parametrize("argv, says", [(["--slo-tpot-ms", "abc"], "comma-separated milliseconds"),
                                        (["--slo-tpot-ms", "0,50"], "above 0 ms"),
                                        (["--calibrate-devices", "0"], "at least 1")])
def test_bad_options_are_argparse_errors(argv, says, capsys):
    from bench.fleet import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert says in capsys.readouterr().err
