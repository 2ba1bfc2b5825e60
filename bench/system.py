"""SLED against server-only and device-only across device counts, with drafts replayed apart from the server.

Record once, along each prompt's greedy output by the target, the real drafter's proposal at every prefix (or, with
a random target, synthesize drafts right with --draft-match's probability); then replay N devices in a closed loop,
each proposing exactly what the drafter proposed at its context after sleeping its measured drafting time, so the
server is measured apart from drafting on the same cores. Modes: `sled` (the adaptive draft length, drafting ahead:
the device's defaults), `server-only` (the same server decodes and streams every token), `device-only` (the drafter
alone, unverified: N devices give N times one device's rate). Beside them, fixed K = 2, 4, 8 and the adaptive K
without drafting ahead. Every configuration runs --repeats times in alternating order; the median run is reported,
with SLED / server-only pass by pass. Writes its section of docs/benchmarks.md, JSON rows and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from edge_client.info import describe_kernels
from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.policy import DraftPolicy
from edge_client.transport import fetch_info

from .load import run_window, summarize
from .replay import (K_MAX, DraftClock, ReplayDrafter, device_only_rate, drafting_ms_alone, greedy_outputs,
                     match_rate, measure_prefill, prefill_tokens, record_tables, synthesize_tables)
from .report import gpu_name, machine, publish
from .runner import prompts

ROOT = Path(__file__).resolve().parent.parent
# mode -> its devices' policy (None: server-only)
MODES = {"server-only": None,
         "sled": DraftPolicy(adaptive=True, max_draft_tokens=K_MAX),
         "sled-k2": DraftPolicy(draft_tokens=2, adaptive=False, max_draft_tokens=K_MAX),
         "sled-k4": DraftPolicy(draft_tokens=4, adaptive=False, max_draft_tokens=K_MAX),
         "sled-k8": DraftPolicy(draft_tokens=8, adaptive=False, max_draft_tokens=K_MAX),
         "sled-no-ahead": DraftPolicy(adaptive=True, max_draft_tokens=K_MAX, draft_ahead=False)}
FIXED = ("sled-k2", "sled-k4", "sled-k8")


def ratio(x: float, y: float) -> float:
    """x / y, or nan when the denominator committed nothing (a starved run): the table shows it, nothing raises."""
    return x / y if y > 0 else float("nan")


def drafting_bound(device_only_tok_s: float, mean_k: float, devices: int, step_ms: float) -> float:
    """The most tokens/s these devices can commit: every committed token was drafted by its device but at most one
    a round (the correction, or a bonus not drafted ahead), which comes after a round trip of at least a step that
    the device spends waiting or drafting ahead what the verdict throws away. At drafting rate r and step s a
    device commits at most r × (1 + max(0, 1 − r·s) / K); nan without drafts (a starved run)."""
    free = max(0.0, 1.0 - device_only_tok_s / devices * step_ms / 1000.0)
    return device_only_tok_s * (1 + free * ratio(1, mean_k))


def server_rate(row: dict) -> float:
    """Tokens committed per second of server step time: what a mode would commit with the server never idle."""
    return ratio(row["system_tokens_per_s"], row["server_busy_share"])


def pick_medians(runs: dict[tuple[int, str], list[dict]]) -> dict[tuple[str, int], dict]:
    """Per (mode, devices), the run with the median system tok/s (the lower middle of an even count), with every
    pass's tok/s and its SLED / server-only ratio, passes paired by number."""
    by = {}
    for (n, mode), done in runs.items():
        done.sort(key=lambda r: r["repeat"])
        row = dict(sorted(done, key=lambda r: r["system_tokens_per_s"])[(len(done) - 1) // 2])
        row["repeats_system_tokens_per_s"] = [r["system_tokens_per_s"] for r in done]
        base = [r["system_tokens_per_s"] for r in runs[(n, "server-only")]]
        row["repeats_ratio_to_server_only"] = [ratio(r["system_tokens_per_s"], b) for r, b in zip(done, base)]
        by[(mode, n)] = row
    return by


def device_only_row(n: int, rate: float, spt: float) -> dict:
    return {"mode": "device-only", "devices": n, "system_tokens_per_s": n * rate, "per_device_tokens_per_s": rate,
            "p50_inter_token_ms": spt * 1000, "p95_inter_token_ms": spt * 1000, "acceptance_rate": 0.0,
            "mean_draft_tokens": 0.0, "server_step_ms": 0.0, "server_forward_ms": 0.0, "server_batch_sessions": 0.0,
            "server_busy_share": 0.0}


def capacity(counts: list[int], by: dict, slo_ms: float) -> dict[str, int]:
    """Per mode, the largest count whose p95 inter-token latency is within slo_ms (0: none)."""
    return {mode: max([n for n in counts if by[(mode, n)]["p95_inter_token_ms"] <= slo_ms], default=0)
            for mode in ("sled", "server-only", "device-only")}


def tables(counts: list[int], by: dict, slo_ms: float) -> str:
    """The section's tables: the modes, the bounds, adaptive against fixed K, drafting ahead against waiting."""
    passes = lambda xs: ", ".join(f"{x:.2f}x" for x in xs)  # noqa: E731
    main = ["| devices | mode | system tok/s | per device | ITL p50 ms | ITL p95 ms | acceptance | step ms | "
            "sessions a step | server busy | SLED / server-only | per pass |", "|---:|---|" + "---:|" * 10]
    for n in counts:
        base = by[("server-only", n)]["system_tokens_per_s"]
        for mode in ("sled", "server-only", "device-only"):
            r = by[(mode, n)]
            vs = f"{ratio(r['system_tokens_per_s'], base):.2f}x" if mode == "sled" else ""
            main.append(f"| {n} | {mode} | {r['system_tokens_per_s']:.1f} | {r['per_device_tokens_per_s']:.1f} | "
                        f"{r['p50_inter_token_ms']:.1f} | {r['p95_inter_token_ms']:.1f} | {r['acceptance_rate']:.2f} | "
                        f"{r['server_step_ms']:.1f} | {r['server_batch_sessions']:.1f} | {r['server_busy_share']:.0%} | "
                        f"{vs} | {passes(r['repeats_ratio_to_server_only']) if mode == 'sled' else ''} |")
    bounds = []
    for n in counts:
        sled, base, alone = by[("sled", n)], by[("server-only", n)], by[("device-only", n)]
        devices_side = ratio(drafting_bound(alone["system_tokens_per_s"], sled["mean_draft_tokens"], n,
                                            sled["server_step_ms"]), base["system_tokens_per_s"])
        bounds.append(f"{n} devices {devices_side:.2f}x / {ratio(server_rate(sled), server_rate(base)):.2f}x")
    k = ["| devices | adaptive tok/s | its mean K | best fixed K | its tok/s | adaptive / best | per pass |",
         "|---:|---:|---:|---:|---:|---:|---:|"]
    ahead = ["| devices | drafting ahead tok/s | waiting tok/s | ratio | per pass |", "|---:|---:|---:|---:|---:|"]
    for n in counts:
        ad, wait = by[("sled", n)], by[("sled-no-ahead", n)]
        best = max((by[(m, n)] for m in FIXED), key=lambda r: r["system_tokens_per_s"])
        per = [ratio(a, b) for a, b in zip(ad["repeats_system_tokens_per_s"], best["repeats_system_tokens_per_s"])]
        k.append(f"| {n} | {ad['system_tokens_per_s']:.1f} | {ad['mean_draft_tokens']:.2f} | "
                 f"{best['mode'].removeprefix('sled-k')} | {best['system_tokens_per_s']:.1f} | "
                 f"{ratio(ad['system_tokens_per_s'], best['system_tokens_per_s']):.2f}x | {passes(per)} |")
        per = [ratio(a, b) for a, b in zip(ad["repeats_system_tokens_per_s"], wait["repeats_system_tokens_per_s"])]
        ahead.append(f"| {n} | {ad['system_tokens_per_s']:.1f} | {wait['system_tokens_per_s']:.1f} | "
                     f"{ratio(ad['system_tokens_per_s'], wait['system_tokens_per_s']):.2f}x | {passes(per)} |")
    caps = capacity(counts, by, slo_ms)
    return ("\n".join(main) + "\n\n"
            "- bounds on SLED / server-only, from the devices' side (each device commits at most its drafting rate r "
            "× (1 + max(0, 1 − r·s) / K) at step s and mean draft K) / from the server's side (each mode's tokens "
            "per second of step time): " + ", ".join(bounds) + "\n"
            f"- capacity (the largest count here with p95 inter-token latency ≤ {slo_ms:g} ms): "
            + ", ".join(f"{m} {c}" for m, c in caps.items()) + "\n\n"
            "Adaptive draft length against fixed K (the same replayed drafter, the same run):\n\n" + "\n".join(k)
            + "\n\nDrafting ahead against waiting for each verdict (adaptive K both):\n\n" + "\n".join(ahead) + "\n")


@dataclass
class Drafting:
    """The replayed devices' drafting: time per token, prefill per prompt token, and where each came from."""

    ms_per_token: float
    prefill_ms_per_token: float
    source: str


def measure_drafting(args, ids: list[list[int]]) -> Drafting:
    """The devices' drafting speed: as given (or recorded in a --draft-match file), else one llama.cpp drafter
    alone on this machine before the server starts, the median of three runs, and its prompts' prefill."""
    if args.device_ms_per_token is not None and (args.device_prefill_ms_per_token is not None
                                                 or importlib.util.find_spec("llama_cpp") is None):
        return Drafting(args.device_ms_per_token, args.device_prefill_ms_per_token or 0.0, args.drafting_source)
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=512, threads=args.device_threads))
    try:
        timed = drafting_ms_alone(drafter, ids[0], args.max_tokens)
        spt = float(np.median(timed)) / 1000
        prefill = args.device_prefill_ms_per_token
        if prefill is None:
            prefill = measure_prefill(drafter, ids, spt)[0] * 1000
    finally:
        drafter.close()
    if args.device_ms_per_token is not None:
        return Drafting(args.device_ms_per_token, prefill, args.drafting_source)
    return Drafting(spt * 1000, prefill, f"one llama.cpp drafter alone, {args.device_threads} threads, before the "
                                         f"server started: {', '.join(f'{x:.1f}' for x in timed)} ms/token; the median")


