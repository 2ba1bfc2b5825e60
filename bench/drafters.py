"""Acceptance of every drafter on repetitive, edit and free text, against one real verify server.

For each drafter and text set, the prompts run one after another (one device), greedy, and the
figures are acceptance rate (accepted / drafted), mean acceptance length (1 + accepted / rounds) and
device tokens/s. The server and the device's drafting thread each have cores of their own, as on two machines.
One drafter instance serves a whole set, so Cacheback's tables warm up across the
set's prompts, as on a device that keeps running. With --adaptive, every mode (the adaptive K and each fixed K) is
a device of its own, and the modes take turns prompt by prompt, so the host's drift falls on all of them alike; one
more adaptive device is kept (unless --no-kept): its controller first runs the set's prompts once, uncounted, as a
device that has run a while (a fresh controller spends its first few hundred tokens trying each way of drafting).
Every drafter and set runs --repeats times, interleaved (each repeat's order starting one drafter further on, after
one uncounted generation that warms the server), and each row pools its runs. Writes its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.drafters.ngram import lookup
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.tokenizer import Tokenizer

from .cli import at_least, positive
from sim.processes import ServerProcess
from .report import machine, publish
from .runner import Job, Runner, chat, device_controller, figures, summary

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## Drafters: acceptance on repetitive, edit and free text"
ONNX_ROW = "ONNX Runtime, int8 weights"
DRAFTER_THREADS = 1  # each model drafter's, as on a small device's core; the server has the host's other cores

REPETITIVE = [
    "Repeat this sentence five times, one per line: The quick brown fox jumps over the lazy dog.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 10.",
    "List the days of the week, then list them again in reverse order.",
    "Write a Python class Point with x and y, and methods add, sub, mul and div that each return a new Point.",
    "Write an HTML table with three rows, each with the cells Name, Age and City.",
    "Count from 1 to 30, separated by commas.",
]
# Outputs that repeat their inputs (code edits, reformatting, rewriting): where a model-free proposer under the model
# pays. Each is a prompt whose answer by the 135M target reproduces its input; the table's "copied" column says how
# much of the answers prompt lookup predicts.
EDIT = [
    "Add a docstring to this function and return the whole function:\n\n"
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n"
    "    return x\n",
    "Add a docstring to this class and return the whole class:\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n",
    "Format this JSON with two-space indentation: {\"name\": \"Alice\", \"age\": 34, \"city\": \"Paris\", "
    "\"languages\": [\"French\", \"English\"], \"active\": true}",
    "Write this HTML again with the class \"item\" added to every li element:\n\n"
    "<ul>\n  <li>Apples</li>\n  <li>Bananas</li>\n  <li>Cherries</li>\n  <li>Dates</li>\n</ul>\n",
    "Convert this list to a JSON array of objects with keys name and age: Alice, 34; Bob, 27; Carol, 45; "
    "Dave, 19; Eve, 52.",
    "Rewrite this SQL query with the keywords in upper case: select name, email from users where age > 30 "
    "order by name limit 10;",
]
FREE = [
    "Explain why the sky is blue.", "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?", "Describe how a bicycle works.",
    "Give me three tips for learning to cook.", "How do airplanes stay in the air?",
]


HELD_OUT = 8  # prompts of a trained drafter's held-out set (its .json's, never trained on) run as a fourth set


def texts_of(rows: list[dict]) -> list[str]:
    """The text sets the rows cover, in the order they ran."""
    return list(dict.fromkeys(r["text"] for r in rows))


def policy(k: int, adaptive: bool) -> DraftPolicy:
    """K fixed, or the device's default controller choosing K each round in 1..k."""
    return DraftPolicy(draft_tokens=k, adaptive=adaptive, max_draft_tokens=k)


@dataclass(frozen=True)
class Mode:
    """A device of an --adaptive run: its row's K column, its K (the most K, where adaptive), and whether its
    controller is kept from one uncounted pass through the set's prompts first."""

    label: str
    k: int
    adaptive: bool = False
    kept: bool = False

    @property
    def policy(self) -> DraftPolicy:
        return policy(self.k, self.adaptive)


KEPT = "adaptive, kept"  # the K column of the kept adaptive device


