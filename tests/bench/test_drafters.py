"""sled-bench drafters: the stacked drafters' ratios to the model alone, text set by text set."""

import json

import pytest

from bench import runner as runner_module
from bench.drafters import (checked_lines, copied_line, copied_tokens, guess_walk, marker, pooled_run, render_table,
                            stack_ceiling, stack_ratios, trained_goals, trained_name, walk_line)


def test_stacked_rows_are_read_against_their_own_model_alone():
    rows = [{"drafter": d, "text": t, "tokens_per_s": v} for d, t, v in (
        ("llama.cpp Q4_1", "repetitive", 10.0), ("llama.cpp Q4_1", "edit", 10.0), ("llama.cpp Q4_1", "free", 8.0),
        ("onnx", "edit", 5.0), ("onnx", "free", 4.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "repetitive", 12.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "edit", 14.0),
        ("stacked: prompt lookup under llama.cpp Q4_1", "free", 7.6),
        ("stacked: prompt lookup under onnx", "edit", 8.0), ("stacked: prompt lookup under onnx", "free", 3.6),
        ("prompt lookup (n-gram)", "edit", 30.0))]
    models = {"stacked: prompt lookup under llama.cpp Q4_1": "llama.cpp Q4_1", "stacked: prompt lookup under onnx": "onnx",
              "stacked: Cacheback under onnx": "onnx"}  # a stack without rows (left out) gives no line
    assert stack_ratios(rows, models).splitlines() == [
        "- stacked: prompt lookup under llama.cpp Q4_1 / llama.cpp Q4_1 alone, device tok/s: repetitive 1.20x, "
        "edit 1.40x, free 0.95x",
        "- stacked: prompt lookup under onnx / onnx alone, device tok/s: edit 1.60x, free 0.90x"]


def row(drafter, text, k="4", tok_s=10.0, **more):
    return {"drafter": drafter, "text": text, "k": k, "tokens_per_s": tok_s, "acceptance_rate": 0.5,
            "mean_acceptance_length": 2.0, "draft_tokens_per_round": 3.25, "copied": {"edit": 0.7}.get(text, 0.25),
            "walk_kept": 10, "answer_tokens": 20, "walk_checks": 5} | more


def test_the_table_is_a_line_a_drafter_and_a_cell_a_text_set():
    rows = [row("a", "edit", tok_s=12.0), row("a", "free"), row("b", "edit", tok_s=7.5)]
    assert render_table(rows, by_k=False).splitlines() == [
        "| drafter | edit | free |", "|---|---:|---:|",
        "| a | 12.0 · 0.50 · 2.00 · 3.25 | 10.0 · 0.50 · 2.00 · 3.25 |",
        "| b | 7.5 · 0.50 · 2.00 · 3.25 | — |"]  # a set a drafter did not run is a dash, not another's figures


def test_an_adaptive_run_has_a_line_a_drafter_and_k():
    rows = [row("a", "edit", "adaptive", 11.0), row("a", "edit", "2", 9.0), row("a", "free", "adaptive", 8.0),
            row("a", "free", "2", 8.5)]
    assert render_table(rows, by_k=True).splitlines()[2:] == [
        "| a | adaptive | 11.0 · 0.50 · 2.00 · 3.25 | 8.0 · 0.50 · 2.00 · 3.25 |",
        "| a | 2 | 9.0 · 0.50 · 2.00 · 3.25 | 8.5 · 0.50 · 2.00 · 3.25 |"]


def test_a_sets_answers_are_described_once_and_each_stack_s_checks_in_one_line():
    rows = [row("a", "edit"), row("a", "free"), row("s", "edit", checks=3, guessed=9, kept=4),
            row("s", "free", checks=2, guessed=5, kept=1, walk_kept=99)]
    assert copied_line(rows).endswith(": edit 0.70, free 0.25")
    assert walk_line(rows, 4) == ("- prompt lookup asked again after each missed guess, at most 3 a check, would keep "
                                  "of the answers' tokens (a stack's best): edit 10 of 20 in 5 checks, free 10 of 20 "
                                  "in 5 checks")  # each set's first row's: the answers are the same in every row
    assert checked_lines(rows) == ["- s, guesses kept of those checked (checks): edit 4 of 9 (3), free 1 of 5 (2)"]


