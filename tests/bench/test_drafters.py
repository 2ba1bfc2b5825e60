"""sled-bench drafters: the stacked drafters' ratios to the model alone, text set by text set."""

from bench.drafters import median_run, stack_ceiling, stack_goals


def test_stacked_rows_are_read_against_the_model_alone():
    rows = [{"drafter": d, "text": t, "tokens_per_s": v} for d, t, v in (
        ("llama.cpp Q4_1", "repetitive", 10.0), ("llama.cpp Q4_1", "edit", 10.0), ("llama.cpp Q4_1", "free", 8.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "repetitive", 12.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "edit", 14.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "free", 7.6),
        ("prompt lookup (n-gram)", "edit", 30.0))]
    assert stack_goals(rows) == ("- stacked: prompt lookup under llama.cpp Q4_1 / llama.cpp Q4_1 alone, device tok/s: "
                                 "repetitive 1.20x, edit 1.40x, free 0.95x (goals: edit at least 1.3x, free at least "
                                 "0.95x)")



def test_the_stacking_ceiling_counts_the_first_step_and_the_check():
    # K = 4: one step, then 3 guesses checked for the cost of 2.4 steps, against 4 steps alone
    assert abs(stack_ceiling(4, 2.4) - 0.85) < 1e-12
    assert stack_ceiling(4, 1.0) == 0.5  # a check that costs one step: twice as fast at best


def test_a_row_is_the_run_of_median_speed():
    done = [{"tokens_per_s": 30.0, "checks": 1}, {"tokens_per_s": 10.0, "checks": 2}, {"tokens_per_s": 20.0, "checks": 3}]
    row = median_run("stacked", "edit", done)
    assert (row["tokens_per_s"], row["checks"], row["drafter"], row["text"]) == (20.0, 3, "stacked", "edit")
    assert row["runs_tokens_per_s"] == [30.0, 10.0, 20.0]