def replayed(address, tokenizer, ids, args) -> tuple[list, list | None, list | None]:
    """The drafts to replay: the real drafter's along the target's greedy outputs, or synthesized at --draft-match."""
    if args.draft_match is not None:
        fulls = greedy_outputs(address, tokenizer, ids, args.max_tokens)
        return synthesize_tables(fulls, [len(i) for i in ids], args.draft_match, tokenizer.vocab_size), fulls, None
    tables, fulls, confidences = record_tables(address, tokenizer, ids, args.max_tokens)
    args.draft_match_measured = match_rate(tables, fulls)
    return tables, fulls, confidences


def run_all(address, tokenizer, ids, drafts, drafting: Drafting, args, link=None) -> dict:
    """Every (count, mode) --repeats times, the order reversed on every other pass, so that a slow stretch of a shared
    machine does not fall on one configuration; returns the runs by (count, mode)."""
    from tqdm import tqdm

    tables, fulls, confidences = drafts
    prefill_s = [n * drafting.prefill_ms_per_token / 1000 for n in prefill_tokens(ids)]
    spt = drafting.ms_per_token / 1000
    plan = [(n, mode) for n in args.devices for mode in MODES]
    order = [(rep, cfg) for rep in range(args.repeats) for cfg in (plan if rep % 2 == 0 else plan[::-1])]
    order = [(-1, cfg) for cfg in plan] * args.warmup_pass + order
    runs: dict[tuple[int, str], list[dict]] = {cfg: [] for cfg in plan}
    for rep, (n, mode) in tqdm(order, desc="system", unit="run"):
        policy, clock = MODES[mode], DraftClock()
        make = (lambda p: create_drafter("none")) if policy is None else (
            lambda p: ReplayDrafter(tables[p], spt, fulls[p] if fulls else None,
                                    confidences[p] if confidences else None, clock, prefill_s[p]))
        w = asyncio.run(run_window(address, tokenizer, make, ids, n, args.max_tokens, policy or DraftPolicy(0),
                                   args.warmup_s, args.seconds, link=link))
        row = summarize(mode, n, w)
        row.update(repeat=rep, drafting_ms_per_token=clock.ms_per_token())
        if rep >= 0:
            runs[(n, mode)].append(row)
    return runs


