"""System benchmark: SLED vs server-only vs device-only across device counts, capacity under an SLO.

    python scripts/bench_system.py --devices 1,4,16,32 --slo-ms 150 --json runs/bench_system.json

1. Record: for each prompt, the target's greedy output (through SLED) and, at every prefix of it,
   the real drafter's greedy proposal of up to 8 tokens (llama.cpp Q4_1); and one drafter's time per
   token when it runs alone on this machine (a device has its own hardware).
2. Replay: devices propose exactly what the real drafter proposes at their context (contexts are
   prefixes of the fixed greedy output), sleeping for the drafting time instead of computing, so the
   server's capacity is measured apart from drafting: on one 2-core machine, drafters and server
   would otherwise share the cores. Any K, fixed or adaptive, replays the same drafter.
   Modes: `sled` (replayed drafts), `server-only` (the same server decodes every token, batched),
   `device-only` (the drafter alone, unverified: each device is its own hardware, so N devices give
   N times one device's measured rate).
3. `sled` rows use the adaptive draft length (the default); fixed K = 2, 4, 8 run beside it.
4. Non-model time per step at 16 sessions (the batch-1 step against the bandwidth limit: bench_engine.py).

Inter-token latency: a round that commits n tokens in t seconds gives each of them t / n.
Writes JSON rows, PNG plots (--out-dir) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_client.drafters import DrafterOptions, create_drafter  # noqa: E402
from edge_client.drafters.base import Proposal  # noqa: E402
from edge_client.generation import generate  # noqa: E402
from edge_client.sampling import SamplingParams  # noqa: E402
from edge_client.tokenizer import Tokenizer  # noqa: E402
from edge_client.transport import VerifierClient  # noqa: E402
from edge_client.workload import QUESTIONS  # noqa: E402
from scripts.benchutil import ServerProcess, machine, publish  # noqa: E402


class ReplayDrafter:
    """Proposes what a real drafter proposed at the same context length, after its measured drafting time."""

    name = "replay"

    def __init__(self, rounds: dict[int, list[int]], seconds_per_token: float):
        self.rounds, self.spt = rounds, seconds_per_token

    def begin(self, context, sampling):
        pass

    def propose(self, context, k):
        tokens = self.rounds.get(len(context), [])[:k]
        time.sleep(self.spt * len(tokens))
        return Proposal(list(tokens))

    def accept(self, context):
        pass

    def close(self):
        pass


K_MAX = 8


def record_tables(address, tokenizer, prompt_ids, max_tokens) -> list[dict[int, list[int]]]:
    """Per prompt: context length -> the real drafter's greedy proposal of K_MAX tokens there."""
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=512))
    runs, _, _, _ = asyncio.run(run_devices(address, tokenizer, [create_drafter("none") for _ in prompt_ids],
                                            prompt_ids, max_tokens, 0, adaptive=False))
    tables = []
    for ids, run in zip(prompt_ids, runs):
        full = list(ids) + run.token_ids
        drafter.begin(list(ids), SamplingParams())
        tables.append({n: drafter.propose(full[:n], K_MAX).token_ids for n in range(len(ids), len(full))})
    drafter.close()
    return tables


def prompts(tokenizer, n):
    return [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(n)]


async def run_devices(address, tokenizer, drafters, prompt_ids, max_tokens, k, adaptive=False):
    client = VerifierClient(address)
    before = (await client.info()).stats
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*[
            generate(client, d, tokenizer, p, max_tokens=max_tokens, draft_tokens=k, adaptive=adaptive)
            for d, p in zip(drafters, prompt_ids)])
    finally:
        wall = time.perf_counter() - t0
        after = (await client.info()).stats
        await client.close()
    return results, wall, before, after


def summarize(mode, n, results, wall, before, after):
    itl = np.concatenate([np.repeat(np.array(r.round_times) / np.maximum(r.round_tokens, 1), r.round_tokens)
                          for r in results])
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.draft_tokens for r in results)
    steps = after.steps - before.steps
    return {
        "mode": mode, "devices": n, "system_tokens_per_s": tokens / wall,
        "per_device_tokens_per_s": float(np.mean([r.tokens_per_second for r in results])),
        "p50_inter_token_ms": float(np.percentile(itl, 50) * 1000), "p95_inter_token_ms": float(np.percentile(itl, 95) * 1000),
        "acceptance_rate": sum(r.accepted_tokens for r in results) / drafted if drafted else 0.0,
        "mean_draft_tokens": drafted / max(sum(r.rounds for r in results), 1),
        "server_step_ms": (after.step_seconds_total - before.step_seconds_total) / steps * 1000 if steps else 0.0,
        "server_forward_ms": (after.forward_seconds_total - before.forward_seconds_total) / steps * 1000 if steps else 0.0,
        "server_batch_sessions": (after.verifications - before.verifications) / steps if steps else 0.0,
    }


