"""First figures: system tokens/s and acceptance for N concurrent sessions, SLED vs server-only, in one run.

One real sled-server process (the real SmolLM2 target); N device sessions run concurrently in this
process, each with its own drafter. Both modes use the same server, prompts and token budget, side by
side in one run, so the ratio is what counts on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_client.drafters import DrafterOptions, create_drafter  # noqa: E402
from edge_client.generation import generate  # noqa: E402
from edge_client.sampling import SamplingParams  # noqa: E402
from edge_client.tokenizer import Tokenizer  # noqa: E402
from edge_client.transport import VerifierClient  # noqa: E402
from edge_client.workload import QUESTIONS  # noqa: E402
from bench.cli import counts_arg  # noqa: E402
from bench.processes import ServerProcess  # noqa: E402
from bench.report import machine, publish  # noqa: E402


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


async def run_sessions(address: str, tokenizer: Tokenizer, drafter: str, n: int, max_tokens: int, k: int,
                       temperature: float, draft_ahead: bool = False) -> dict:
    client = VerifierClient(address)
    drafters = [create_drafter(drafter, DrafterOptions(context_size=1024, threads=drafter_threads(n)))
                for _ in range(n)]
    prompts = [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
               for i in range(n)]
    before = await client.info()
    start = time.perf_counter()
    results = await asyncio.gather(*[
        generate(client, d, tokenizer, p, max_tokens=max_tokens, draft_tokens=k, adaptive=False,
                 draft_ahead=draft_ahead,
                 sampling=SamplingParams(temperature=temperature, seed=i if temperature > 0 else None))
        for i, (d, p) in enumerate(zip(drafters, prompts))
    ])
    wall = time.perf_counter() - start
    after = await client.info()
    await client.close()
    for d in drafters:
        d.close()
    tokens = sum(len(r.token_ids) for r in results)
    draft = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    rounds = sum(r.rounds for r in results)
    steps = after.stats.steps - before.stats.steps
    verifications = after.stats.verifications - before.stats.verifications
    return {
        "drafter": drafter, "sessions": n, "tokens": tokens, "wall_s": wall,
        "system_tokens_per_s": tokens / wall,
        "per_session_tokens_per_s": sum(r.tokens_per_second for r in results) / n,
        "acceptance_rate": accepted / draft if draft else 0.0,
        "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
        "server_steps": steps,
        "mean_batch_sessions": verifications / steps if steps else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=counts_arg, default="1,4,16",
                    help="comma-separated concurrent session counts (default 1,4,16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per session (default 64)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="K for the llama.cpp drafter (default 4)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    ap.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                    help="let each drafter draft ahead while its draft is verified (default off: here it would draft "
                         "on the cores the server verifies on, and slow every step down)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes over every session count and mode, each pass in the other order (default 3)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--markdown", metavar="FILE", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="markdown file whose 'First figures' section is rewritten (default docs/benchmarks.md)")
    args = ap.parse_args()
    counts = args.sessions
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    rows = []
    try:
        with ServerProcess("--max-sessions", str(max(counts) + 2), "--max-seq-len", "1024",
                           "--max-wait-ms", "5") as address:
            tokenizer = Tokenizer()
            asyncio.run(run_sessions(address, tokenizer, "llama-cpp", 1, 8, args.draft_tokens, 0.0))  # warm caches
            plan = [(p, n, d) for p in range(1, args.repeats + 1) for n in counts
                    for d in (("llama-cpp", "none") if p % 2 else ("none", "llama-cpp"))]
            for i, (p, n, drafter) in enumerate(plan, 1):
                print(f"[bench] {i}/{len(plan)}: pass {p}, {n} sessions, drafter {drafter} ...", end=" ", flush=True)
                row = asyncio.run(run_sessions(address, tokenizer, drafter, n, args.max_tokens, args.draft_tokens,
                                               args.temperature, args.draft_ahead))
                print(f"{row['system_tokens_per_s']:.1f} tok/s, acceptance {row['acceptance_rate']:.2f}", flush=True)
                rows.append({**row, "pass": p})
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1

    table = first_table(rows, counts)
    print("\n" + table)
    cmd = "python scripts/bench_first.py " + " ".join(sys.argv[1:])
    section = (
        "## First figures: SLED vs server-only on the real model pair\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU); devices and server share these cores\n"
        f"- command: `{cmd.strip()}` (also `make bench`)\n"
        f"- target: SmolLM2-135M-Instruct (GGUF dequantized to float32, torch on CPU); drafter: the same GGUF "
        f"(Q4_1) in llama.cpp, K = {args.draft_tokens}, drafting ahead {'on' if args.draft_ahead else 'off'}, "
        f"each session's drafter with its share of the {os.cpu_count()} cores (1 thread at least: "
        + ", ".join(f"{n} sessions {drafter_threads(n)}" for n in counts) + f"); {args.max_tokens} tokens per "
        f"session, temperature {args.temperature:g}, chat prompts\n"
        "- server-only = the same server with `--drafter none`: it decodes every token, batched across sessions\n"
        "- system tok/s = all generated tokens / wall time of the whole round; batch = verifications per server step\n"
        f"- {args.repeats} passes, the modes' order reversed on every other one; each mode's row is its pass with the "
        "median system tok/s, and 'ratio per pass' gives SLED / server-only of each pass\n"
        "- co-located: the N drafters run on the same cores as the server, so SLED's drafting takes CPU time from "
        "verification, which server-only does not pay (drafting ahead, off here unless asked, would draft during "
        "every step). Real devices "
        "draft on their own hardware: the capacity comparison, with the server measured apart from drafting, is the "
        "system benchmark below\n\n"
        + table + "\n"
    )
    publish(args.markdown, "## First figures", section, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