def plot(rows: list[dict], out_dir: Path, name: str) -> list[Path]:
    """System tokens/s and p95 inter-token latency against the device count, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in (("system_tokens_per_s", "system tokens/s"), ("p95_inter_token_ms", "p95 inter-token ms")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("sled", "server-only", "device-only"):
            pts = sorted((r["devices"], r[key]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set(xlabel="devices", ylabel=label, xscale="log", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(out_dir / f"{name}_{key}.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def build() -> str:
    """The checkout's commit, for a section to name the build it measured ('' outside a git checkout)."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def heading(args) -> str:
    return ("## System benchmark" + (" on a GPU" if gpu_name() else "") + (f", {args.label}" if args.label else "")
            + ": SLED vs server-only vs device-only")


def build_parser() -> argparse.ArgumentParser:
    from .cli import positive
    from .options import system_parser

    p = system_parser(__doc__)
    p.add_argument("--slo-ms", type=positive(), default=150.0, help="p95 inter-token latency target (default 150)")
    return p


def main(args) -> int:
    from .options import check_system_args
    from sim.processes import ServerProcess
    from .tokenizers import device_tokenizer

    check_system_args(args)
    tokenizer = device_tokenizer(args.tokenizer)
    ids = prompts(tokenizer, args.recordings)
    drafting = measure_drafting(args, ids)
    print(f"[bench] devices draft at {drafting.ms_per_token:.2f} ms/token ({drafting.source}), prefill "
          f"{drafting.prefill_ms_per_token:.2f} ms per prompt token", flush=True)
    server = ServerProcess(*args.server_flags(max(args.devices)))
    address = server.start()
    link = None
    try:
        drafts = replayed(address, tokenizer, ids, args)
        if args.match_only:
            return write_match(args, drafting, len(ids))
        if args.link_spec:
            from sim.linkemu import LinkProcess

            link = LinkProcess(args.link_spec, *address.rsplit(":", 1))
            link.start()
        runs = run_all(address, tokenizer, ids, drafts, drafting, args, link)
        info = asyncio.run(fetch_info(address))
    finally:
        if link:
            link.stop()
        server.stop()
    by = pick_medians(runs)
    rate = device_only_rate(drafting.ms_per_token / 1000, [n * drafting.prefill_ms_per_token / 1000
                                                           for n in prefill_tokens(ids)], args.max_tokens)
    by.update({("device-only", n): device_only_row(n, rate, drafting.ms_per_token / 1000) for n in args.devices})
    name = "system" + ("_gpu" if gpu_name() else "") + (f"_{args.label.replace(' ', '_')}" if args.label else "")
    paths = plot(list(by.values()), Path(args.plots), name)
    section = (f"{heading(args)}\n\n" + describe_run(args, drafting, info, "system", len(ids), paths)
               + "\n" + tables(args.devices, by, args.slo_ms))
    publish(args.markdown, heading(args), section, args.json, list(by.values()))
    print(section)
    return 0


