"""What `sled-bench system` reports from its runs: the median run per configuration, SLED / server-only per pass,
capacity under the latency objective, the bounds, adaptive against the best fixed K, drafting ahead against waiting,
on synthetic runs whose answers are known."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.system import MODES, capacity, device_only_row, drafting_bound, pick_medians, server_rate, tables

BIN = Path(sys.executable).parent


def run(mode, n, rep, tok_s, p95=50.0, **extra):
    row = {"mode": mode, "devices": n, "repeat": rep, "system_tokens_per_s": tok_s,
           "per_device_tokens_per_s": tok_s / n, "p50_inter_token_ms": p95 / 2, "p95_inter_token_ms": p95,
           "acceptance_rate": 0.8, "mean_draft_tokens": 4.0, "server_step_ms": 40.0, "server_forward_ms": 38.0,
           "server_batch_sessions": float(n), "server_busy_share": 0.9}
    row.update(extra)
    return row


SCALES = {"server-only": 1.0, "sled-k2": 1.2, "sled-k4": 1.6, "sled-k8": 1.4, "sled": 1.5, "sled-no-ahead": 1.1}


def synthetic_runs(counts=((4, 100.0, 40.0, 90.0), (16, 200.0, 120.0, 200.0))):
    """Two device counts, three passes each, stored out of pass order (as a reversed pass finishes)."""
    runs = {}
    for n, base, p95_sled, p95_server in counts:
        for mode, scale in SCALES.items():
            p95 = p95_server if mode == "server-only" else p95_sled
            order = ((2, 5), (0, 0), (1, -10)) if mode == "server-only" else ((1, -10), (2, 5), (0, 0))
            runs[(n, mode)] = [run(mode, n, r, (base + d) * scale, p95) for r, d in order]
    return runs


def reported(runs, counts=(4, 16)):
    by = pick_medians(runs)
    by.update({("device-only", n): device_only_row(n, 60.0, 1 / 60) for n in counts})
    return by


def test_every_mode_runs_and_the_fixed_ks_are_the_comparison():
    assert list(MODES) == ["server-only", "sled", "sled-k2", "sled-k4", "sled-k8", "sled-no-ahead"]
    assert MODES["server-only"] is None and MODES["sled"].adaptive and MODES["sled"].draft_ahead
    assert not MODES["sled-no-ahead"].draft_ahead and MODES["sled-k4"].draft_tokens == 4


def test_median_run_and_per_pass_ratios_paired_by_pass():
    by = pick_medians(synthetic_runs())
    server4, sled4 = by[("server-only", 4)], by[("sled", 4)]
    assert server4["system_tokens_per_s"] == 100.0 and server4["repeat"] == 0  # the middle of 90, 100, 105
    assert server4["repeats_system_tokens_per_s"] == [100.0, 90.0, 105.0]  # pass order
    assert sled4["system_tokens_per_s"] == pytest.approx(150.0)
    # each pass against server-only's same pass: 1.5x every time, whatever order the runs were stored in
    assert sled4["repeats_ratio_to_server_only"] == pytest.approx([1.5, 1.5, 1.5])


def test_the_tables_give_the_ratio_capacity_bounds_and_the_comparisons():
    by = reported(synthetic_runs())
    text = tables([4, 16], by, slo_ms=150.0)
    sled16 = next(line for line in text.splitlines() if line.startswith("| 16 | sled |"))
    assert "| 300.0 |" in sled16 and "| 1.50x | 1.50x, 1.50x, 1.50x |" in sled16
    # p95: sled 40 and 120 ms, server-only 90 and 200 ms, device-only 16.7 ms, against 150 ms
    assert capacity([4, 16], by, 150.0) == {"sled": 16, "server-only": 4, "device-only": 16}
    assert "capacity (the largest count here with p95 inter-token latency ≤ 150 ms): sled 16, server-only 4, " \
           "device-only 16" in text
    # adaptive 150 against the best fixed K, K = 4 at 160: 0.94x in every pass
    assert "| 4 | 150.0 | 4.00 | 4 | 160.0 | 0.94x | 0.94x, 0.94x, 0.94x |" in text
    assert "| 4 | 150.0 | 110.0 | 1.36x | 1.36x, 1.36x, 1.36x |" in text  # drafting ahead against waiting
    # device-only 4 x 60 against server-only's 100: a 40 ms step is longer than a 16.7 ms drafting step, so a
    # round's free token gains nothing: 2.40x; server's side: the same busy share, so the measured 1.50x
    assert "4 devices 2.40x / 1.50x, 16 devices 4.80x / 1.50x" in text


def test_no_count_within_the_objective_gives_capacity_zero():
    assert capacity([4, 16], reported(synthetic_runs()), 10.0) == {"sled": 0, "server-only": 0, "device-only": 0}


def test_the_adaptive_comparison_pairs_each_pass_with_the_best_fixed_k_of_the_median_runs():
    """Passes that drift: the median runs fall on different passes, so their ratio (1.00x) differs from the pass by
    pass one, which pairs runs of the same pass whatever order they were stored in."""
    by_pass = {"server-only": [100.0, 60.0, 100.0], "sled-k2": [100.0, 60.0, 100.0], "sled-k4": [160.0, 100.0, 150.0],
               "sled-k8": [120.0, 80.0, 120.0], "sled": [150.0, 90.0, 160.0], "sled-no-ahead": [100.0, 60.0, 100.0]}
    runs = {(4, mode): [run(mode, 4, rep, values[rep]) for rep in (2, 0, 1)] for mode, values in by_pass.items()}
    text = tables([4], reported(runs, counts=(4,)), slo_ms=150.0)
    # best fixed K by its median run: K = 4 (150) over K = 8 (120) and K = 2 (100); per pass 150/160, 90/100, 160/150
    assert "| 4 | 150.0 | 4.00 | 4 | 150.0 | 1.00x | 0.94x, 0.90x, 1.07x |" in text


def test_the_drafting_bound_counts_a_round_s_free_token_only_where_a_step_is_shorter_than_drafting_one():
    # 4 devices drafting 60 tok/s each, drafts of 4 tokens
    assert drafting_bound(240.0, 4.0, 4, 0.0) == pytest.approx(300.0)  # an instant server: 4 drafted commit 5
    assert drafting_bound(240.0, 4.0, 4, 5.0) == pytest.approx(240.0 * (1 + 0.7 / 4))  # r·s 0.3: 0.7 of it
    assert drafting_bound(240.0, 4.0, 4, 1000.0 / 60) == pytest.approx(240.0)  # a step as long as a drafting step
    assert drafting_bound(240.0, 4.0, 4, 40.0) == pytest.approx(240.0)
    assert math.isnan(drafting_bound(240.0, 0.0, 4, 5.0))  # no draft made: a starved run


def test_the_server_side_counts_tokens_per_second_of_server_step_time():
    by = reported(synthetic_runs())
    # SLED 150 tok/s with the server busy 75% of the window, server-only 100 busy 80%: never idle, at the same steps,
    # they would commit 200 and 125 tok/s, so without cheaper steps SLED / server-only can reach 1.60x
    by[("sled", 4)]["server_busy_share"], by[("server-only", 4)]["server_busy_share"] = 0.75, 0.8
    assert server_rate(by[("sled", 4)]) == pytest.approx(200.0)
    assert "4 devices 2.40x / 1.60x" in tables([4, 16], by, slo_ms=150.0)
    assert math.isnan(server_rate(by[("device-only", 4)]))  # a server never busy commits nothing per step second


def test_sled_bench_system_refuses_bad_options_before_starting_anything():
    for argv, message in ((["--link", "latency=3"], "--link: unknown link setting 'latency'"),
                          (["--link", "delay_ms=-1"], "--link: link settings must be positive"),
                          (["--draft-match", "1.5"], "--draft-match must be in [0, 1]"),
                          (["--tokenizer", "x"], "--tokenizer goes with a random target"),
                          (["--devices", "0"], "counts must be at least 1")):
        done = subprocess.run([BIN / "sled-bench", "system", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
