"""make demo: start a verify server and a device on this machine, generate, print text and statistics; then a fleet
of devices on emulated hardware against server-only; stop all."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sim.processes import free_port

BIN = Path(sys.executable).parent
PROMPTS = [
    ("llama-cpp", "Explain in two sentences why the sky is blue."),
    ("llama-cpp", "Write a short poem about a lighthouse."),
    ("none", "Explain in two sentences why the sky is blue."),
]
FLEET = 8  # devices in the demo's second part
FLEET_TOKENS = 48  # tokens a request there
FLEET_SECONDS = 6.0  # each mode's measured window, after a 2 s warm-up


def fleet(address: str) -> bool:
    """FLEET devices on emulated hardware: each replays the real llama.cpp drafter's drafts, recorded along the
    target's answers, at that drafter's speed measured on this machine, as sled-bench capacity does; so the devices
    do not draft on the server's cores. Against FLEET server-only devices (the server decodes every token)."""
    from bench.capacity import MODES
    from bench.load import run_window, summarize
    from bench.replay import (DraftClock, ReplayDrafter, drafting_ms_alone, measure_prefill, prefill_tokens,
                              record_tables)
    from bench.runner import prompts
    from edge_client.drafters import create_drafter
    from edge_client.drafters.base import DrafterOptions
    from edge_client.policy import DraftPolicy
    from edge_client.tokenizer import Tokenizer

    tokenizer = Tokenizer()
    ids = prompts(tokenizer, 4)
    print(f"\n[demo] {FLEET} devices at once, on emulated hardware: measuring the llama.cpp drafter's speed here, "
          "then recording its drafts along the target's answers ...", flush=True)
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=512))
    try:
        spt = statistics.median(drafting_ms_alone(drafter, ids[0], 32)) / 1000
        prefill_spt = measure_prefill(drafter, ids, spt)[0]
    finally:
        drafter.close()
    tables, fulls, confidences = record_tables(address, tokenizer, ids, FLEET_TOKENS)
    prefill_s = [n * prefill_spt for n in prefill_tokens(ids)]
    rows = {}
    for mode, policy in MODES.items():
        print(f"[demo] {FLEET} {mode} devices for {FLEET_SECONDS:g} s ...", flush=True)
        clock = DraftClock()
        make = (lambda p: create_drafter("none")) if policy is None else (
            lambda p: ReplayDrafter(tables[p], spt, fulls[p], confidences[p], clock, prefill_s[p]))
        window = asyncio.run(run_window(address, tokenizer, make, ids, FLEET, FLEET_TOKENS, policy or DraftPolicy(0),
                                        2.0, FLEET_SECONDS))
        rows[mode] = summarize(mode, FLEET, window)
    print(f"\n[demo] {FLEET} devices (drafting replayed at {spt * 1000:.1f} ms/token, the drafter's speed measured "
          f"here; requests of {FLEET_TOKENS} greedy tokens back to back)")
    print(f"  {'mode':12} {'system tok/s':>12} {'p50 TPOT ms':>11} {'p95 TPOT ms':>11} {'p95 TTFT ms':>11}")
    for mode, r in rows.items():
        print(f"  {mode:12} {r['system_tokens_per_s']:12.1f} {r['p50_tpot_ms']:11.1f} {r['p95_tpot_ms']:11.1f} "
              f"{r['p95_ttft_ms']:11.0f}")
    sled, base = rows["sled"], rows["server-only"]
    if not base["system_tokens_per_s"]:
        print("[demo] server-only committed nothing in its window", file=sys.stderr)
        return False
    print(f"  SLED / server-only: {sled['system_tokens_per_s'] / base['system_tokens_per_s']:.2f}x the tokens a "
          "second (TPOT: a request's time after its first tokens, per token; sled-bench capacity finds the most "
          "devices within a TPOT target)")
    return True


def main() -> int:
    argparse.ArgumentParser(description=__doc__ + " It takes no options: the server's log goes to a temporary folder "
                            "it names, and the models are the defaults (README.md, make demo).").parse_args()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="sled-demo-"))
    log = workdir / "server.log"
    print(f"[demo] starting sled-server on 127.0.0.1:{port} (target: SmolLM2-135M-Instruct, float32 on CPU; "
          f"log {log})", flush=True)
    with open(log, "w") as out:
        server = subprocess.Popen([BIN / "sled-server", "--port", str(port), "--max-sessions", str(FLEET),
                                   "--max-seq-len", "1024"], stdout=out, stderr=subprocess.STDOUT)
    try:
        start = time.time()
        while "ready on" not in log.read_text():
            if server.poll() is not None:
                print(log.read_text(), file=sys.stderr)
                print("[demo] the server failed to start", file=sys.stderr)
                return 1
            if time.time() - start > 300:
                print("[demo] the server did not become ready in 300 s", file=sys.stderr)
                return 1
            waited = time.time() - start
            if sys.stdout.isatty():
                print(f"\r[demo] loading the target model... {waited:4.0f}s", end="", flush=True)
            elif int(waited) % 10 == 0:
                print(f"[demo] loading the target model... {waited:.0f}s", flush=True)
            time.sleep(1)
        print(("\r" if sys.stdout.isatty() else "") + f"[demo] server ready after {time.time() - start:.0f}s" + " " * 20,
              flush=True)
        summary = []
        for i, (drafter, prompt) in enumerate(PROMPTS):
            stats_file = workdir / f"stats{i}.json"
            print(f"\n[demo] device ({drafter} drafter) asks: {prompt}\n", flush=True)
            done = subprocess.run([BIN / "sled-edge", "generate", prompt, "--chat", "--server", f"127.0.0.1:{port}",
                                   "--drafter", drafter, "--max-tokens", "96",
                                   # Drafting ahead would draft on the cores the server verifies on, here the same.
                                   *(["--no-draft-ahead"] if drafter != "none" else []),
                                   "--stats-json", str(stats_file)])
            if done.returncode != 0:
                print(f"[demo] sled-edge failed with exit code {done.returncode}", file=sys.stderr)
                return 1
            summary.append((drafter, json.loads(stats_file.read_text())))
        print("\n[demo] summary")
        print(f"  {'drafter':10} {'tokens':>6} {'rounds':>6} {'accept':>7} {'mean len':>8} {'tok/s':>7}")
        for drafter, s in summary:
            print(f"  {drafter:10} {len(s['token_ids']):6d} {s['rounds']:6d} {s['acceptance_rate']:7.2f} "
                  f"{s['mean_acceptance_length']:8.2f} {s['tokens_per_second']:7.1f}")
        print("  (none = the server decodes every token: the server-only baseline)")
        print("  (here the drafter and the server share this machine's cores: the device drafts only between its "
              "verdicts\n   (--no-draft-ahead), and SLED's gain is what is left after drafting's share of the "
              "cores;\n   real devices draft on their own hardware: the next part emulates that)")
        if not fleet(f"127.0.0.1:{port}"):
            return 1
        print(f"\n[demo] the server's view: sled-edge info --server 127.0.0.1:{port}", flush=True)
        done = subprocess.run([BIN / "sled-edge", "info", "--server", f"127.0.0.1:{port}"])
        if done.returncode != 0:
            print(f"[demo] sled-edge info failed with exit code {done.returncode}", file=sys.stderr)
            return 1
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        print("[demo] server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