def measured_modes(k: int, adaptive: bool, fixed: list[int] | None, kept: bool = True) -> list[Mode]:
    """The devices a run measures: K alone, or the adaptive K, the adaptive K kept (unless not `kept`) and the fixed K
    beside them."""
    if not adaptive:
        return [Mode(str(k), k)]
    return ([Mode("adaptive", k, True)] + ([Mode(KEPT, k, True, kept=True)] if kept else [])
            + [Mode(str(f), f) for f in fixed_ks(k, fixed)])


def turns(prompts: int, modes: int) -> list[tuple[int, int]]:
    """(prompt, mode) in the order run_modes plays them: every mode through each prompt before the next prompt, the
    first mode moving on by one each prompt, so no mode always meets the host just after another."""
    return [(i, (i + j) % modes) for i in range(prompts) for j in range(modes)]


def rotated(items: list, repeat: int) -> list:
    """The drafters in a repeat's order: each repeat starts one further on, so no drafter always runs first after the
    last repeat's slowest rows, and none always at the same minutes of a run."""
    shift = repeat % len(items) if items else 0
    return items[shift:] + items[:shift]


def warm_up(address, tokenizer, make_drafter, prompt: str, max_tokens: int) -> None:
    """One uncounted generation: a fresh server's first requests are slower (its first steps at each size, Python's
    first calls), and would count against whichever drafter ran first."""
    run_modes(address, tokenizer, make_drafter, [prompt], max_tokens, [Mode("warm-up", 4)])


def run_modes(address, tokenizer, make_drafter, texts, max_tokens, modes: list[Mode]) -> list[dict]:
    """Each mode as a device of its own (its drafter from make_drafter(), its controller kept across its requests)
    through a set's prompts, the modes taking turns prompt by prompt: a mode's figures span the same minutes of the
    host as every other's, so its drift between them is not read as a mode's speed. A kept mode's device runs the
    prompts once first, uncounted. A row each."""
    prompt_ids = chat(tokenizer, texts)
    devices: list[tuple] = []
    results: list[list] = [[] for _ in modes]

    async def main() -> None:
        async with Runner(address, tokenizer) as runner:
            def generate(i: int, m: int):
                request = Request(prompt_ids[i], max_tokens=max_tokens, policy=modes[m].policy)
                return runner.generate(Job(devices[m][0], request), devices[m][1])

            for m in (m for m, mode in enumerate(modes) if mode.kept):
                for i in range(len(prompt_ids)):
                    await generate(i, m)
            for i, m in turns(len(texts), len(modes)):
                results[m].append(await generate(i, m))

    try:
        for mode in modes:
            devices.append((make_drafter(), device_controller(mode.policy)))
        asyncio.run(main())
        return [set_row(d, done, mode.k) for (d, _), done, mode in zip(devices, results, modes)]
    finally:
        for d, _ in devices:
            d.close()


# what a run counts besides its tokens, summed when its rows pool (figures())
COUNTS = ("drafted", "accepted", "loosely_accepted", "rounds", "elapsed_s")


def set_row(drafter, rows, k: int) -> dict:
    """A device's figures over a set's generations, and what the answers copy."""
    copied = sum(copied_tokens(r.prompt_token_ids, r.token_ids) for r in rows)
    walks = [guess_walk(r.prompt_token_ids, r.token_ids, k - 1) for r in rows]
    s = summary(rows)
    checks = {"checks": drafter.checks, "guessed": drafter.guessed, "kept": drafter.kept} if hasattr(
        drafter, "checks") else {}  # a stacked drafter's lifetime counts: this set's, as it serves one set
    return checks | {"copied": copied / s["tokens"] if s["tokens"] else 0.0, "tokens": s["tokens"],
                     "walk_kept": sum(w[0] for w in walks), "walk_checks": sum(w[1] for w in walks),
                     **{key: s[key] for key in COUNTS + ("acceptance_rate", "mean_acceptance_length",
                                                         "draft_tokens_per_round", "tokens_per_s")}}


CELL = ("- a cell is a text set's device tok/s · acceptance (accepted / drafted) · mean acceptance length "
        "(1 + accepted / rounds, vLLM's) · drafted a round (an n-gram drafter proposes nothing where it finds no "
        "match: below K)")


