"""Capacity at a latency target: the most devices each mode serves with the p95 over requests of TPOT within
--slo-tpot-ms and of TTFT within --slo-ttft-ms.

TPOT and TTFT are vLLM's (and DistServe's): TTFT is a request's time to its first tokens, TPOT its (end-to-end −
TTFT) / (tokens − 1); speculation delivers a round's tokens together, so the inter-token gaps (reported beside) are
no target. The device count rises through --devices; at each count a server sized for it serves `sled` devices
(replayed drafts, the adaptive draft length, drafting ahead) and `server-only` devices (the server decodes and
streams every token), --repeats passes each, the pass with the median p95 TPOT reported. A mode stops rising at the
first count that misses the target; the counts between its last one met and that one are then bisected to within
--refine times the count met. Its capacity is the largest count met, and what stopped it is named: `slo` (the
latency target), `largest count tried`, `kv memory` (the server could not hold that many sessions) or `host` (the
replaying process could not keep the devices drafting at the speed asked: the count measures this host, not the
server). Drafts are replayed as `sled-bench system` replays them. Writes its section of docs/benchmarks.md, a plot,
and with --json the per-count rows and a `capacity` list ({mode, devices, system_tokens_per_s, bound, slo}).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from edge_client.drafters import create_drafter
from edge_client.policy import DraftPolicy
from edge_client.transport import fetch_info

from .load import run_window, summarize
from .replay import K_MAX, DraftClock, ReplayDrafter, prefill_tokens
from .report import gpu_name, publish
from .runner import prompts
from .system import Drafting, describe_run, measure_drafting, ratio, replayed

MODES = {"sled": DraftPolicy(adaptive=True, max_draft_tokens=K_MAX), "server-only": None}
# Replayed drafting this much slower than asked means the replaying process, not the server, is the bound.
HOST_LAG = 1.25


def run_count(address, tokenizer, ids, drafts, drafting: Drafting, args, n: int, mode: str) -> dict:
    """--repeats passes of one mode at one count; the pass with the median p95 TPOT (a pass where no request
    ended in its window sorts last)."""
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
    rows.sort(key=lambda r: (r["p95_tpot_ms"] != r["p95_tpot_ms"], r["p95_tpot_ms"]))
    row = dict(rows[(len(rows) - 1) // 2])
    row["repeats_p95_tpot_ms"] = [r["p95_tpot_ms"] for r in rows]
    return row


def slo(args) -> dict[str, float]:
    return {"p95_tpot_ms": args.slo_tpot_ms, "p95_ttft_ms": args.slo_ttft_ms}


def meets(row: dict, target: dict[str, float]) -> bool:
    """Whether a row is within every metric of the target (a metric not measured, nan, is not)."""
    return all(row[metric] <= bound for metric, bound in target.items())


def host_bound(row: dict, drafting: Drafting) -> bool:
    """Whether the replayed devices drafted slower than asked by more than HOST_LAG: too many for this host."""
    reached = row.get("drafting_ms_per_token")
    return reached is not None and reached == reached and reached > HOST_LAG * drafting.ms_per_token


class CountSearch:
    """Which device counts to run: up through `counts` while any mode meets the target (a mode stops rising at its
    first miss), then, for each mode that missed at a count, bisection between its largest count that met the
    target and the smallest that missed, until the two are within `refine` times the count met (or a device).
    A mode stopped by the host is not bisected: the count measures the host."""

    def __init__(self, counts, modes, refine: float = 0.0):
        self.counts, self.modes, self.refine = sorted(set(counts)), list(modes), refine
        self.met: dict[str, dict] = {}  # mode -> its row at the largest count that met the target
        self.missed: dict[str, tuple[int, str]] = {}  # mode -> (the smallest count that missed, what stopped it)
        self._rising = iter(self.counts)

    def next(self) -> tuple[int, list[str]] | None:
        """The next count and the modes to run at it; None when the search is done."""
        active = [m for m in self.modes if m not in self.missed]
        n = next(self._rising, None) if active else None
        if n is not None:
            return n, active
        mids = {m: mid for m in self.modes if (mid := self._between(m)) is not None}
        if not mids:
            return None
        n = min(mids.values())
        return n, [m for m, mid in mids.items() if mid == n]

    def _between(self, mode: str) -> int | None:
        if mode not in self.missed or self.missed[mode][1] == "host":
            return None
        low, high = self.met[mode]["devices"] if mode in self.met else 0, self.missed[mode][0]
        return (low + high) // 2 if high - low > max(1.0, self.refine * low) else None

    def record(self, mode: str, n: int, row: dict | None, bound: str | None) -> None:
        """A mode's run at n devices: its row, and None where it met the target, else what stopped it."""
        if bound is None:
            if mode not in self.met or n > self.met[mode]["devices"]:
                self.met[mode] = row
        elif mode not in self.missed or n < self.missed[mode][0]:
            self.missed[mode] = (n, bound)

    def capacity(self, target: dict[str, float]) -> list[dict]:
        """Each mode's largest count that met the target ({mode, devices, system_tokens_per_s, bound, slo})."""
        return [{"mode": m, "devices": self.met[m]["devices"] if m in self.met else 0,
                 "system_tokens_per_s": self.met[m]["system_tokens_per_s"] if m in self.met else 0.0,
                 "bound": self.missed[m][1] if m in self.missed else "largest count tried", "slo": target}
                for m in self.modes]


def _say(message: str) -> None:
    print(message, flush=True)


