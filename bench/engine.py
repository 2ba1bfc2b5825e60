"""Engine speed: the target's decode step at batch 1 against the memory-bandwidth limit.

    sled-bench engine --context 128 --steps 60

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
(`sled-bench system` reports the non-model share of a step at 16 sessions).
Writes its section of docs/benchmarks.md and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .cli import positive
from .report import copy_bandwidth, machine, publish

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## Engine speed: decode step at batch 1"
KERNELS = ("fused", "onednn", "reference")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=positive(int), default=128, help="cached tokens before the step (default 128)")
    p.add_argument("--steps", type=positive(int), default=60, help="timed steps per kernel per round (default 60)")
    p.add_argument("--rounds", type=positive(int), default=5, help="rounds, kernels interleaved (default 5)")
    p.add_argument("--kernels", type=_kernels, default=list(KERNELS),
                   help="kernels to compare: fused, onednn, reference (default all three)")
    p.add_argument("--sweep", type=_sweep, default=_sweep("1,2,4,8,9,12,16,32,64,128,256"),
                   help="token counts of one session's forward, fused against PyTorch "
                        "(default 1,2,4,8,9,12,16,32,64,128,256; empty: skip)")
    p.add_argument("--threads", type=positive(int), help="torch threads (default: torch's choice)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def _kernels(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in KERNELS for k in kinds):
        raise argparse.ArgumentTypeError(f"takes fused, onednn and reference, got {text!r}")
    return kinds


def _sweep(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes token counts like 1,4,9, got {text!r}") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError("token counts must be positive")
    return counts


class Bench:
    """The target, one session's KV blocks, and a runner per kernel, with the prefill and the step they time."""

    def __init__(self, args):
        import torch

        from kernels.attention import Segment
        from verify_server.kv_cache import KVCache, KVLayout
        from verify_server.model_loader import load_target
        from verify_server.model_runner import ModelInput

        print("[bench] loading the target (SmolLM2-135M-Instruct, float32, CPU) ...", flush=True)
        self.target = load_target(None, torch.device("cpu"), torch.float32)
        self.cfg = cfg = self.target.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        seq = args.context + max(args.sweep + [1]) + 8
        self.kv = KVCache.create(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim), seq, 16, seq)
        self.runners = {k: self.make(k) for k in args.kernels}
        self.wbytes = sum(p.numel() * p.element_size() for p in self.target.model.parameters())
        self.table = table = tuple(self.kv.blocks.allocate(self.kv.num_blocks))
        ids = torch.randint(3, cfg.vocab_size, (args.context + 1,), generator=torch.Generator().manual_seed(0))
        self.prefill = ModelInput.build(ids[:-1].tolist(), [Segment(table, 0, args.context, args.context, 16)],
                                        [args.context - 1])
        self.step = ModelInput.build(ids[-1:].tolist(), [Segment(table, 0, 1, args.context + 1, 16)], [0])

    def make(self, kind: str):
        from verify_server.model_runner import ModelRunner

        if kind == "fused":
            return ModelRunner(self.target.model, self.kv, "sdpa", "onednn", fused="on", fused_max_tokens=1 << 20)
        return ModelRunner(self.target.model, self.kv, "sdpa", kind, fused="off")

    def projections_alone(self, runner):
        """The step's projections back to back on zero inputs of the same shapes: what streaming the weights costs
        through a kernel; the step's remainder is everything else (norms, RoPE, attention, KV writes)."""
        import torch

        x = torch.zeros(1, self.cfg.hidden_size)
        o_in = torch.zeros(1, runner.num_heads * runner.head_dim)
        down_in = torch.zeros(1, self.cfg.intermediate_size)

        def run():
            for qkv, o, gate_up, down in runner.proj:
                qkv(x), o(o_in), gate_up(x), down(down_in)
            runner.project_logits(x)
        return run