def test_the_stacking_ceiling_is_one_forward_of_k_tokens_against_k_steps():
    assert abs(stack_ceiling(4, 3.0) - 0.75) < 1e-12
    assert stack_ceiling(4, 1.0) == 0.25  # a forward that costs one step: K times as fast at best


def test_copied_tokens_are_those_prompt_lookup_predicts():
    # after "1 2" the prompt continues with 3; after "9" nothing was seen; the repeated "1 2 3" is predicted too
    assert copied_tokens([1, 2, 3, 4, 1, 2], [3, 9, 1, 2, 3]) == 1 + 0 + 0 + 1 + 1
    assert copied_tokens([5], []) == 0


def test_the_guess_walk_asks_prompt_lookup_again_after_each_miss():
    prompt = [1, 2, 3, 4, 5, 6, 9, 7, 8]
    # 8 was not seen before the prompt's end: no guess, 1 is the model's; after 1 it guesses 2 3 4, all kept, and 5
    # is the model's; after "2 3 4 5" it guesses 6 9 7: 6 kept, the answer's 0 is the model's; 0 was not seen: no guess
    assert guess_walk(prompt, [1, 2, 3, 4, 5, 6, 0, 3], 3) == (4, 2)
    # one guess a check: 2 and 4 kept by checks of their own, 1 and 3 the model's
    assert guess_walk(prompt, [1, 2, 3, 4], 1) == (2, 2)
    assert guess_walk(prompt, [], 3) == (0, 0) and guess_walk(prompt, [1, 2], 0) == (0, 0)