def describe_run(args, drafting: Drafting, info, command: str, prompts_n: int, plots: list[Path]) -> str:
    """The lines every replayed-load section opens with: when, where, what ran, and how."""
    gpu = gpu_name()
    target = args.target or "SmolLM2-135M-Instruct"
    drafts = (f"synthesized from the target's greedy output, each position right with probability "
              f"{args.draft_match:.3f}" + (f" ({args.match_source})" if args.match_source else "")
              if args.draft_match is not None else
              "the llama.cpp Q4_1 drafter's greedy proposals, recorded along the target's greedy output and replayed"
              + (f" (per-position match {args.draft_match_measured[0]:.3f})"
                 if getattr(args, "draft_match_measured", None) else ""))
    rel = [os.path.relpath(p, Path(args.markdown).parent) for p in plots]
    return (f"`sled-bench {command} {shlex.join(sys.argv[2:])}` on {machine()}"
            + (f", GPU {gpu}" if gpu else "") + f", {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"
            + (f", at {build()}" if build() else "") + ".\n\n"
            f"- target: {target}; server kernels: {describe_kernels(info)}\n"
            + (f"- emulated GPU step profile: every forward padded to {args.min_step_ms:g} ms + "
               f"{args.min_step_ms_per_token:g} ms a token\n" if args.min_step_ms or args.min_step_ms_per_token else "")
            + f"- drafts: {drafts}; devices draft at {drafting.ms_per_token:.2f} ms/token ({drafting.source}) and "
            f"spend {drafting.prefill_ms_per_token:.2f} ms a prompt token on prefill before a request's first token\n"
            f"- load: each device sends requests of {args.max_tokens} greedy tokens back to back through {prompts_n} "
            f"chat prompts; tokens/s count what is committed in a {args.seconds:g} s window while every device is "
            f"busy; {args.repeats} passes, the median reported\n"
            + (f"- link: each device behind its own emulated link, {args.link_spec.describe()}\n" if args.link_spec
               else "")
            + ("- plots: " + ", ".join(f"[{Path(p).stem}]({r})" for p, r in zip(plots, rel)) + "\n" if plots else ""))


def write_match(args, drafting: Drafting, recordings: int) -> int:
    """--match-only: the real pair's measured match and drafting speed, for a GPU run's --draft-match."""
    match, by_position = args.draft_match_measured
    print(f"[bench] the real drafter's per-position match: {match:.3f} (by position: "
          f"{', '.join(f'{x:.2f}' for x in by_position)})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "draft_match": match, "by_position": by_position, "drafting_ms_per_token": drafting.ms_per_token,
            "prefill_ms_per_token": drafting.prefill_ms_per_token, "recordings": recordings,
            "max_tokens": args.max_tokens, "machine": machine(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}, indent=2))
    return 0
