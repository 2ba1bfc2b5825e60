"""The fused CPU step's effect on the margin: bench_system at a few device counts, server with --fused off and on.

    python scripts/bench_fused.py --devices 4 --repeats 2

Runs scripts/bench_system.py twice, one after the other (`--server-arg=--fused=off`, then `on`), each into a
scratch directory, and writes the sled and server-only rows of both side by side into their section of
docs/benchmarks.md (and, with --json, the rows). The fused step speeds up small batches; this shows which mode's
batches it reaches. Any other option goes to both bench_system runs as it is (e.g. `--seconds 16`, or
`--target random:llama-tiny --draft-match 0.9 --device-ms-per-token 10` for a quick check without the real model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_system import drafting_bound, ratio  # noqa: E402
from bench.report import machine, publish  # noqa: E402

MARKER = "## The fused CPU step and the SLED / server-only margin"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="4", help="device counts, as bench_system takes them (default 4)")
    ap.add_argument("--repeats", type=int, default=2, help="bench_system repeats per configuration (default 2)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args, passed_on = ap.parse_known_args()
    if args.repeats < 1:
        ap.error("--repeats must be positive")
    if any(a.split("=")[0] in ("--out-dir", "--server-arg") for a in passed_on):
        ap.error("--out-dir and --server-arg are set by this script for each run")

    rows = []
    with tempfile.TemporaryDirectory(prefix="sled-bench-fused-") as tmp:
        for fused in ("off", "on"):
            out = Path(tmp) / fused
            cmd = [sys.executable, str(ROOT / "scripts" / "bench_system.py"), "--devices", args.devices,
                   "--repeats", str(args.repeats), f"--server-arg=--fused={fused}",
                   "--markdown", str(out / "system.md"), "--json", str(out / "system.json"),
                   "--out-dir", str(out / "plots"), *passed_on]
            print(f"[bench] fused {fused}: {' '.join(cmd[1:])}", flush=True)
            done = subprocess.run(cmd, cwd=ROOT)
            if done.returncode != 0:
                print(f"[bench] bench_system failed (exit {done.returncode}) with --fused={fused}", file=sys.stderr)
                return 1
            rows += [{**r, "fused": fused} for r in json.loads((out / "system.json").read_text())
                     if r["mode"] in ("sled", "server-only", "device-only")]

    by = {(r["fused"], r["mode"], r["devices"]): r for r in rows}
    counts = sorted({r["devices"] for r in rows})
    lines = ["| devices | server | sled tok/s | server-only tok/s | server-only step ms | SLED / server-only "
             "(per pass) |", "|---:|---|---:|---:|---:|---:|"]
    for n in counts:
        for fused in ("off", "on"):
            s, b = by[(fused, "sled", n)], by[(fused, "server-only", n)]
            per = ", ".join(f"{x:.2f}x" for x in s.get("repeats_ratio_to_server_only", []))
            lines.append(f"| {n} | `--fused {fused}` | {s['system_tokens_per_s']:.1f} | {b['system_tokens_per_s']:.1f} | "
                         f"{b['server_step_ms']:.1f} | "
                         f"{ratio(s['system_tokens_per_s'], b['system_tokens_per_s']):.2f}x ({per}) |")
    notes = []
    for n in counts:
        cap, s, b = (by[("on", m, n)]["system_tokens_per_s"] for m in ("device-only", "sled", "server-only"))
        k, step = by[("on", "sled", n)]["mean_draft_tokens"], by[("on", "sled", n)]["server_step_ms"]
        cap = drafting_bound(cap, k, n, step)
        notes.append(f"- {n} devices: the drafters' own rate r × (1 + max(0, 1 − r·s) / K) at SLED's mean K {k:.2f} "
                     f"and step s {step:.1f} ms, {cap:.1f} tok/s, is {ratio(cap, b):.2f}x server-only with "
                     f"`--fused on`; SLED reached {ratio(s, cap):.0%} of it")
    section = (
        f"{MARKER}\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU)\n"
        f"- command: `python scripts/bench_fused.py {' '.join(sys.argv[1:])}` (bench_system with "
        "`--server-arg=--fused=off`, then `on`, one after the other; each row is that run's median, as in the "
        "system benchmark)\n\n" + "\n".join(lines) + "\n\n"
        "Every committed token is drafted by its device but for at most one a round (the correction, or a bonus not "
        "drafted ahead), which costs the device the round trip, at least a step s, so SLED cannot pass its devices' "
        "own drafting rate r (device-only) × (1 + max(0, 1 − r·s) / K) at mean draft length K (the derivation: "
        "`drafting_bound` in scripts/bench_system.py); that over server-only bounds the margin:\n\n"
        + "\n".join(notes) + "\n"
    )
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
