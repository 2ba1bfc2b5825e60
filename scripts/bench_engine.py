"""Engine speed: the target's decode step at batch 1 against the memory-bandwidth limit.

    python scripts/bench_engine.py --context 128 --steps 60

At batch 1 a decode step streams every weight once, so its floor is
weight bytes / copy bandwidth, both measured here: the weights are the model's parameters
(tied embeddings counted once, as the logits projection reads them), the bandwidth is the
best STREAM-style copy (bytes read + written per second) of 1 GiB buffers, measured between
the timing rounds so that both see the same machine load. Each kernel runs the same steps,
interleaved round by round: `fused` (the whole forward in one C call, kernels/cpu_step.c),
`onednn` and `reference` (PyTorch's forward with that projection kernel).

Then, for the fused step's threshold (`fused_max_tokens`), one session's forward of
`--sweep` token counts through the fused step and through PyTorch (onednn), side by side.

The step is `ModelRunner.forward` for one new token of one session over `--context` cached
tokens: what the engine runs for a one-session verification, without gRPC or sampling
(bench_system.py reports the non-model share of a step at 16 sessions).
Writes its section of docs/benchmarks.md and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import copy_bandwidth, machine, publish  # noqa: E402

MARKER = "## Engine speed: decode step at batch 1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the measured step (default 128)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per kernel per round (default 60)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, kernels interleaved (default 5)")
    ap.add_argument("--kernels", default="fused,onednn,reference",
                    help="kernels to compare: fused, onednn, reference (default all three)")
    ap.add_argument("--sweep", default="1,2,4,8,9,12,16,32,64,128,256",
                    help="token counts of one session's forward, fused against PyTorch "
                         "(default 1,2,4,8,9,12,16,32,64,128,256; empty: skip)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    if args.context < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--context, --steps and --rounds must be positive")
    kinds = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kinds or any(k not in ("fused", "onednn", "reference") for k in kinds):
        ap.error(f"--kernels takes fused, onednn and reference, got {args.kernels!r}")
    try:
        sweep = [int(n) for n in args.sweep.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--sweep takes token counts like 1,4,9, got {args.sweep!r}")
    if any(n < 1 for n in sweep):
        ap.error("--sweep token counts must be positive")

    import torch
    from tqdm import tqdm

    from kernels.attention import Segment
    from verify_server.kv_cache import KVCache
    from verify_server.model_loader import load_target
    from verify_server.model_runner import ModelInput, ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    print("[bench] loading the target (SmolLM2-135M-Instruct, float32, CPU) ...", flush=True)
    target = load_target(None, torch.device("cpu"), torch.float32)
    cfg = target.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, args.context + max(sweep + [1]) + 8, head_dim,
                 torch.float32, torch.device("cpu"))

    def make(kind):
        if kind == "fused":
            return ModelRunner(target.model, kv, "sdpa", "onednn", fused="on", fused_max_tokens=1 << 20)
        return ModelRunner(target.model, kv, "sdpa", kind, fused="off")
    runners = {k: make(k) for k in kinds}
    wbytes = sum(p.numel() * p.element_size() for p in target.model.parameters())

    slot = kv.allocate()
    ids = torch.randint(3, cfg.vocab_size, (args.context + 1,), generator=torch.Generator().manual_seed(0))
    prefill = ModelInput(ids[:-1], torch.arange(args.context), torch.full((args.context,), slot),
                         [Segment(slot, 0, args.context, args.context)], torch.tensor([args.context - 1]))
    step = ModelInput(ids[-1:], torch.tensor([args.context]), torch.tensor([slot]),
                      [Segment(slot, 0, 1, args.context + 1)], torch.tensor([0]))
    logits = {}
    for kind, runner in runners.items():
        runner.forward(prefill)
        logits[kind] = runner.forward(step)
    for kind in kinds[1:]:
        diff = (logits[kind] - logits[kinds[0]]).abs().max().item()
        print(f"[bench] {kind} vs {kinds[0]}: max logit difference {diff:.2e}", flush=True)

    # The step's projections alone, back to back on zero inputs of the same shapes: what streaming the weights
    # costs through each kernel; the step's remainder is everything else (norms, RoPE, attention, KV writes).
    def projections_alone(runner):
        x = torch.zeros(1, cfg.hidden_size)
        o_in = torch.zeros(1, runner.num_heads * runner.head_dim)
        down_in = torch.zeros(1, cfg.intermediate_size)

        def run():
            for qkv, o, gate_up, down in runner.proj:
                qkv(x), o(o_in), gate_up(x), down(down_in)
            runner.project_logits(x)
        return run

    alone = {k: projections_alone(r) for k, r in runners.items() if k != "fused"}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    proj_times: dict[str, list[float]] = {k: [] for k in kinds}
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    bandwidths = [copy_bandwidth()]
    for _ in tqdm(range(args.rounds), desc="engine", unit="round"):
        round_times = {}
        for kind, runner in runners.items():
            for _ in range(3):
                runner.forward(step)
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                runner.forward(step)
                ts.append(time.perf_counter() - t0)
            times[kind] += ts
            round_times[kind] = statistics.median(ts)
            for _ in range(args.steps if kind in alone else 0):
                t0 = time.perf_counter()
                alone[kind]()
                proj_times[kind].append(time.perf_counter() - t0)
        bandwidths.append(copy_bandwidth())
        # Side by side: this round's steps against the better of the bandwidths measured just before and after.
        round_limit = wbytes / max(bandwidths[-2:])
        for kind in kinds:
            ratios[kind].append(round_times[kind] / round_limit)
    bw_best, bw_median = max(bandwidths), statistics.median(bandwidths)
    limit_ms = wbytes / bw_median * 1000

    rows = []
    lines = ["| kernel | step p50 ms | step p10 ms | p50 / limit, per round (median) | "
             "p50 / limit at the best bandwidth | projections alone p50 ms | their weight stream | rest of the step ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in kinds:
        ts = sorted(times[kind])
        p50, p10 = statistics.median(ts) * 1000, ts[len(ts) // 10] * 1000
        ratio, strict = statistics.median(ratios[kind]), p50 / (wbytes / bw_best * 1000)
        proj = statistics.median(proj_times[kind]) * 1000 if proj_times[kind] else None
        rows.append({"kernel": kind, "step_p50_ms": p50, "step_p10_ms": p10, "limit_ms": limit_ms,
                     "ratio": ratio, "ratio_best_bandwidth": strict, "weight_bytes": wbytes,
                     "copy_bandwidths_bytes_per_s": bandwidths, "context": args.context,
                     "threads": torch.get_num_threads(), "projections_alone_p50_ms": proj})
        split = (f"{proj:.1f} | {wbytes / proj / 1e6:.1f} GB/s | {p50 - proj:.1f}" if proj is not None
                 else "— | — | —")
        lines.append(f"| {kind} | {p50:.1f} | {p10:.1f} | {ratio:.2f}x | {strict:.2f}x | {split} |")
        print(f"[bench] {kind}: step p50 {p50:.1f} ms, p10 {p10:.1f} ms, {ratio:.2f}x the limit "
              f"({strict:.2f}x at the best bandwidth)"
              + (f"; projections alone {proj:.1f} ms" if proj is not None else ""), flush=True)

    sweep_lines = []
    if sweep:
        fused = make("fused")
        pytorch = runners.get("onednn") or make("onednn")
        sweep_times: dict[tuple[str, int], list[float]] = {}
        # as many tokens as the largest count (ids holds only the context and its one decode token)
        sweep_ids = torch.randint(3, cfg.vocab_size, (max(sweep),), generator=torch.Generator().manual_seed(1))
        for _ in tqdm(range(args.rounds), desc="sweep", unit="round"):
            for n in sweep:
                inp = ModelInput(sweep_ids[:n], torch.arange(args.context, args.context + n),
                                 torch.full((n,), slot), [Segment(slot, 0, n, args.context + n)], torch.arange(n))
                for name, runner in (("fused", fused), ("pytorch", pytorch)):
                    runner.forward(inp)
                    for _ in range(max(args.steps // 4, 3)):
                        t0 = time.perf_counter()
                        runner.forward(inp)
                        sweep_times.setdefault((name, n), []).append(time.perf_counter() - t0)
        sweep_lines = ["| tokens | fused p50 ms | PyTorch (onednn) p50 ms | fused / PyTorch |", "|---:|---:|---:|---:|"]
        for n in sweep:
            f, p = (statistics.median(sweep_times[(k, n)]) * 1000 for k in ("fused", "pytorch"))
            sweep_lines.append(f"| {n} | {f:.1f} | {p:.1f} | {f / p:.2f}x |")
            rows.append({"sweep_tokens": n, "fused_p50_ms": f, "pytorch_p50_ms": p, "context": args.context})
            print(f"[bench] {n} tokens: fused {f:.1f} ms, PyTorch {p:.1f} ms ({f / p:.2f}x)", flush=True)
    section = (
        f"{MARKER}\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU), {torch.get_num_threads()} torch threads\n"
        f"- command: `python scripts/bench_engine.py {' '.join(sys.argv[1:])}`\n"
        f"- step: `ModelRunner.forward`, one new token of one session over {args.context} cached tokens, "
        f"{args.rounds} rounds × {args.steps} steps per kernel, kernels interleaved\n"
        f"- limit: {wbytes / 2**20:.0f} MiB of float32 weights / copy bandwidth (STREAM-style, bytes read + written, "
        f"1 GiB buffers), measured before the first round and after each: "
        + ", ".join(f"{b / 1e9:.1f}" for b in bandwidths) + " GB/s; at the median "
        + f"{bw_median / 1e9:.1f} GB/s the limit is {limit_ms:.1f} ms, at the best {bw_best / 1e9:.1f} GB/s "
        + f"{wbytes / bw_best * 1000:.1f} ms. Each round's steps are compared with the better bandwidth measured "
        "just before and after them.\n"
        "- projections alone: the step's projections back to back on zero inputs of the same shapes (weights read "
        "once each, as in the step); the rest of the step is everything else (norms, RoPE, attention, KV writes, "
        "one op dispatch each); not separable in the fused step, which runs every layer in one call\n\n"
        + "\n".join(lines) + "\n"
        + ("\nOne session's forward of several tokens (a draft's K + 1, or several sessions' decode tokens), through "
           f"the fused step and through PyTorch, interleaved, {args.rounds} rounds: what `fused_max_tokens` "
           "is chosen from.\n\n" + "\n".join(sweep_lines) + "\n" if sweep_lines else "")
    )
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