def test_a_row_pools_its_runs():
    """A row is every run together: tok/s is all their tokens over all their time (not a run's), the stacked
    drafter's checks are summed, and the answers' length is one run's (greedy answers repeat)."""
    def run(seconds, checks):
        return {"tokens": 60, "drafted": 40, "accepted": 30, "loosely_accepted": 0, "rounds": 10, "elapsed_s": seconds,
                "tokens_per_s": 60 / seconds, "checks": checks, "guessed": 2 * checks, "kept": checks, "copied": 0.5}
    row = pooled_run("stacked", "edit", [run(2.0, 1), run(6.0, 2), run(3.0, 3)])
    assert row["tokens_per_s"] == pytest.approx(180 / 11.0)  # the median run would read 20
    assert row["runs_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert (row["checks"], row["guessed"], row["kept"], row["answer_tokens"]) == (6, 12, 6, 60)
    assert (row["acceptance_rate"], row["mean_acceptance_length"], row["draft_tokens_per_round"]) == (0.75, 4.0, 4.0)
    assert (row["drafter"], row["text"], row["copied"]) == ("stacked", "edit", 0.5)
    # a slow run weighs by its time: 60 tokens in 1 s and in 11 s pool to 10 tok/s (their mean would read 32.7)
    assert pooled_run("d", "edit", [run(1.0, 0), run(11.0, 0)])["tokens_per_s"] == pytest.approx(10.0)


def test_a_paced_drafter_pads_each_device_call_to_its_factor_and_drafts_the_same_tokens():
    """--device-pace: a call that took 2 units here sleeps 4 more at pace 3; attributes pass through unpadded, and a
    drafter without step_ahead has none through the proxy either (drafting ahead then asks propose)."""
    from bench.drafters import Paced
    from edge_client.drafters.base import Proposal

    class Drafter:
        checks = 7

        def propose(self, context, k, stop=None):
            now[0] += 2.0
            return Proposal(context[-1:] * k)

        def accept(self, context, ahead=()):
            now[0] += 0.5

    now, slept = [0.0], []
    paced = Paced(Drafter(), 3.0, clock=lambda: now[0], sleep=slept.append)
    assert paced.propose([1, 2, 5], 3).token_ids == [5, 5, 5]
    paced.accept([1, 2, 5])
    assert slept == [4.0, 1.0]
    assert paced.checks == 7 and getattr(paced, "step_ahead", None) is None
    assert slept == [4.0, 1.0]


def test_the_device_pace_is_checked_and_names_its_own_section():
    import argparse

    from bench.drafters import MARKER, at_least_one, marker

    assert at_least_one("2.5") == 2.5 and marker(1.0) == MARKER
    assert MARKER not in marker(3.0) and "3x slower" in marker(3.0)
    for bad in ("0.5", "nan", "-1", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            at_least_one(bad)


def test_an_adaptive_run_names_its_own_section_and_drafts_under_the_devices_controller():
    from bench.drafters import MARKER, build_parser, marker, policy

    sections = {marker(1.0), marker(1.0, True), marker(3.0), marker(3.0, True)}
    assert len(sections) == 4 and not any(MARKER in s for s in sections - {MARKER})
    assert "adaptive" in marker(1.0, True) and "3x slower" in marker(3.0, True)
    fixed, adaptive = policy(4, False).controller(), policy(8, True).controller()
    assert (type(fixed).__name__, fixed.k, fixed.k_max) == ("FixedDraftLength", 4, 4)
    assert (type(adaptive).__name__, adaptive.k_max) == ("AdaptiveDraftLength", 8)
    args = build_parser().parse_args(["--adaptive", "--draft-tokens", "8", "--server-threads", "3"])
    assert (args.adaptive, args.draft_tokens, args.server_threads) == (True, 8, 3)


def test_an_adaptive_run_is_read_against_the_best_fixed_k_of_the_same_run():
    from bench.drafters import KEPT, adaptive_goals, build_parser, fixed_ks, measured_modes

    assert fixed_ks(8, None) == [2, 4, 8] and fixed_ks(4, None) == [2, 4] and fixed_ks(3, None) == [2, 3]
    assert fixed_ks(8, [3, 5]) == [3, 5]
    assert build_parser().parse_args(["--adaptive", "--fixed-k", "4,2,4"]).fixed_k == [2, 4]
    chosen = build_parser().parse_args(["--models-only", "--no-stacked"])
    assert (chosen.models_only, chosen.stacked) == (True, False)
    for bad in ("0,2", "two", ","):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--adaptive", "--fixed-k", bad])
    rows = [{"drafter": "d", "text": "edit", "k": k, "tokens_per_s": v}
            for k, v in (("adaptive", 49.0), ("2", 40.0), ("4", 50.0), ("8", 45.0))]
    rows += [{"drafter": "d", "text": "free", "k": k, "tokens_per_s": v} for k, v in (("adaptive", 30.0), ("2", 20.0))]
    assert adaptive_goals(rows) == ("- d, adaptive K / the best fixed K, device tok/s: edit 0.980x (K = 4), free 1.500x "
                                    "(K = 2) (goal at least 0.98x for a drafter with a model)")
    # with every pass kept: each pass's adaptive run over the run of that pass of the best fixed K over all passes
    # (K = 4, though K = 2 was faster in the second pass), and the passes' standard error
    passes = {"adaptive": [49.0, 24.0], "2": [40.0, 25.0], "4": [50.0, 20.0]}
    pooled = {"adaptive": 30.0, "2": 31.0, "4": 32.0}
    rows = [{"drafter": "d", "text": "edit", "k": k, "tokens_per_s": pooled[k], "runs_tokens_per_s": v}
            for k, v in passes.items()]
    assert adaptive_goals(rows).splitlines() == [
        "- d, adaptive K / the best fixed K, device tok/s: edit 0.938x (K = 4) (goal at least 0.98x for a drafter "
        "with a model)",
        "- d, adaptive K, pass by pass (each run over that fixed K's run of its pass): edit 0.98/1.20x (standard "
        "error 0.11)"]
    # the kept adaptive device is read against the same fixed K (never counted as one), on lines of its own
    rows.append({"drafter": "d", "text": "edit", "k": KEPT, "tokens_per_s": 33.0, "runs_tokens_per_s": [50.0, 25.0]})
    assert adaptive_goals(rows).splitlines()[2:] == [
        "- d, adaptive K kept (one uncounted pass first) / the best fixed K, device tok/s: edit 1.031x (K = 4)",
        "- d, adaptive K kept (one uncounted pass first), pass by pass (each run over that fixed K's run of its "
        "pass): edit 1.00/1.25x (standard error 0.12)"]
    assert [m.label for m in measured_modes(8, True, None)] == ["adaptive", KEPT, "2", "4", "8"]
    no_kept = build_parser().parse_args(["--adaptive", "--no-kept"])
    assert not no_kept.kept and build_parser().parse_args(["--adaptive"]).kept
    assert [m.label for m in measured_modes(8, True, None, no_kept.kept)] == ["adaptive", "2", "4", "8"]
    assert [(m.label, m.k, m.adaptive, m.kept) for m in measured_modes(4, False, None)] == [("4", 4, False, False)]


def test_the_server_leaves_the_devices_drafting_thread_a_core_of_its_own():
    from bench.drafters import server_threads

    assert [server_threads(n) for n in (None, 1, 2, 16)] == [1, 1, 1, 15]


def test_trained_rows_are_read_against_the_early_exit_and_the_autoregressive_head():
    rows = [{"drafter": d, "text": t, "tokens_per_s": v, "mean_acceptance_length": m} for d, t, v, m in (
        ("untrained early exit (8 layers)", "edit", 20.0, 1.0), ("untrained early exit (8 layers)", "free", 20.0, 1.1),
        ("trained imitation (8 layers + 1)", "edit", 30.0, 1.5), ("trained imitation (8 layers + 1)", "free", 22.0, 1.1),
        ("trained parallel, ce (8 layers + 1, 4 slots)", "edit", 33.0, 1.3),
        ("untrained early exit (8 layers)", "held-out", 20.0, 1.0),
        ("trained imitation (8 layers + 1)", "held-out", 26.0, 1.4))]
    assert trained_goals(rows).splitlines() == [
        "- trained imitation (8 layers + 1) / untrained early exit (8 layers): mean acceptance length edit 1.50x, "
        "free 1.00x, held-out 1.40x (goal 1.3x); device tok/s edit 1.50x, free 1.10x, held-out 1.30x (goal 1.2x)",
        "- trained parallel, ce (8 layers + 1, 4 slots) / trained imitation (8 layers + 1), device tok/s: edit 1.10x "
        "(goal 1.3x)"]
    at_4 = trained_goals(rows, "at K = 4").splitlines()  # an adaptive run's section names the K its goals are read at
    assert at_4[1].startswith("- trained parallel, ce (8 layers + 1, 4 slots) / trained imitation (8 layers + 1) "
                              "at K = 4, device tok/s: edit 1.10x")
    meta = {"kind": "parallel", "loss": "ctc", "slots": 6, "trained": {"layers": 8, "head_layers": 1}}
    assert trained_name(meta) == "trained parallel, ctc (8 layers + 1, 6 slots)"
    assert trained_name({"kind": "autoregressive", "trained": {"layers": 8, "head_layers": 2}}) == \
        "trained imitation (8 layers + 2)"
    assert marker(1.0, True, trained=True) != marker(1.0, False, trained=True) != marker(1.0)


def test_the_held_out_set_is_the_first_trained_drafters_own(tmp_path):
    from argparse import Namespace

    from bench.drafters import HELD_OUT, trained_drafters

    held = [f"held-out prompt {i}" for i in range(HELD_OUT + 3)]
    for name, meta in (("a", {"kind": "autoregressive", "trained": {"layers": 8, "head_layers": 1},
                              "held_out_prompts": held}),
                       ("b", {"kind": "parallel", "loss": "ce", "slots": 4, "trained": {"layers": 8, "head_layers": 1},
                              "held_out_prompts": ["another"]})):
        (tmp_path / f"{name}.json").write_text(json.dumps(meta))
    rows, _, prompts = trained_drafters(Namespace(early_exit=None, trained=[str(tmp_path / "a.onnx"),
                                                                              str(tmp_path / "b.onnx")]), tmp_path)
    assert prompts == held[:HELD_OUT] and len(rows) == 2
    (tmp_path / "old.json").write_text(json.dumps({"kind": "autoregressive", "trained": {"layers": 8,
                                                                                       "head_layers": 1}}))
    assert trained_drafters(Namespace(early_exit=None, trained=[str(tmp_path / "old.onnx")]), tmp_path)[2] == []


def test_the_modes_take_turns_prompt_by_prompt_each_a_device_of_its_own(tiny_server, tokenizer, monkeypatch):
    """--adaptive: each mode is a device with its own drafter, through every prompt of the set, the modes taking
    turns prompt by prompt (the first mode moving on each prompt); each row is its mode's own generations. A kept
    mode's device runs the set once first, uncounted, with the controller it then keeps."""
    from bench.drafters import Mode, run_modes, turns
    from edge_client.drafters import DrafterOptions, create_drafter

    assert turns(2, 3) == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0)]
    played, made = [], []

    class Recorded:
        def __init__(self):
            self.inner, self.closed = create_drafter("ngram", DrafterOptions()), False
            made.append(self)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def begin(self, context, sampling):
            played.append((made.index(self), tuple(context)))
            self.inner.begin(context, sampling)

        def close(self):
            self.closed = True
            self.inner.close()

    texts = ["Count from 1 to 9.", "Name three colours."]
    modes = [Mode("adaptive", 4, True), Mode("2", 2), Mode("4", 4), Mode("kept", 4, True, kept=True)]
    seen = []
    original = runner_module.Runner.generate

    async def generate(self, job, controller=None):
        seen.append(controller)
        return await original(self, job, controller)

    monkeypatch.setattr(runner_module.Runner, "generate", generate)
    rows = run_modes(tiny_server.address, tokenizer, Recorded, texts, 8, modes)
    assert len(rows) == 4 and len(made) == 4 and all(d.closed for d in made)
    prompts = sorted({context for _, context in played}, key=[c for _, c in played].index)
    assert len(prompts) == 2  # the set's two prompts, the first played by every mode before the second
    order = [(device, prompts.index(context)) for device, context in played]
    assert order[:2] == [(3, 0), (3, 1)]  # the kept device's uncounted pass first
    assert order[2:] == [(m, i) for i, m in turns(2, 4)]
    assert seen[0] is seen[1] is seen[2 + turns(2, 4).index((0, 3))]  # one controller through both passes
    assert all(r["tokens"] == 16 for r in rows)  # each device's row counts both answers once (8 tokens each)
    assert rows[1]["draft_tokens_per_round"] <= 2 and rows[2]["draft_tokens_per_round"] <= 4


def test_each_repeat_starts_one_drafter_further_on_and_runs_every_drafter_once():
    """No drafter always runs first (after a server's start, or after the last repeat's slowest rows)."""
    from bench.drafters import rotated

    names = ["llama", "onnx", "ngram"]
    orders = [rotated(names, repeat) for repeat in range(4)]
    assert orders == [names, ["onnx", "ngram", "llama"], ["ngram", "llama", "onnx"], names]
    assert {order[0] for order in orders[:3]} == set(names)
    assert rotated([], 2) == []