def render_table(rows: list[dict], by_k: bool) -> str:
    """The rows as a line a drafter (and K, where a run has several) and a cell a text set (CELL)."""
    texts = texts_of(rows)
    cells = {(r["drafter"], r["k"], r["text"]): r for r in rows}

    def cell(r: dict | None) -> str:
        return "—" if r is None else (f"{r['tokens_per_s']:.1f} · {r['acceptance_rate']:.2f} · "
                                      f"{r['mean_acceptance_length']:.2f} · {r['draft_tokens_per_round']:.2f}")
    lines = ["| drafter |" + (" K |" if by_k else "") + "".join(f" {text} |" for text in texts),
             "|---|" + ("---|" if by_k else "") + "---:|" * len(texts)]
    for name, k in dict.fromkeys((r["drafter"], r["k"]) for r in rows):
        lines.append(f"| {name} |" + (f" {k} |" if by_k else "")
                     + "".join(f" {cell(cells.get((name, k, text)))} |" for text in texts))
    return "\n".join(lines)


def answers_of(rows: list[dict]) -> dict[str, dict]:
    """Each text set's first row: what its answers are (greedy answers are the same for every drafter)."""
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r["text"], r)
    return first


def copied_line(rows: list[dict]) -> str:
    return ("- copied, the share of the answers' tokens that prompt lookup's first guess predicts from the prompt and "
            "the answer before them (the same for every drafter: greedy answers are the target's): "
            + ", ".join(f"{text} {r['copied']:.2f}" for text, r in answers_of(rows).items()))


def checked_lines(rows: list[dict]) -> list[str]:
    """Each stacked drafter's guesses kept of those its model checked, and its checks, set by set."""
    out = []
    for name in dict.fromkeys(r["drafter"] for r in rows if "checks" in r):
        sets = [f"{r['text']} {r['kept']} of {r['guessed']} ({r['checks']})"
                for r in rows if r["drafter"] == name and "checks" in r]
        out.append(f"- {name}, guesses kept of those checked (checks): {', '.join(sets)}")
    return out


def walk_line(rows: list[dict], k: int) -> str:
    walks = [f"{text} {r['walk_kept']} of {r['answer_tokens']} in {r['walk_checks']} checks"
             for text, r in answers_of(rows).items()]
    return (f"- prompt lookup asked again after each missed guess, at most {k - 1} a check, would keep of the "
            f"answers' tokens (a stack's best): {', '.join(walks)}")


def copied_tokens(prompt: list[int], answer: list[int]) -> int:
    """Tokens of the answer that prompt lookup's first guess (n-grams of 3 down to 1) predicts from what came before:
    how much the answer repeats its prompt and itself."""
    return sum(lookup(prompt + answer[:i], 1, 3, 1) == [t] for i, t in enumerate(answer))


def guess_walk(prompt: list[int], answer: list[int], guesses: int) -> tuple[int, int]:
    """Prompt lookup (a stack's proposer, with the device's n-gram settings) at its best under a model drafter:
    asked again after each guess the answer does not follow, at most `guesses` a check, the answer's token after
    each run of right guesses being the model's own. Returns (the answer's tokens it guesses right, checks: lookups
    that offered a guess)."""
    n = DrafterOptions()
    kept = checks = i = 0
    while i < len(answer):
        guessed = lookup(prompt + answer[:i], guesses, n.ngram_max, n.ngram_min)
        run = 0
        while run < len(guessed) and i + run < len(answer) and guessed[run] == answer[i + run]:
            run += 1
        checks, kept, i = checks + bool(guessed), kept + run, i + run + 1
    return kept, checks


# With this model most tensors of a q2_k request fall back to q4_0 (576 columns is not a multiple of 256).
REQUANTIZED_NAMES = {"q2_k": "llama.cpp requantized (q2_k request; q4_0 fallback)"}


def tool(script: str, *args: str) -> None:
    """Run a user tool of scripts/ (the requantizer, the ONNX exporter) by its command line."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/{script} failed: {done.stderr.strip()[-2000:]}")


def pooled_run(name: str, label: str, done: list[dict]) -> dict:
    """One row of a drafter and set: the device's figures over all its runs together (their counts summed, so device
    tok/s is every run's tokens over every run's time), with each run's tok/s. A run's speed moves by several percent
    on a shared host: pooled, its noise shrinks with the runs' number."""
    counts = {key: sum(r[key] for r in done) for key in ("tokens", *COUNTS)}
    stacked = {key: sum(r[key] for r in done) for key in ("checks", "guessed", "kept") if key in done[0]}
    return done[0] | stacked | figures(**counts) | {
        "drafter": name, "text": label, "runs_tokens_per_s": [r["tokens_per_s"] for r in done],
        "answer_tokens": done[0]["tokens"]}  # one run's: greedy answers are the same in every run


