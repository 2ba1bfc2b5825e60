"""Capacity at a latency target: the most devices each mode serves with p95 inter-token latency within --slo-ms.

The device count rises through --devices; at each count a server sized for it serves `sled` devices (replayed
drafts, the adaptive draft length, drafting ahead) and `server-only` devices (the server decodes and streams every
token), --repeats passes each, the pass with the median p95 reported. A mode stops rising at the first count whose
p95 passes the target. Its capacity is the count before, and what stopped it is named: `slo` (the latency target),
`largest count tried`, `kv memory` (the server could not hold that many sessions) or `host` (the replaying process
could not keep the devices drafting at the speed asked: the count measures this host, not the server). Drafts are
replayed as `sled-bench system` replays them. Writes its section of docs/benchmarks.md, a plot, and with --json the
per-count rows and a `capacity` list ({mode, devices, system_tokens_per_s, bound}).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from edge_client.drafters import create_drafter
from edge_client.policy import DraftPolicy
from edge_client.transport import fetch_info

from .load import run_window, summarize
from .replay import K_MAX, DraftClock, ReplayDrafter, prefill_tokens, prompts
from .report import gpu_name, publish
from .system import Drafting, describe_run, measure_drafting, ratio, replayed

MODES = {"sled": DraftPolicy(adaptive=True, max_draft_tokens=K_MAX), "server-only": None}
# Replayed drafting this much slower than asked means the replaying process, not the server, is the bound.
HOST_LAG = 1.25


def run_count(address, tokenizer, ids, drafts, drafting: Drafting, args, n: int, mode: str) -> dict:
    """--repeats passes of one mode at one count; the pass with the median p95 inter-token latency."""
    tables, fulls, confidences = drafts
    prefill_s = [k * drafting.prefill_ms_per_token / 1000 for k in prefill_tokens(ids)]
    policy, rows = MODES[mode], []
    for rep in range(args.repeats):
        clock = DraftClock()
        make = (lambda p: create_drafter("none")) if policy is None else (
            lambda p: ReplayDrafter(tables[p], drafting.ms_per_token / 1000, fulls[p] if fulls else None,
                                    confidences[p] if confidences else None, clock, prefill_s[p]))
        w = asyncio.run(run_window(address, tokenizer, make, ids, n, args.max_tokens, policy or DraftPolicy(0),
                                   args.warmup_s, args.seconds))
        row = summarize(mode, n, w)
        row.update(repeat=rep, drafting_ms_per_token=clock.ms_per_token())
        rows.append(row)
    rows.sort(key=lambda r: r["p95_inter_token_ms"])
    row = dict(rows[(len(rows) - 1) // 2])
    row["repeats_p95_inter_token_ms"] = [r["p95_inter_token_ms"] for r in rows]
    return row


def host_bound(row: dict, drafting: Drafting) -> bool:
    """Whether the replayed devices drafted slower than asked by more than HOST_LAG: too many for this host."""
    reached = row.get("drafting_ms_per_token")
    return reached is not None and reached == reached and reached > HOST_LAG * drafting.ms_per_token


def _say(message: str) -> None:
    print(message, flush=True)


def sweep(args, tokenizer, ids, drafting: Drafting, log=_say) -> tuple[list[dict], list[dict], object]:
    """Every count while any mode still meets the target; returns the rows, each mode's capacity, the server's Info."""
    from .processes import ServerProcess

    rows, bounds, reached, info = [], {}, {}, None
    drafts = None
    for n in args.devices:
        active = [m for m in MODES if m not in bounds]
        if not active:
            break
        server = ServerProcess(*args.server_flags(n))
        try:
            address = server.start()
        except RuntimeError as err:
            if "does not fit" in str(err):
                bounds.update({m: "kv memory" for m in active})
                log(f"[capacity] {n} devices: the server cannot hold that many sessions' KV: {err}")
                break
            raise
        try:
            drafts = drafts or replayed(address, tokenizer, ids, args)
            for mode in active:
                row = run_count(address, tokenizer, ids, drafts, drafting, args, n, mode)
                rows.append(row)
                log(f"[capacity] {n} devices, {mode}: {row['system_tokens_per_s']:.1f} tok/s, p95 inter-token "
                    f"{row['p95_inter_token_ms']:.1f} ms")
                if mode == "sled" and host_bound(row, drafting):
                    bounds[mode] = "host"
                elif row["p95_inter_token_ms"] > args.slo_ms:
                    bounds[mode] = "slo"
                else:
                    reached[mode] = row
            info = asyncio.run(fetch_info(address))
        finally:
            server.stop()
    capacity = [{"mode": m, "devices": reached[m]["devices"] if m in reached else 0,
                 "system_tokens_per_s": reached[m]["system_tokens_per_s"] if m in reached else 0.0,
                 "bound": bounds.get(m, "largest count tried")} for m in MODES]
    return rows, capacity, info


def report(args, rows: list[dict], capacity: list[dict]) -> str:
    by = {(r["mode"], r["devices"]): r for r in rows}
    counts = sorted({r["devices"] for r in rows})
    lines = ["| devices | SLED tok/s | SLED p95 inter-token ms | server-only tok/s | server-only p95 ms | "
             "SLED / server-only |", "|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        s, b = by.get(("sled", n)), by.get(("server-only", n))
        cell = lambda r, key: f"{r[key]:.1f}" if r else "—"  # noqa: E731
        vs = f"{ratio(s['system_tokens_per_s'], b['system_tokens_per_s']):.2f}x" if s and b else "—"
        lines.append(f"| {n} | {cell(s, 'system_tokens_per_s')} | {cell(s, 'p95_inter_token_ms')} | "
                     f"{cell(b, 'system_tokens_per_s')} | {cell(b, 'p95_inter_token_ms')} | {vs} |")
    caps = ["| mode | capacity (devices) | system tok/s there | what stopped the count |", "|---|---:|---:|---|"]
    caps += [f"| {c['mode']} | {c['devices']} | {c['system_tokens_per_s']:.1f} | {c['bound']} |" for c in capacity]
    sled, base = (next(c for c in capacity if c["mode"] == m) for m in ("sled", "server-only"))
    verdict = (f"SLED serves {ratio(sled['devices'], base['devices']):.2f}x as many devices as server-only within "
               f"{args.slo_ms:g} ms" if base["devices"] else "server-only meets the target at no count tried")
    return ("\n".join(lines) + "\n\n" + "\n".join(caps) + f"\n\n- {verdict}; each count is one server sized for it "
            f"(a KV slot a device), {args.repeats} passes of {args.seconds:g} s, the pass with the median p95 "
            f"reported; `host` means the replaying process drafted over {HOST_LAG:g}x slower than asked\n")


def plot(rows: list[dict], slo_ms: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        pts = sorted((r["devices"], r["p95_inter_token_ms"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.axhline(slo_ms, color="grey", linestyle="--", label=f"target {slo_ms:g} ms")
    ax.set(xlabel="devices", ylabel="p95 inter-token latency (ms)", xscale="log", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser():
    from .options import system_parser

    p = system_parser(__doc__, slo_default=50.0, devices="16,32,64,128,256,512")
    p.set_defaults(repeats=3)
    return p


def main(args) -> int:
    from .options import check_system_args
    from .tokenizers import device_tokenizer

    check_system_args(args)
    tokenizer = device_tokenizer(args.tokenizer)
    ids = prompts(tokenizer, args.recordings)
    drafting = measure_drafting(args, ids)
    print(f"[capacity] devices draft at {drafting.ms_per_token:.2f} ms/token ({drafting.source})", flush=True)
    rows, capacity, info = sweep(args, tokenizer, ids, drafting)
    if info is None:
        print("[capacity] no count could be served (the server could not hold the first count's KV)")
        return 1
    heading = ("## Capacity at a latency target" + (" on a GPU" if gpu_name() else "")
               + (f", {args.label}" if args.label else ""))
    name = "capacity" + ("_gpu" if gpu_name() else "") + (f"_{args.label.replace(' ', '_')}" if args.label else "")
    picture = plot(rows, args.slo_ms, Path(args.plots) / f"{name}.png")
    section = (f"{heading}\n\n" + describe_run(args, drafting, info, "capacity", len(ids), [picture]) + "\n"
               + report(args, rows, capacity))
    publish(args.markdown, heading, section, None, [])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "capacity": capacity}, indent=2))
    print(section)
    print("[capacity] " + "; ".join(f"{c['mode']} {c['devices']} ({c['bound']})" for c in capacity))
    return 0
