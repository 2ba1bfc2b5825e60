"""make demo: start a verify server and a device on this machine, generate, print text and statistics, stop all."""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    argparse.ArgumentParser(description=__doc__ + " It takes no options: the server's log goes to a temporary folder "
                            "it names, and the models are the defaults (README.md, make demo).").parse_args()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="sled-demo-"))
    log = workdir / "server.log"
    print(f"[demo] starting sled-server on 127.0.0.1:{port} (target: SmolLM2-135M-Instruct, float32 on CPU; "
          f"log {log})", flush=True)
    with open(log, "w") as out:
        server = subprocess.Popen([BIN / "sled-server", "--port", str(port), "--max-sessions", "4",
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
              "cores;\n   real devices draft on their own hardware: sled-bench system measures that, "
              "docs/benchmarks.md)")
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