class Paced:
    """A drafter run as on a device `factor` times slower than this host: each call the device makes of it (begin,
    propose, a stacked drafter's step_ahead, accept) is padded to `factor` times its time here by sleeping, so the
    pad takes no CPU from the verify server, as a separate device's drafting would not. Its tokens are the drafter's."""

    PACED = ("begin", "propose", "step_ahead", "accept")

    def __init__(self, drafter, factor: float, clock=time.perf_counter, sleep=time.sleep):
        self.drafter, self.factor, self.clock, self.sleep = drafter, factor, clock, sleep

    def __getattr__(self, name):
        attr = getattr(self.drafter, name)
        if name not in self.PACED:
            return attr

        def paced(*args, **kwargs):
            start = self.clock()
            try:
                return attr(*args, **kwargs)
            finally:
                self.sleep((self.factor - 1.0) * (self.clock() - start))
        return paced


def check_cost(kind: str, options: DrafterOptions, k: int, reps: int = 15) -> float:
    """What one forward of k tokens (a stacked round's check: the context's last token and k - 1 guesses) costs a
    model drafter on this host, in its own one-token steps (medians of `reps`)."""
    d = create_drafter(kind, options)
    try:
        d._feed(list(range(100, 400)))  # any 300-token context
        base, tokens = len(d._evaluated), list(range(500, 500 + k))

        def timed(run) -> float:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
                d._truncate(base)
                del d._evaluated[base:]
            return statistics.median(times)

        step = timed(lambda: d._feed(tokens[:1]))
        return timed(lambda: d._eval_rows(tokens)) / step
    finally:
        d.close()


def stack_ceiling(k: int, cost: float) -> float:
    """The drafting time a round of K tokens takes stacked with every guess kept, against the model alone's: one
    forward of K tokens (the round's first token and K - 1 guesses) against K steps."""
    return cost / k


