"""First figures: system tokens/s and acceptance for N concurrent sessions, SLED vs server-only, in one run.

One real sled-server process (the real SmolLM2 target); N device sessions run concurrently in this
process, each with its own drafter. Both modes use the same server, prompts and token budget, side by
side in one run, so the ratio is what counts on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.sampling import SamplingParams
from edge_client.tokenizer import Tokenizer

from .cli import counts_arg, positive
from sim.processes import ServerProcess
from .report import machine, publish
from .runner import Job, prompts, run

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## First figures: SLED vs server-only on the real model pair"


def first_table(rows: list[dict], counts: list[int]) -> str:
    """The section's table: per session count, each mode's pass with the median system tok/s (the lower middle one
    of an even number), the ratio of those, and SLED / server-only pass by pass (both modes of a pass ran one after
    the other)."""
    lines = [
        "| sessions | SLED tok/s | server-only tok/s | ratio | acceptance | mean accept. length | SLED batch | "
        "server-only batch | ratio per pass |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in counts:
        runs = {d: sorted((r for r in rows if r["sessions"] == n and r["drafter"] == d),
                          key=lambda r: r["system_tokens_per_s"]) for d in ("llama-cpp", "none")}
        s, b = (runs[d][(len(runs[d]) - 1) // 2] for d in ("llama-cpp", "none"))
        paired = {r["pass"]: r["system_tokens_per_s"] for r in runs["none"]}
        per_pass = ", ".join(f"{r['system_tokens_per_s'] / paired[r['pass']]:.2f}x"
                             for r in sorted(runs["llama-cpp"], key=lambda r: r["pass"]) if r["pass"] in paired)
        lines.append(f"| {n} | {s['system_tokens_per_s']:.1f} | {b['system_tokens_per_s']:.1f} | "
                     f"{s['system_tokens_per_s'] / b['system_tokens_per_s']:.2f}x | {s['acceptance_rate']:.2f} | "
                     f"{s['mean_acceptance_length']:.2f} | {s['mean_batch_sessions']:.1f} | "
                     f"{b['mean_batch_sessions']:.1f} | {per_pass} |")
    return "\n".join(lines)


def drafter_threads(n: int) -> int:
    """Each of n co-located drafters gets its share of this machine's cores, one thread at least."""
    return max(1, (os.cpu_count() or 1) // n)


def run_sessions(address: str, tokenizer: Tokenizer, drafter: str, n: int, max_tokens: int, k: int,
                 temperature: float, draft_ahead: bool = False) -> dict:
    drafters = [create_drafter(drafter, DrafterOptions(context_size=1024, threads=drafter_threads(n)))
                for _ in range(n)]
    policy = DraftPolicy(draft_tokens=k, adaptive=False, draft_ahead=draft_ahead)
    jobs = [Job(d, Request(ids, max_tokens=max_tokens, policy=policy,
                           sampling=SamplingParams(temperature=temperature, seed=i if temperature > 0 else None)))
            for i, (d, ids) in enumerate(zip(drafters, prompts(tokenizer, n)))]
    try:
        s = run(address, tokenizer, jobs).summary()
    finally:
        for d in drafters:
            d.close()
    return {"drafter": drafter, "sessions": n, "per_session_tokens_per_s": s["tokens_per_s"],
            **{key: s[key] for key in ("tokens", "wall_s", "system_tokens_per_s", "acceptance_rate",
                                       "mean_acceptance_length", "server_steps", "mean_batch_sessions")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=counts_arg, default=counts_arg("1,4,16"),
                   help="comma-separated concurrent session counts (default 1,4,16)")
    p.add_argument("--max-tokens", type=positive(int), default=64, help="tokens generated per session (default 64)")
    p.add_argument("--draft-tokens", type=positive(int), default=4, help="K for the llama.cpp drafter (default 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    p.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                   help="let each drafter draft ahead while its draft is verified (default off: here it would draft "
                        "on the cores the server verifies on, and slow every step down)")
    p.add_argument("--repeats", type=positive(int), default=3,
                   help="passes over every session count and mode, each pass in the other order (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", metavar="FILE", default=str(ROOT / "docs" / "benchmarks.md"),
                   help="markdown file whose 'First figures' section is rewritten (default docs/benchmarks.md)")
    return p


def main(args) -> int:
    counts, rows = args.sessions, []
    try:
        with ServerProcess("--max-sessions", str(max(counts) + 2), "--max-seq-len", "1024",
                           "--max-wait-ms", "5") as address:
            tokenizer = Tokenizer()
            run_sessions(address, tokenizer, "llama-cpp", 1, 8, args.draft_tokens, 0.0)  # warm caches
            plan = [(p, n, d) for p in range(1, args.repeats + 1) for n in counts
                    for d in (("llama-cpp", "none") if p % 2 else ("none", "llama-cpp"))]
            for i, (p, n, drafter) in enumerate(plan, 1):
                print(f"[bench] {i}/{len(plan)}: pass {p}, {n} sessions, drafter {drafter} ...", end=" ", flush=True)
                row = run_sessions(address, tokenizer, drafter, n, args.max_tokens, args.draft_tokens,
                                               args.temperature, args.draft_ahead)
                print(f"{row['system_tokens_per_s']:.1f} tok/s, acceptance {row['acceptance_rate']:.2f}", flush=True)
                rows.append({**row, "pass": p})
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    table = first_table(rows, counts)
    print("\n" + table)
    publish(args.markdown, MARKER, section(args, table), args.json, rows)
    return 0


def section(args, table: str) -> str:
    counts = args.sessions
    return (
        f"{MARKER}\n\n`sled-bench first {shlex.join(sys.argv[2:])}` (also `make bench`) on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; devices and server share these cores.\n\n"
        f"- target: SmolLM2-135M-Instruct (the GGUF dequantized to float32, torch on CPU); drafter: the same GGUF "
        f"(Q4_1) in llama.cpp, K = {args.draft_tokens}, drafting ahead {'on' if args.draft_ahead else 'off'}, "
        f"each session's drafter with its share of the {os.cpu_count()} cores ("
        + ", ".join(f"{n} sessions {drafter_threads(n)}" for n in counts) + f" threads); {args.max_tokens} tokens a "
        f"session, temperature {args.temperature:g}, chat prompts\n"
        "- server-only: the same server decodes every token (`--drafter none`), batched across sessions; system "
        "tok/s: all generated tokens over the wall time of the round; batch: verifications a step\n"
        f"- {args.repeats} passes, the modes' order reversed every other one; each row is the median pass, with "
        "SLED / server-only pass by pass\n"
        "- co-located: the drafters take CPU time from verification here, which server-only does not pay; real devices "
        "draft on their own hardware (the system benchmark measures the server apart from drafting)\n\n"
        + table + "\n")
