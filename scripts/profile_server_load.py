"""Profile the verify server's threads under load, to see where its step time goes.

    python scripts/profile_server_load.py --target random:llama-1b --tokenizer runs/tokenizer --devices 32

Starts a real sled-server, loads it with N devices (replayed drafts, as scripts/bench_system.py does) in `sled`
and `server-only` mode in turn, and while each runs records the server process with py-spy (`pip install
py-spy`; it needs ptrace, as root or with ptrace allowed): once with idle samples included (where the threads
wait) and once with only the samples of the thread holding the GIL (where Python time goes). Writes py-spy's
raw (collapsed) stacks per mode and kind into --out, and prints each mode's step time, forward time and batch,
and per recording the samples of each thread and its most sampled innermost frames.

Why: on the H100 a SLED step under load took 3-5x what the same forward took alone (docs/benchmarks.md); the
candidates are host-side (the GIL shared with grpc's event loop, per-shape costs) and this tells them apart. Its
first run on the H100 showed the engine thread's wall time 46-73% inside one scaled_dot_product_attention line
while it held the GIL little: the kernel choice's cost at each new shape (see CUDA_SDPA_BACKENDS in
verify_server/model_runner.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "protos"))

from edge_client.drafters import create_drafter  # noqa: E402
from scripts.bench_system import (ReplayDrafter, greedy_outputs, prompts, run_window, server_flags,  # noqa: E402
                                  summarize, synthesize_tables)
from bench.processes import ServerProcess  # noqa: E402
from bench.tokenizers import device_tokenizer  # noqa: E402


def summarize_stacks(path: Path, top: int = 6) -> str:
    """py-spy's raw stacks as text: samples per thread, and each busy thread's most sampled innermost frames."""
    threads: dict[str, Counter] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        threads.setdefault(thread, Counter())[frames[-1]] += int(count)
    out = []
    for thread, leaves in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(leaves.values())
        out.append(f"  {thread}: {total} samples")
        out += [f"    {n / total:5.1%} {frame}" for frame, n in leaves.most_common(top)]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:llama-1b", help="the server's target (default random:llama-1b)")
    ap.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for a random target (export_tokenizer.py)")
    ap.add_argument("--devices", type=int, default=32, help="devices loading the server (default 32)")
    ap.add_argument("--draft-match", type=float, default=0.981, help="drafted-token match (default 0.981)")
    ap.add_argument("--device-ms-per-token", type=float, default=16.8, help="drafting time per token (default 16.8)")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each py-spy recording (default 6)")
    beside = Path(sys.executable).parent / "py-spy"  # in the same environment as this Python
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or str(beside), help="the py-spy program")
    ap.add_argument("--out", default=str(ROOT / "runs" / "profile"), help="where the stacks go (default runs/profile)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG=VALUE",
                    help="extra sled-server flag, e.g. --server-arg=--attention=segments (repeatable)")
    args = ap.parse_args()
    if args.devices < 1 or args.seconds <= 0 or args.device_ms_per_token <= 0 or not 0 <= args.draft_match <= 1:
        ap.error("--devices, --seconds and --device-ms-per-token must be positive, --draft-match in [0, 1]")
    if shutil.which(args.py_spy) is None and not Path(args.py_spy).exists():
        ap.error(f"py-spy not found ({args.py_spy}): pip install py-spy, or give --py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.devices
    extra = [a for arg in args.server_arg for a in arg.split("=", 1)] + ["--target", args.target]
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]
    tok = device_tokenizer(args.tokenizer)
    ids = prompts(tok, 8)
    server = ServerProcess(*server_flags(n, 3.0), *extra)
    address = server.start()
    try:
        fulls = greedy_outputs(address, tok, ids, 64)
        tables = synthesize_tables(fulls, [len(i) for i in ids], args.draft_match, tok.vocab_size)

        def record(name: str, delay: float, flags: list[str]) -> threading.Thread:
            def go():
                time.sleep(delay)
                done = subprocess.run([args.py_spy, "record", "--pid", str(server.proc.pid), "--duration",
                                       str(int(args.seconds)), "--threads", "--format", "raw", "--rate", "200",
                                       "-o", str(out / f"{name}.txt"), *flags], capture_output=True, text=True)
                if done.returncode:
                    print(f"[profile] py-spy {name} failed: {done.stderr.strip()[-500:]}", flush=True)
            thread = threading.Thread(target=go)
            thread.start()
            return thread

        def window(mode: str, seconds: float, profile: bool) -> None:
            spies = []
            if profile:
                spies = [record(f"{mode}-idle", 2.0, ["--idle"]), record(f"{mode}-gil", 4.0 + args.seconds, ["--gil"])]
            if mode == "server-only":
                make, k = (lambda p: create_drafter("none")), 0
            else:
                make, k = (lambda p: ReplayDrafter(tables[p], args.device_ms_per_token / 1000, fulls[p])), 4
            w = asyncio.run(run_window(address, tok, make, ids, n, 64, k, 1.0, seconds, adaptive=mode == "sled"))
            for spy in spies:
                spy.join()
            row = summarize(mode, n, w)
            print(json.dumps({key: round(row[key], 2) if isinstance(row[key], float) else row[key] for key in
                              ("mode", "devices", "system_tokens_per_s", "server_step_ms", "server_forward_ms",
                               "server_batch_sessions", "server_busy_share", "mean_draft_tokens")}), flush=True)

        print("[profile] warming up (each mode once, unrecorded) ...", flush=True)
        for mode in ("sled", "server-only"):
            window(mode, 3.0, False)
        for mode in ("sled", "server-only"):
            print(f"[profile] {mode}: recording ...", flush=True)
            window(mode, 2 * args.seconds + 6.0, True)
    finally:
        server.stop()
    for path in sorted(out.glob("*.txt")):
        print(f"[profile] {path.name}\n{summarize_stacks(path)}")
    print(f"[profile] stacks in {out}; server log {server.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