def stack_ratios(rows: list[dict], models: dict[str, str]) -> str:
    """Each stacked drafter's device tok/s against its model alone (`models`: stacked row -> the model's row), text
    set by text set."""
    by = {(r["drafter"], r["text"]): r["tokens_per_s"] for r in rows}
    out = []
    for name, model in models.items():
        ratios = ", ".join(f"{text} {by[name, text] / by[model, text]:.2f}x"
                           for text in ("repetitive", "edit", "free") if (name, text) in by and (model, text) in by)
        if ratios:
            out.append(f"- {name} / {model} alone, device tok/s: {ratios}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=positive(int), default=96, help="tokens per prompt (default 96)")
    p.add_argument("--draft-tokens", type=positive(int), default=4,
                   help="K, or with --adaptive the most K a round drafts (default 4)")
    p.add_argument("--adaptive", action="store_true",
                   help="draft under the device's adaptive controller (K chosen each round, at most --draft-tokens), "
                        "beside --fixed-k's fixed K in the same run; writes its own section")
    p.add_argument("--fixed-k", type=k_list, metavar="K,...",
                   help="with --adaptive: the fixed K run beside it (default: 2, 4 and so on doubling up to "
                        "--draft-tokens, and --draft-tokens)")
    p.add_argument("--no-kept", dest="kept", action="store_false",
                   help="with --adaptive: leave out the kept adaptive device (its uncounted first pass through every "
                        "set adds about a quarter to the run)")
    p.add_argument("--models-only", action="store_true",
                   help="only the drafters with a model (llama.cpp, ONNX, stacked on either): no n-gram drafter alone")
    p.add_argument("--no-stacked", dest="stacked", action="store_false", help="leave the stacked drafters out")
    p.add_argument("--server-threads", type=positive(int), default=server_threads(os.cpu_count()), metavar="N",
                   help="the verify server's torch threads (default: the host's cores but one, the device's "
                        "drafting thread's)")
    p.add_argument("--repeats", type=positive(int), default=3,
                   help="runs of every drafter and set, interleaved; a row is all of them together (default 3)")
    p.add_argument("--onnx-model", help="ONNX draft to use (default: export the full model, int8, to a temp dir)")
    p.add_argument("--requantized", default="q2_k", metavar="TYPES",
                   help="comma-separated quantizations the Q4_1 drafter is requantized to, one row each, e.g. "
                        "q2_k,q4_0,q8_0,iq4_nl: a weaker drafter (q2_k), or another format to draft in (default q2_k)")
    p.add_argument("--no-onnx", dest="onnx", action="store_false", help="leave the ONNX drafter out")
    p.add_argument("--trained", action="append", default=[], metavar="FILE",
                   help="an .onnx drafter made by sled-train (repeatable): compares the trained drafters alone, with "
                        "--early-exit's, in a section of their own")
    p.add_argument("--early-exit", type=positive(int), metavar="L",
                   help="with --trained: also the untrained first L layers of the target (scripts/export_onnx_draft.py "
                        "--layers L --int8), what an imitation head is trained on")
    p.add_argument("--device-pace", type=at_least_one, default=1.0, metavar="F",
                   help="run every drafter as on a device F times slower than this host (each drafter call padded "
                        "to F times its time by sleeping, which takes no CPU from the server); F above 1 writes its "
                        "own section (default 1: this host's pace)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


at_least_one = at_least(1.0)  # --device-pace: 1 is a device as fast as this host


def k_list(text: str) -> list[int]:
    """--fixed-k: comma-separated positive Ks."""
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of K: {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"each K must be at least 1: {text!r}")
    return ks


def fixed_ks(k_max: int, given: list[int] | None) -> list[int]:
    """The fixed K an adaptive run is measured beside: those given, else 2, 4, ... up to k_max, and k_max."""
    if given:
        return given
    ks, k = [], 2
    while k < k_max:
        ks.append(k)
        k *= 2
    return ks + [k_max]


def adaptive_goals(rows: list[dict]) -> str:
    """Each drafter's adaptive K (and the kept one, where the run has it) against its best fixed K of the run (both
    over all their runs), text set by text set (goal 0.98x); and, where the rows keep every pass's tok/s, each pass's
    adaptive run over that K's run of the same pass (the modes of a pass ran back to back, so the host's drift between
    passes leaves the ratio), with the passes' standard error: how far the run's ratio can be trusted."""
    out = []
    for name in dict.fromkeys(r["drafter"] for r in rows):
        for label, what, goal in (("adaptive", "adaptive K", " (goal at least 0.98x for a drafter with a model)"),
                                  (KEPT, "adaptive K kept (one uncounted pass first)", "")):
            parts, passes = [], []
            for text in texts_of(rows):
                mine = [r for r in rows if r["drafter"] == name and r["text"] == text]
                adaptive = [r for r in mine if r["k"] == label]
                fixed = [r for r in mine if r["k"].isdigit()]
                if adaptive and fixed:
                    best = max(fixed, key=lambda r: r["tokens_per_s"])
                    # three places: two round a ratio just short of the goal up to it
                    parts.append(f"{text} {adaptive[0]['tokens_per_s'] / best['tokens_per_s']:.3f}x (K = {best['k']})")
                    ratios = paired(adaptive[0], best)
                    if len(ratios) > 1:
                        error = statistics.stdev(ratios) / len(ratios) ** 0.5
                        passes.append(f"{text} {'/'.join(f'{x:.2f}' for x in ratios)}x (standard error {error:.2f})")
            if parts:
                out.append(f"- {name}, {what} / the best fixed K, device tok/s: {', '.join(parts)}{goal}")
            if passes:
                out.append(f"- {name}, {what}, pass by pass (each run over that fixed K's run of its pass): "
                           + ", ".join(passes))
    return "\n".join(out)


def paired(adaptive: dict, fixed: dict) -> list[float]:
    """Each pass's adaptive tok/s over the fixed K's of that pass (none where the rows lack their passes)."""
    a, f = adaptive.get("runs_tokens_per_s"), fixed.get("runs_tokens_per_s")
    if not a or not f or len(a) != len(f):
        return []
    return [x / y for x, y in zip(a, f)]


def marker(pace: float, adaptive: bool = False, trained: bool = False) -> str:
    """The section's heading: a paced run's, an adaptive K's and the trained drafters' is its own (and not one the
    plain heading is part of)."""
    if trained:
        return (f"## Drafters trained by sled-train{' with the adaptive K' if adaptive else ''}: acceptance on "
                "repetitive, edit and free text")
    if pace == 1.0 and not adaptive:
        return MARKER
    device = "a device" if pace == 1.0 else f"a device drafting {pace:g}x slower than this host"
    return (f"## Drafters on {device}{' with the adaptive K' if adaptive else ''}: acceptance on repetitive, edit and "
            "free text")


def trained_name(meta: dict) -> str:
    t = meta.get("trained", {})
    if meta.get("kind") == "parallel":
        return f"trained parallel, {meta['loss']} ({t.get('layers')} layers + {t.get('head_layers')}, {meta['slots']} slots)"
    return f"trained imitation ({t.get('layers')} layers + {t.get('head_layers')})"


def trained_drafters(args, work: Path) -> tuple[dict, list[str], list[str]]:
    """The --trained drafters and --early-exit's, by row name, each trained one's held-out acceptance line, and the
    held-out prompts of the first that names them."""
    import json

    rows, notes, held_out = {}, [], []
    if args.early_exit:
        path = str(work / f"early-exit-{args.early_exit}.onnx")
        tool("export_onnx_draft.py", "--output", path, "--layers", str(args.early_exit), "--int8")
        rows[f"untrained early exit ({args.early_exit} layers)"] = ("onnx", DrafterOptions(
            onnx_model=path, threads=DRAFTER_THREADS))
    for path in args.trained:
        meta_path = Path(path).with_suffix(".json")
        if not meta_path.is_file():
            raise RuntimeError(f"--trained {path}: {meta_path} (written by sled-train) is missing")
        meta = json.loads(meta_path.read_text())
        name = trained_name(meta)
        rows[name] = ("parallel" if meta.get("kind") == "parallel" else "onnx",
                      DrafterOptions(onnx_model=str(path), threads=DRAFTER_THREADS))
        held_out = held_out or meta.get("held_out_prompts", [])[:HELD_OUT]
        held = meta.get("held_out")
        if held:
            notes.append(f"- {name}: held-out (its card) mean acceptance length {held['mean_acceptance_length']:.2f} "
                         "at K = 4; drafts whose first 1..4 tokens are all kept: "
                         + ", ".join(f"{p:.2f}" for p in held["acceptance_by_position"]))
    return rows, notes, held_out


def trained_goals(rows: list[dict], rows_are: str | None = None) -> str:
    """Each trained imitation row against the early exit (acceptance length and tok/s), and each parallel row
    against the trained autoregressive row (tok/s), text set by text set; `rows_are` says at which K (an adaptive
    run's section has several)."""
    by = {(r["drafter"], r["text"]): r for r in rows}
    names = list(dict.fromkeys(r["drafter"] for r in rows))
    at = f" {rows_are}" if rows_are else ""
    early = [n for n in names if n.startswith("untrained early exit")]
    imitation = [n for n in names if n.startswith("trained imitation")]
    parallel = [n for n in names if n.startswith("trained parallel")]
    out = []

    def ratios(a, b, key):
        return ", ".join(f"{text} {by[a, text][key] / by[b, text][key]:.2f}x" for text in texts_of(rows)
                         if (a, text) in by and (b, text) in by)
    for a in imitation:
        for b in early:
            out.append(f"- {a} / {b}{at}: mean acceptance length {ratios(a, b, 'mean_acceptance_length')} (goal 1.3x); "
                       f"device tok/s {ratios(a, b, 'tokens_per_s')} (goal 1.2x)")
    for a in parallel:
        for b in imitation:
            out.append(f"- {a} / {b}{at}, device tok/s: {ratios(a, b, 'tokens_per_s')} (goal 1.3x)")
    return "\n".join(out)


def server_threads(cores: int | None) -> int:
    """The verify server's torch threads: every core but the device's drafting threads', which have theirs to
    themselves, as on two machines (sharing a core, each waits on the other's turns)."""
    return max(1, (cores or 1) - DRAFTER_THREADS)


def drafters(args, work: Path) -> tuple[dict, dict]:
    """The drafters to compare, making the requantized and exported ones first, and each stacked row's model row."""
    kinds = [k for k in args.requantized.split(",") if k]
    requantized = {}
    for k in kinds:
        tool("requantize_gguf.py", "--output", str(work / f"smollm2-{k}.gguf"), "--type", k)
        requantized[REQUANTIZED_NAMES.get(k, f"llama.cpp requantized to {k}")] = work / f"smollm2-{k}.gguf"
    llama = DrafterOptions(threads=DRAFTER_THREADS)
    models = {"llama.cpp Q4_1": ("llama-cpp", llama)}
    if args.onnx:
        onnx_model = args.onnx_model
        if not onnx_model:
            onnx_model = str(work / "smollm2-int8.onnx")
            tool("export_onnx_draft.py", "--output", onnx_model, "--int8")
        models[ONNX_ROW] = ("onnx", DrafterOptions(onnx_model=onnx_model, threads=DRAFTER_THREADS))
    stacks = {f"stacked: {proposer_name} under {model}": (f"stack:{proposer}+{kind}", opts, model)
              for model, (kind, opts) in models.items()
              for proposer, proposer_name in (("ngram", "prompt lookup"), ("cacheback", "Cacheback"))}
    compared = {
        "llama.cpp Q4_1": models["llama.cpp Q4_1"],
        **{name: ("llama-cpp", DrafterOptions(model_path=str(path), threads=DRAFTER_THREADS))
           for name, path in requantized.items()},
        **{name: m for name, m in models.items() if name != "llama.cpp Q4_1"},
        "Cacheback (LRU n-gram caches)": ("cacheback", DrafterOptions()),
        "prompt lookup (n-gram)": ("ngram", DrafterOptions()),
        **{name: (kind, opts) for name, (kind, opts, _) in stacks.items()},
    }
    return compared, {name: model for name, (_, _, model) in stacks.items()}


def main(args) -> int:
    notes: list[str] = []
    sets = [("repetitive", REPETITIVE), ("edit", EDIT), ("free", FREE)]
    try:
        work = Path(tempfile.mkdtemp(prefix="sled-drafters-"))
        if args.trained:
            (compared, notes, held_out), stacked_on = trained_drafters(args, work), {}
            sets += [("held-out", held_out)] if held_out else []
        else:
            compared, stacked_on = drafters(args, work)
    except RuntimeError as err:  # a tool refused (an unknown --requantized type) or failed
        print(f"sled-bench drafters: {err}", file=sys.stderr)
        return 2
    if args.models_only:
        compared = {name: m for name, m in compared.items() if m[0] not in ("ngram", "cacheback")}
    if not args.stacked:
        compared = {name: m for name, m in compared.items() if name not in stacked_on}
        stacked_on = {}
    k = args.draft_tokens
    # an adaptive run is measured beside the kept adaptive device (unless --no-kept) and fixed K in the same run
    modes = measured_modes(k, args.adaptive, args.fixed_k, args.kept)
    costs = {}
    for model in dict.fromkeys(stacked_on.values()):
        costs[model] = check_cost(*compared[model], k)
        print(f"[bench] {model}: a forward of {k} tokens costs {costs[model]:.2f} one-token steps here", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        # a server caps K at its max_draft_tokens (16 by default) without a word: it must allow the K reported
        with ServerProcess("--max-sessions", "4", "--max-seq-len", "1024", "--threads", str(args.server_threads),
                           "--max-draft-tokens", str(max(16, *(m.k for m in modes)))) as address:
            tokenizer = Tokenizer()
            first_kind, first_opts = next(iter(compared.values()))
            warm_up(address, tokenizer, lambda: create_drafter(first_kind, first_opts), sets[0][1][0], args.max_tokens)
            for repeat in range(args.repeats):  # every drafter once a repeat, so a slow spell of the host hits all
                for (name, (kind, opts)), (label, prompts) in itertools.product(rotated(list(compared.items()), repeat),
                                                                                sets):
                    print(f"[bench] run {repeat + 1}/{args.repeats}: {name}, {label} text"
                          + (f", K {'/'.join(m.label for m in modes)} prompt by prompt" if args.adaptive else "")
                          + " ...", end=" ", flush=True)

                    def make_drafter():
                        d = create_drafter(kind, opts)
                        return d if args.device_pace == 1.0 else Paced(d, args.device_pace)

                    done = run_modes(address, tokenizer, make_drafter, prompts, args.max_tokens, modes)
                    for mode, row in zip(modes, done):
                        runs.setdefault((name, label, mode.label), []).append(row)
                    print(", ".join(f"{'K ' + mode.label + ': ' if args.adaptive else ''}acceptance "
                                    f"{row['acceptance_rate']:.2f}, {row['tokens_per_s']:.1f} tok/s"
                                    for mode, row in zip(modes, done)), flush=True)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    rows = [pooled_run(name, label, done) | {"k": mode} for (name, label, mode), done in runs.items()]
    main_rows = [r for r in rows if r["k"] == modes[0].label]  # the adaptive K's, or the one fixed K's
    ceilings = [
        f"- on this host a forward of {k} tokens costs {model} {cost:.2f} of its one-token steps, so a "
        f"stacked round whose every guess is kept still takes {stack_ceiling(k, cost):.2f} of the model alone's "
        f"drafting time: at most {1 / stack_ceiling(k, cost):.2f}x faster drafting, before any verification time"
        for model, cost in costs.items()
    ]
    # the trained drafters' goals are set at K = --draft-tokens: an adaptive run reads them on its rows at that K
    at_k = [r for r in rows if r["k"] == str(k)] if args.adaptive else []
    if not args.trained:
        goals = stack_ratios(main_rows, stacked_on)
    elif at_k:
        goals = trained_goals(at_k, f"at K = {k}")
    else:
        goals = trained_goals(main_rows, "under the adaptive K" if args.adaptive else None)
    goals = "\n".join(g for g in (adaptive_goals(rows) if args.adaptive else "", goals) if g)
    table = (render_table(rows, args.adaptive) + "\n\n"
             + "\n".join([goals, *notes, *checked_lines(main_rows), walk_line(main_rows, k), *ceilings]))
    print("\n" + table)
    section = (
        f"{marker(args.device_pace, args.adaptive, bool(args.trained))}\n\n"
        f"`sled-bench drafters {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- target: SmolLM2-135M-Instruct (float32, torch, {args.server_threads} thread"
        f"{'s' if args.server_threads > 1 else ''}; each drafter {DRAFTER_THREADS}); greedy; "
        + (f"K chosen each round by the device's adaptive controller, at most {args.draft_tokens}, beside fixed K = "
           + ", ".join(m.label for m in modes if not m.adaptive)
           + " in the same run (a device each, the modes taking turns prompt by prompt)"
           + (f", and {KEPT}: another adaptive device whose controller first ran the set's prompts once, uncounted, "
              "as a device that has run a while" if args.kept else "")
           if args.adaptive else f"K = {args.draft_tokens}")
        + f"; {args.max_tokens} tokens "
        f"a prompt; {len(REPETITIVE)} repetitive prompts (repeat, tables, counting, code), {len(EDIT)} edit prompts "
        f"whose answers repeat their input (docstrings, reformatting, rewriting) and {len(FREE)} free questions"
        + (f", and held-out: the first {len(dict(sets)['held-out'])} held-out prompts of the first trained drafter's "
           "corpus (its .json's, never trained on)" if "held-out" in dict(sets) else "")
        + "; chat template; one device" + (" a mode" if args.adaptive else "")
        + ", prompts one after another, one drafter instance a set"
        + (" (and one adaptive controller, as a device keeps)" if args.adaptive else "")
        + f"; one uncounted generation first; {args.repeats} runs of each, interleaved, each repeat's order starting "
        "one drafter further on, each row over all its runs (their tokens over their time)\n"
        + ("" if args.device_pace == 1.0 else
           f"- the device drafts {args.device_pace:g}x slower than this host: each drafter call (begin, propose, a "
           f"stacked drafter's step ahead, accept) is padded to {args.device_pace:g} times its time here by sleeping, "
           "taking no CPU from the server, whose pace is this host's; a forward's cost in one-token steps is this "
           "host's\n")
        + copied_line(main_rows) + "\n" + CELL + "\n\n" + table + "\n")
    publish(args.markdown, marker(args.device_pace, args.adaptive, bool(args.trained)), section, args.json, rows)
    return 0
