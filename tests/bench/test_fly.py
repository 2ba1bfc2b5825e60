"""sled-bench fly: HumanEval's completions cut and run in a sandbox, exactness checked item by item, the report's
goals, and the whole command on two items."""

import argparse
import json
import subprocess
import sys

import pytest

from bench.fly import TargetChanged, check_exact, cut, passes, problems, report, written

GOOD = ("    for i in range(len(numbers)):\n        for j in range(i + 1, len(numbers)):\n"
        "            if abs(numbers[i] - numbers[j]) < threshold:\n                return True\n    return False\n")


@pytest.fixture(scope="module")
def first():
    return problems(1)[0]


def test_a_completion_is_cut_at_the_first_stop_sequence():
    assert cut("    return 1\n\ndef helper():\n    pass\n") == "    return 1\n"
    assert cut("    x = 1\n    return x\nprint(f(2))\n# done") == "    x = 1\n    return x"
    assert cut("    return 2\n") == "    return 2\n"


def test_the_scored_text_keeps_the_stop_sequence_that_ended_it():
    assert written("    return 1\n\ndef helper():\n    pass\n") == "    return 1\n\ndef"
    assert written("    x = 1\n    return x\nprint(f(2))\n# done") == "    x = 1\n    return x\nprint"
    assert written("\n# nothing written") == "\n#"  # an empty completion still has a text: stopping at once
    assert written("    return 2\n") == "    return 2\n"


def test_the_sandbox_passes_a_right_answer_and_fails_a_wrong_one_a_hang_and_a_big_file(first, tmp_path):
    assert first["task_id"] == "HumanEval/0"
    assert passes(first, GOOD)
    assert not passes(first, "    return True\n")
    assert not passes(first, "    while True:\n        pass\n", timeout_s=2)
    assert not passes(first, "    open('big', 'w').write('y' * (64 << 20))\n" + GOOD)  # past the file-size cap
    assert not passes(first, "    x = bytearray(4 << 30)\n" + GOOD)  # past the memory cap


def test_exact_sled_differing_from_the_target_stops_the_command():
    check_exact("HumanEval/3", "    return 1\n", "    return 1\n")
    with pytest.raises(TargetChanged, match="HumanEval/3: exact SLED's completion differs"):
        check_exact("HumanEval/3", "    return 1\n", "    return 2\n")


def rows(mode, passed, accepted, rounds, ll, loose=0, differs=0):
    return [{"task_id": f"HumanEval/{i}", "mode": mode, "passed": i < passed, "differs": i < differs,
             "rounds": rounds, "drafted": 8 * rounds, "accepted": accepted, "loosely_accepted": loose,
             "tokens": rounds + accepted, "elapsed_s": 1.0, "log_likelihood": ll} for i in range(10)]


def test_the_report_reads_the_goals_off_the_summary():
    args = argparse.Namespace(draft_tokens=8, fly_window=6, fly_entropy_threshold=0.3)
    # scores of 50% and 40%: the score is the goal; FLy's length 1 + 30/10 = 4 against exact's 3: 1.33x
    all_rows = rows("target", 5, 0, 40, -0.5) + rows("exact", 5, 20, 10, -0.5) + rows("fly", 4, 30, 10, -0.51, 3, 2)
    text, sums = report(all_rows, args, 10)
    assert ("mean acceptance length, FLy / exact: 1.33x (goal at least 1.25x; a round commits at most K + 1 = 9 "
            "tokens, so no rule passes 3.00x over exact's 3.00 with this pair)") in text
    assert "score, FLy against the target: -10.0 points (goal within 1); mean log-likelihood -2.00% (95% interval" in text
    assert "| FLy, K 8, W 6, 0.3 nats | 40.0% | 2 / 10 | 4.00 | 30 | 40.0 |" in text
    # a target that solves none: the log-likelihood is the goal
    low = rows("target", 0, 0, 40, -0.5) + rows("exact", 0, 20, 10, -0.5) + rows("fly", 0, 30, 10, -0.505)
    text, _ = report(low, args, 10)
    assert "too few for a point of score to mean anything" in text and "-1.00% (95% interval" in text


def test_the_log_likelihoods_compared_are_of_the_same_items():
    """An item without a text in one mode leaves every mode's mean: FLy's mean over items the target has no text for
    is no comparison with the target's."""
    args = argparse.Namespace(draft_tokens=8, fly_window=6, fly_entropy_threshold=0.3)
    target, exact, fly = rows("target", 0, 0, 40, -0.5), rows("exact", 0, 20, 10, -0.5), rows("fly", 0, 30, 10, -0.5)
    for r in target[:3] + exact[:3]:
        r["log_likelihood"] = None
    for r in fly[:3]:
        r["log_likelihood"] = -0.1  # likely texts where the target wrote none: left out, not counted in FLy's favour
    fly[3]["log_likelihood"] = -0.57  # one item of the seven compared a lot less likely
    text, sums = report(target + exact + fly, args, 10)
    # the seven differences: 0 six times and -0.07; their mean -0.01 is -2.00% of -0.5, give or take
    # 1.96 * 0.0265 / sqrt(7) / 0.5 = 3.92%
    assert ("-2.00% (95% interval -5.92% to +1.92% over the 7 items with a text in every mode; goal within 2%)"
            in text)
    assert [s["log_likelihood_items"] for s in sums] == [7, 7, 7]


def test_a_report_with_no_item_written_in_every_mode_says_so():
    """Every target text empty (no log-likelihood): the report still comes, the change marked unknown."""
    args = argparse.Namespace(draft_tokens=8, fly_window=6, fly_entropy_threshold=0.3)
    target = rows("target", 0, 0, 40, None)
    text, sums = report(target + rows("exact", 0, 20, 10, -0.5) + rows("fly", 0, 30, 10, -0.5), args, 10)
    assert "mean log-likelihood of FLy's completions against its greedy ones: not known (no item has a text in every " \
           "mode; goal within 2%)" in text
    assert [s["log_likelihood_items"] for s in sums] == [0, 0, 0]


@pytest.mark.model
def test_the_command_runs_two_items_three_ways_and_writes_its_section(tmp_path):
    md, out = tmp_path / "b.md", tmp_path / "fly.json"
    done = subprocess.run([sys.executable, "-m", "bench.cli", "fly", "--items", "2", "--max-tokens", "24",
                           "--markdown", str(md), "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "## FLy: loose against exact verification on HumanEval" in md.read_text()
    data = json.loads(out.read_text())
    assert [s["mode"] for s in data["summary"]] == ["target", "exact", "fly"]
    items = data["items"]
    assert len(items) == 6 and {r["task_id"] for r in items} == {"HumanEval/0", "HumanEval/1"}
    by = {(r["task_id"], r["mode"]): r for r in items}
    for task in ("HumanEval/0", "HumanEval/1"):
        assert by[task, "exact"]["completion"] == by[task, "target"]["completion"]
        assert by[task, "target"]["rounds"] == by[task, "target"]["tokens"]  # the server decoded every token
    assert all(r["log_likelihood"] is not None for r in items)  # an empty completion's text is its stop sequence
    assert "exact SLED's 2 completions equal the target's" in md.read_text()