def plot(rows, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in (("system_tokens_per_s", "system tokens/s"), ("p95_inter_token_ms", "p95 inter-token latency (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("sled", "server-only", "device-only"):
            pts = sorted((r["devices"], r[key]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"bench_system_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> int:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,4,16,32", help="device counts (default 1,4,16,32)")
    ap.add_argument("--slo-ms", type=float, default=150.0, help="p95 inter-token latency bound for capacity (default 150)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per device (default 64)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="passed with adaptive drafting on (default 4)")
    ap.add_argument("--recordings", type=int, default=8, help="distinct recorded prompts, reused round-robin (default 8)")
    ap.add_argument("--max-wait-ms", type=float, default=3.0, help="the server's batching window (default 3)")
    ap.add_argument("--device-ms-per-token", type=float,
                    help="drafting time per token on a device (default: measured here for llama.cpp Q4_1, 1 thread)")
    ap.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "bench_system"), help="where PNG plots go")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    counts = [int(x) for x in args.devices.split(",")]
    top = max(counts)

    rows, adaptive_rows = [], []
    server = ServerProcess("--max-sessions", str(top + 2), "--max-seq-len", "512", "--max-batch-sessions", str(top),
                           "--max-batch-tokens", str(max(512, top * 10)), "--max-wait-ms", str(args.max_wait_ms))
    address = server.start()
    try:
        tokenizer = Tokenizer()
        ids = prompts(tokenizer, args.recordings)
        print(f"[bench] recording the llama.cpp drafter's proposals along {args.recordings} greedy outputs ...",
              flush=True)
        tables = record_tables(address, tokenizer, ids, args.max_tokens)
        # Device-only, and the device's drafting time: one drafter alone, unverified, on this machine.
        alone = create_drafter("llama-cpp", DrafterOptions(context_size=512, threads=1))
        context = list(ids[0])
        alone.begin(context, SamplingParams())
        t1 = time.perf_counter()
        for _ in range(args.max_tokens):
            context += alone.propose(context, 1).token_ids
        device_spt = (time.perf_counter() - t1) / args.max_tokens
        alone.close()
        spt = args.device_ms_per_token / 1000 if args.device_ms_per_token else device_spt
        print(f"[bench] one llama.cpp drafter alone: {device_spt * 1000:.1f} ms/token; replay uses "
              f"{spt * 1000:.1f} ms/token", flush=True)

        plan = [(n, m) for n in counts for m in ("server-only", "2", "4", "8", "adaptive")]
        for n, mode in tqdm(plan, desc="system", unit="config"):
            prompts_n = [ids[i % len(ids)] for i in range(n)]
            if mode == "server-only":
                res = asyncio.run(run_devices(address, tokenizer, [create_drafter("none") for _ in range(n)],
                                              prompts_n, args.max_tokens, 0, adaptive=False))
                rows.append(summarize(mode, n, *res))
                continue
            drafters = [ReplayDrafter(tables[i % len(tables)], spt) for i in range(n)]
            k = args.draft_tokens if mode == "adaptive" else int(mode)
            res = asyncio.run(run_devices(address, tokenizer, drafters, prompts_n, args.max_tokens, k,
                                          adaptive=mode == "adaptive"))
            row = summarize("sled", n, *res)
            row["k"] = mode
            (rows if mode == "adaptive" else adaptive_rows).append(row)
            if mode == "adaptive":
                adaptive_rows.append(row)
        for n in counts:
            rows.append({"mode": "device-only", "devices": n, "system_tokens_per_s": n / device_spt,
                         "per_device_tokens_per_s": 1 / device_spt, "p50_inter_token_ms": device_spt * 1000,
                         "p95_inter_token_ms": device_spt * 1000, "acceptance_rate": 0.0, "mean_draft_tokens": 0.0,
                         "server_step_ms": 0.0, "server_forward_ms": 0.0, "server_batch_sessions": 0.0})

    finally:
        server.stop()

    sixteen = [r for r in rows if r["mode"] == "sled" and r["devices"] == 16]
    by = {(r["mode"], r["devices"]): r for r in rows}

    lines = ["| devices | mode | system tok/s | per-device tok/s | ITL p50 ms | ITL p95 ms | acceptance | "
             "server step ms | batch | SLED / server-only |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        for mode in ("sled", "server-only", "device-only"):
            r = by[(mode, n)]
            ratio = (f"{r['system_tokens_per_s'] / by[('server-only', n)]['system_tokens_per_s']:.2f}x"
                     if mode == "sled" else "")
            lines.append(f"| {n} | {mode} | {r['system_tokens_per_s']:.1f} | {r['per_device_tokens_per_s']:.1f} | "
                         f"{r['p50_inter_token_ms']:.1f} | {r['p95_inter_token_ms']:.1f} | {r['acceptance_rate']:.2f} | "
                         f"{r['server_step_ms']:.1f} | {r['server_batch_sessions']:.1f} | {ratio} |")
    capacity = {}
    for mode in ("sled", "server-only", "device-only"):
        ok = [n for n in counts if by[(mode, n)]["p95_inter_token_ms"] <= args.slo_ms]
        capacity[mode] = max(ok) if ok else 0
    alines = ["| devices | K | system tok/s | mean K | acceptance | ITL p95 ms |", "|---:|---|---:|---:|---:|---:|"]
    for r in adaptive_rows:
        alines.append(f"| {r['devices']} | {r['k']} | {r['system_tokens_per_s']:.1f} | {r['mean_draft_tokens']:.2f} | "
                      f"{r['acceptance_rate']:.2f} | {r['p95_inter_token_ms']:.1f} |")
    verdicts = []
    for n in counts:
        fixed = [r for r in adaptive_rows if r["devices"] == n and r["k"] != "adaptive"]
        best = max(fixed, key=lambda r: r["system_tokens_per_s"])
        ad = next(r for r in adaptive_rows if r["devices"] == n and r["k"] == "adaptive")
        verdicts.append(f"{n} devices: adaptive {ad['system_tokens_per_s']:.1f} tok/s vs best fixed K={best['k']} "
                        f"{best['system_tokens_per_s']:.1f} ({ad['system_tokens_per_s'] / best['system_tokens_per_s']:.2f}x)")
    overhead = ""
    if sixteen:
        s = sixteen[0]
        overhead = (f"- non-model time per step at 16 sessions (scheduling, sampling, commit; step − forward): "
                    f"{s['server_step_ms'] - s['server_forward_ms']:.1f} of {s['server_step_ms']:.1f} ms "
                    f"({(1 - s['server_forward_ms'] / s['server_step_ms']) * 100:.1f}%)\n")
    section = (
        "## System benchmark: SLED vs server-only vs device-only\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU)\n"
        f"- command: `python scripts/bench_system.py {' '.join(sys.argv[1:])}`\n"
        f"- target: SmolLM2-135M-Instruct float32 on CPU; drafts: llama.cpp Q4_1's greedy proposals, recorded and "
        f"replayed at {spt * 1000:.1f} ms/token of drafting per device (one drafter alone here); `sled` uses the "
        f"adaptive draft length (default, K ≤ {K_MAX}); {args.max_tokens} greedy tokens per device\n"
        f"- capacity (largest tested device count with p95 inter-token latency ≤ {args.slo_ms:g} ms): "
        + ", ".join(f"{m} {c}" for m, c in capacity.items()) + "\n"
        "- device-only is the drafter alone (not target quality), N devices = N × one device's measured rate\n\n"
        + "\n".join(lines) + "\n\n"
        "### Step time under load\n\n" + overhead
        + "- the decode step at batch 1 against the memory-bandwidth limit is measured alone, without client "
        "processes sharing the cores: see the engine speed section (`scripts/bench_engine.py`)\n\n"
        "### Adaptive draft length vs fixed K (same replayed drafter, same run)\n\n"
        + "\n".join(alines) + "\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    )
    publish(args.markdown, "## System benchmark", section, args.json, rows + adaptive_rows)
    paths = plot(rows, Path(args.out_dir))
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(alines))
    print(f"[bench] capacity: {capacity}; plots: {[str(p) for p in paths]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