def sweep(args, tokenizer, ids, drafting: Drafting, log=_say, recorded: list | None = None
          ) -> tuple[list[dict], list[dict], object]:
    """Every count while any mode still meets the target; returns the rows, each mode's capacity, the server's Info.
    `recorded`, where given, receives the drafts replayed (tables, greedy outputs, confidences)."""
    from sim.processes import ServerProcess

    rows, info, drafts = [], None, None
    search = CountSearch(args.devices, MODES, args.refine)
    while (step := search.next()) is not None:
        n, active = step
        server = ServerProcess(*args.server_flags(n))
        try:
            address = server.start()
        except RuntimeError as err:
            if "does not fit" not in str(err):
                raise
            for mode in active:
                search.record(mode, n, None, "kv memory")
            log(f"[capacity] {n} devices: the server cannot hold that many sessions' KV: {err}")
            continue
        try:
            if drafts is None:
                drafts = replayed(address, tokenizer, ids, args)
                if recorded is not None:
                    recorded.append(drafts)
            for mode in active:
                row = run_count(address, tokenizer, ids, drafts, drafting, args, n, mode)
                rows.append(row)
                log(f"[capacity] {n} devices, {mode}: {row['system_tokens_per_s']:.1f} tok/s, p95 TPOT "
                    f"{row['p95_tpot_ms']:.1f} ms, p95 TTFT {row['p95_ttft_ms']:.0f} ms over "
                    f"{row['requests_timed']} requests")
                bound = ("host" if mode == "sled" and host_bound(row, drafting)
                         else None if meets(row, slo(args)) else "slo")
                search.record(mode, n, row, bound)
            info = asyncio.run(fetch_info(address))
        finally:
            server.stop()
    return rows, search.capacity(slo(args)), info


def report(args, rows: list[dict], capacity: list[dict]) -> str:
    by = {(r["mode"], r["devices"]): r for r in rows}
    counts = sorted({r["devices"] for r in rows})
    lines = ["| devices | mode | system tok/s | p50 TPOT ms | p95 TPOT ms | p95 TTFT ms | p50 inter-token ms | "
             "p95 inter-token ms | requests | SLED / server-only |", "|---:|---|" + "---:|" * 8]
    for n in counts:
        base = by.get(("server-only", n))
        for mode in MODES:
            r = by.get((mode, n))
            if r is None:
                continue
            vs = (f"{ratio(r['system_tokens_per_s'], base['system_tokens_per_s']):.2f}x" if mode == "sled" and base
                  else "")
            lines.append(f"| {n} | {mode} | {r['system_tokens_per_s']:.1f} | {r['p50_tpot_ms']:.1f} | "
                         f"{r['p95_tpot_ms']:.1f} | {r['p95_ttft_ms']:.0f} | {r['p50_inter_token_ms']:.1f} | "
                         f"{r['p95_inter_token_ms']:.1f} | {r['requests_timed']} | {vs} |")
    caps = ["| mode | capacity (devices) | system tok/s there | what stopped the count |", "|---|---:|---:|---|"]
    caps += [f"| {c['mode']} | {c['devices']} | {c['system_tokens_per_s']:.1f} | {c['bound']} |" for c in capacity]
    sled, base = (next(c for c in capacity if c["mode"] == m) for m in ("sled", "server-only"))
    target = f"p95 TPOT ≤ {args.slo_tpot_ms:g} ms and p95 TTFT ≤ {args.slo_ttft_ms:g} ms"
    verdict = (f"SLED serves {ratio(sled['devices'], base['devices']):.2f}x as many devices as server-only at "
               f"{target}" if base["devices"] else f"server-only meets {target} at no count tried")
    return ("\n".join(lines) + "\n\n" + "\n".join(caps) + f"\n\n- {verdict}; a mode's counts between its last met "
            f"and its first missed are bisected to within {args.refine:.0%} of the count met; each count is one "
            f"server sized for it (a KV slot a device), {args.repeats} passes of {args.seconds:g} s, the pass with "
            f"the median p95 TPOT reported; TPOT and TTFT over the requests that ended inside the window; `host` "
            f"means the replaying process drafted over {HOST_LAG:g}x slower than asked\n")


def plot(rows: list[dict], slo_tpot_ms: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        pts = sorted((r["devices"], r["p95_tpot_ms"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.axhline(slo_tpot_ms, color="grey", linestyle="--", label=f"target {slo_tpot_ms:g} ms")
    ax.set(xlabel="devices", ylabel="p95 TPOT (ms)", xscale="log", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser():
    from .options import system_parser

    from .cli import at_least, positive

    p = system_parser(__doc__, devices="16,32,64,128,256,512")
    p.add_argument("--slo-tpot-ms", type=positive(), default=50.0,
                   help="the target's p95 over requests of TPOT, (end-to-end − TTFT) / (tokens − 1) (default 50)")
    p.add_argument("--slo-ttft-ms", type=positive(), default=2000.0,
                   help="the target's p95 over requests of TTFT, the time to the first tokens (default 2000)")
    p.add_argument("--refine", type=at_least(0), default=0.25, metavar="SHARE",
                   help="bisect each mode's counts between its last one met and its first missed until they are "
                        "within this share of the count met (default 0.25; 0: to the device)")
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
    picture = plot(rows, args.slo_tpot_ms, Path(args.plots) / f"{name}.png")
    section = (f"{heading}\n\n" + describe_run(args, drafting, info, "capacity", len(ids), [picture]) + "\n"
               + report(args, rows, capacity))
    publish(args.markdown, heading, section, None, [])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "capacity": capacity}, indent=2))
    print(section)
    print("[capacity] " + "; ".join(f"{c['mode']} {c['devices']} ({c['bound']})" for c in capacity))
    return 0
