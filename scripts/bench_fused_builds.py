"""Builds of the fused CPU step side by side: this CPU's own build against builds with other defines.

    python scripts/bench_fused_builds.py --defines SLED_PREFETCH_MIN_ROWS=8 --json runs/bench_fused_builds.json

One session's forward of each token count (a draft's K + 1, or several sessions' decode tokens) over --context cached
tokens, through each build, interleaved in one process (the order reversed every other round), so that a slow
stretch of a shared host falls on all of them. Each build packs the weights for its own panel width. Reports each
build's median step and its ratio to the CPU's own build (kernels/cpu_step.py: load_library() with no defines,
host_defines() included), and whether its logits equal the own build's bit for bit. Writes its section of
docs/benchmarks.md. This is how a define's default for a CPU (cpu_step.c's SLED_PREFETCH_MIN_ROWS, MR, ...) is chosen.
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

from bench.report import machine, publish  # noqa: E402

MARKER = "## Fused CPU step: builds side by side"


def parse_build(text: str) -> tuple[str, ...]:
    """'NAME=VALUE,NAME=VALUE' -> the defines of one build."""
    defines = tuple(d.strip() for d in text.split(",") if d.strip())
    if not defines or any("=" not in d or not d.split("=", 1)[0].isidentifier() for d in defines):
        raise ValueError(f"a build is NAME=VALUE[,NAME=VALUE...], got {text!r}")
    return defines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defines", action="append", metavar="NAME=VALUE[,...]",
                    help="a build to compare with this CPU's own (repeatable; default SLED_PREFETCH_MIN_ROWS=8, "
                         "AVX-512's threshold without host_defines). Each is the kernel's defaults plus these "
                         "defines, without this CPU's host defines (the own build's line names them): to change "
                         "one setting only, name those too, e.g. SLED_PREFETCH_SPREAD=0,SLED_PREFETCH_MIN_ROWS=1 "
                         "on an Intel AVX-512 host")
    ap.add_argument("--tokens", default="1,2,3,4,5,6,7,8,12,16", help="token counts (default 1-8, 12, 16)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over every count and build (default 5)")
    ap.add_argument("--steps", type=int, default=8, help="timed forwards per count, build and round (default 8)")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed ones (default 128)")
    ap.add_argument("--target", metavar="SPEC",
                    help="the target (default SmolLM2-135M-Instruct); random:llama-tiny for a quick check")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    try:
        builds = [parse_build(b) for b in (args.defines or ["SLED_PREFETCH_MIN_ROWS=8"])]
        tokens = [int(x) for x in args.tokens.split(",")]
    except ValueError as err:
        ap.error(str(err))
    if not tokens or any(n < 1 for n in tokens):
        ap.error("--tokens takes positive token counts like 1,4,9")
    if args.rounds < 1 or args.steps < 1 or args.context < 1:
        ap.error("--rounds, --steps and --context must be positive")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be positive")

    import torch
    from tqdm import tqdm

    import kernels.cpu_step as cpu_step
    from kernels.attention import Segment
    from verify_server.kv_cache import KVCache
    from verify_server.model_loader import load_target
    from verify_server.model_runner import ModelInput, ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"[bench] loading the target ({args.target or 'SmolLM2-135M-Instruct'}, float32, CPU) ...", flush=True)
    target = load_target(args.target, torch.device("cpu"), torch.float32)
    cfg = target.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, args.context + max(tokens) + 8, head_dim,
                 torch.float32, torch.device("cpu"))
    own = cpu_step.host_defines()
    names = ["own"] + [",".join(b) for b in builds]
    runners = {}
    for name, build in zip(names, [None] + builds):
        library = cpu_step.load_library(build) if build else cpu_step.load_library()
        saved = cpu_step.load_library
        cpu_step.load_library = lambda library=library: library  # the runner's CpuStep packs for this build
        try:
            runner = ModelRunner(target.model, kv, "sdpa", "onednn", fused="on", fused_max_tokens=1 << 20)
        finally:
            cpu_step.load_library = saved
        if runner.fused is None:
            ap.error("the fused CPU step does not run here (no C compiler, or the target is not float32 on CPU)")
        runners[name] = runner

    slot = kv.allocate()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (args.context + max(tokens),), generator=gen)
    prefill = ModelInput(ids[:args.context], torch.arange(args.context), torch.full((args.context,), slot),
                         [Segment(slot, 0, args.context, args.context)], torch.tensor([args.context - 1]))
    runners["own"].forward(prefill)
    times: dict[tuple[str, int], list[float]] = {}
    same: dict[tuple[str, int], bool] = {}
    for r in tqdm(range(args.rounds), desc="builds", unit="round"):
        for n in tokens:
            inp = ModelInput(ids[args.context:args.context + n], torch.arange(args.context, args.context + n),
                             torch.full((n,), slot), [Segment(slot, 0, n, args.context + n)], torch.arange(n))
            order = names if r % 2 == 0 else names[::-1]
            logits = {}
            for name in order:
                logits[name] = runners[name].forward(inp)  # also writes the same keys and values as every build
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    runners[name].forward(inp)
                    times.setdefault((name, n), []).append(time.perf_counter() - t0)
            for name in names[1:]:
                same[(name, n)] = same.get((name, n), True) and torch.equal(logits[name], logits["own"])

    rows, lines = [], []
    header = "| tokens | own build p50 ms | " + " | ".join(f"`{b}` p50 ms | `{b}` / own | same logits"
                                                         for b in names[1:]) + " |"
    lines += [header, "|---:|---:|" + "---:|---:|---|" * (len(names) - 1)]
    for n in tokens:
        base = statistics.median(times[("own", n)]) * 1000
        cells = [f"{n}", f"{base:.1f}"]
        rows.append({"tokens": n, "build": "own", "defines": list(own), "p50_ms": base})
        for name in names[1:]:
            p50 = statistics.median(times[(name, n)]) * 1000
            cells += [f"{p50:.1f}", f"{p50 / base:.2f}x", "yes" if same[(name, n)] else "no"]
            rows.append({"tokens": n, "build": name, "defines": name.split(","), "p50_ms": p50,
                         "ratio_to_own": p50 / base, "same_logits": same[(name, n)]})
        lines.append("| " + " | ".join(cells) + " |")
        print(f"[bench] {n} tokens: own {base:.1f} ms; " + "; ".join(
            f"{name} {statistics.median(times[(name, n)]) * 1000 / base:.2f}x" for name in names[1:]), flush=True)
    section = (
        f"{MARKER}\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU), {torch.get_num_threads()} torch threads\n"
        f"- command: `python scripts/bench_fused_builds.py {' '.join(sys.argv[1:])}`\n"
        f"- target: {args.target or 'SmolLM2-135M-Instruct'}, float32; one session's forward of each token count "
        f"over {args.context} cached tokens, {args.rounds} rounds × {args.steps} forwards per count and build, the "
        f"builds interleaved (the order reversed every other round)\n"
        f"- own build: this CPU's (`load_library()`), host defines: "
        f"{', '.join(f'`{d}`' for d in own) if own else 'none'}; same logits: bit for bit against it, every round\n\n"
        + "\n".join(lines) + "\n")
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