def time_steps(bench: Bench, args) -> tuple[list[dict], list[str], list[float]]:
    """Each kernel's step, interleaved round by round, against the weights-over-bandwidth limit measured between
    the rounds. Returns the rows, the table's lines and the bandwidths."""
    import torch
    from tqdm import tqdm

    logits = {}
    for kind, runner in bench.runners.items():
        runner.forward(bench.prefill)
        logits[kind] = runner.forward(bench.step)
    for kind in args.kernels[1:]:
        diff = (logits[kind] - logits[args.kernels[0]]).abs().max().item()
        print(f"[bench] {kind} vs {args.kernels[0]}: max logit difference {diff:.2e}", flush=True)
    alone = {k: bench.projections_alone(r) for k, r in bench.runners.items() if k != "fused"}
    times, proj_times, ratios = ({k: [] for k in args.kernels} for _ in range(3))
    bandwidths = [copy_bandwidth()]
    for _ in tqdm(range(args.rounds), desc="engine", unit="round"):
        round_times = {}
        for kind, runner in bench.runners.items():
            for _ in range(3):
                runner.forward(bench.step)
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                runner.forward(bench.step)
                ts.append(time.perf_counter() - t0)
            times[kind] += ts
            round_times[kind] = statistics.median(ts)
            for _ in range(args.steps if kind in alone else 0):
                t0 = time.perf_counter()
                alone[kind]()
                proj_times[kind].append(time.perf_counter() - t0)
        bandwidths.append(copy_bandwidth())
        # Side by side: this round's steps against the better of the bandwidths measured just before and after.
        for kind in args.kernels:
            ratios[kind].append(round_times[kind] / (bench.wbytes / max(bandwidths[-2:])))
    bw_best, limit_ms = max(bandwidths), bench.wbytes / statistics.median(bandwidths) * 1000
    rows = []
    lines = ["| kernel | step p50 ms | step p10 ms | p50 / limit, per round (median) | "
             "p50 / limit at the best bandwidth | projections alone p50 ms | their weight stream | rest of the step ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in args.kernels:
        ts = sorted(times[kind])
        p50, p10 = statistics.median(ts) * 1000, ts[len(ts) // 10] * 1000
        ratio, strict = statistics.median(ratios[kind]), p50 / (bench.wbytes / bw_best * 1000)
        proj = statistics.median(proj_times[kind]) * 1000 if proj_times[kind] else None
        rows.append({"kernel": kind, "step_p50_ms": p50, "step_p10_ms": p10, "limit_ms": limit_ms,
                     "ratio": ratio, "ratio_best_bandwidth": strict, "weight_bytes": bench.wbytes,
                     "copy_bandwidths_bytes_per_s": bandwidths, "context": args.context,
                     "threads": torch.get_num_threads(), "projections_alone_p50_ms": proj})
        split = (f"{proj:.1f} | {bench.wbytes / proj / 1e6:.1f} GB/s | {p50 - proj:.1f}" if proj is not None
                 else "— | — | —")
        lines.append(f"| {kind} | {p50:.1f} | {p10:.1f} | {ratio:.2f}x | {strict:.2f}x | {split} |")
        print(f"[bench] {kind}: step p50 {p50:.1f} ms, {ratio:.2f}x the limit", flush=True)
    return rows, lines, bandwidths


def sweep(bench: Bench, args) -> tuple[list[dict], list[str]]:
    """One session's forward of each --sweep count through the fused step and through PyTorch, interleaved."""
    import torch
    from tqdm import tqdm

    from kernels.attention import Segment
    from verify_server.model_runner import ModelInput

    fused, pytorch = bench.make("fused"), bench.runners.get("onednn") or bench.make("onednn")
    times: dict[tuple[str, int], list[float]] = {}
    ids = torch.randint(3, bench.cfg.vocab_size, (max(args.sweep),), generator=torch.Generator().manual_seed(1))
    for _ in tqdm(range(args.rounds), desc="sweep", unit="round"):
        for n in args.sweep:
            inp = ModelInput.build(ids[:n].tolist(), [Segment(bench.table, 0, n, args.context + n, 16)],
                                   list(range(n)))
            for name, runner in (("fused", fused), ("pytorch", pytorch)):
                runner.forward(inp)
                for _ in range(max(args.steps // 4, 3)):
                    t0 = time.perf_counter()
                    runner.forward(inp)
                    times.setdefault((name, n), []).append(time.perf_counter() - t0)
    rows, lines = [], ["| tokens | fused p50 ms | PyTorch (onednn) p50 ms | fused / PyTorch |", "|---:|---:|---:|---:|"]
    for n in args.sweep:
        f, p = (statistics.median(times[(k, n)]) * 1000 for k in ("fused", "pytorch"))
        lines.append(f"| {n} | {f:.1f} | {p:.1f} | {f / p:.2f}x |")
        rows.append({"sweep_tokens": n, "fused_p50_ms": f, "pytorch_p50_ms": p, "context": args.context})
    return rows, lines


def main(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args)
    rows, lines, bandwidths = time_steps(bench, args)
    sweep_rows, sweep_lines = sweep(bench, args) if args.sweep else ([], [])
    wbytes, bw_best, bw_median = bench.wbytes, max(bandwidths), statistics.median(bandwidths)
    section = (
        f"{MARKER}\n\n`sled-bench engine {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{torch.get_num_threads()} torch threads, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- step: `ModelRunner.forward`, one new token of one session over {args.context} cached tokens, "
        f"{args.rounds} rounds × {args.steps} steps a kernel, kernels interleaved\n"
        f"- limit: {wbytes / 2**20:.0f} MiB of float32 weights / copy bandwidth (STREAM-style, 1 GiB buffers), "
        "measured before the first round and after each: " + ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
        + f" GB/s; {wbytes / bw_median * 1000:.1f} ms at the median, {wbytes / bw_best * 1000:.1f} ms at the best; "
        "each round is compared with the better bandwidth measured just before and after it\n"
        "- projections alone: the step's projections on zero inputs (weights read once each); the rest is norms, "
        "RoPE, attention and KV writes; not separable in the fused step\n\n"
        + "\n".join(lines) + "\n"
        + ("\nOne session's forward of several tokens through the fused step and through PyTorch, interleaved: what "
           "`fused_max_tokens` is chosen from.\n\n" + "\n".join(sweep_lines) + "\n" if sweep_lines else ""))
    publish(args.markdown, MARKER, section, args.json, rows + sweep_rows)
    return 0
