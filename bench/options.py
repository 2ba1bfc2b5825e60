"""The options of the replayed-load benchmarks (`sled-bench system`, `sled-bench capacity`), checked in one place."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

from .cli import counts_arg, positive

ROOT = Path(__file__).resolve().parent.parent


def system_parser(description: str, devices: str = "1,4,16,32") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=counts_arg, default=counts_arg(devices), help=f"device counts (default {devices})")
    p.add_argument("--max-tokens", type=positive(int), default=64, help="tokens a request (default 64)")
    p.add_argument("--seconds", type=positive(), default=8.0, help="length of the measured window (default 8)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="time before the window opens (default 1)")
    p.add_argument("--recordings", type=positive(int), default=8, help="distinct prompts, reused in turn (default 8)")
    p.add_argument("--max-wait-ms", type=float, default=3.0, help="the server's batching window (default 3)")
    p.add_argument("--device-ms-per-token", type=positive(), metavar="MS",
                   help="the devices' drafting time a token (default: from a --draft-match file, else measured here "
                        "for llama.cpp Q4_1 with --device-threads)")
    p.add_argument("--device-prefill-ms-per-token", type=float, metavar="MS",
                   help="the devices' prefill time a prompt token (default: from a --draft-match file, else measured "
                        "here; 0 where neither is possible)")
    p.add_argument("--device-threads", type=positive(int), default=os.cpu_count() or 1,
                   help="llama.cpp threads of the drafter timed alone (default: this machine's cores)")
    p.add_argument("--target", metavar="SPEC", help="the server's target (default SmolLM2-135M-Instruct); "
                                                    "random:llama-1b or random:llama-8b with synthesized drafts")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the vocabulary as a tokenizer folder (scripts/export_tokenizer.py), where the GGUF is missing")
    p.add_argument("--draft-match", metavar="P|FILE",
                   help="synthesize drafts right with probability P (default for random targets 0.95), or the JSON "
                        "file a --match-only run wrote (the real pair's match and drafting speed)")
    p.add_argument("--match-only", action="store_true",
                   help="record the real drafter along the target's greedy output, print its match, write it to "
                        "--json and stop")
    p.add_argument("--min-step-ms", type=float, default=0.0, metavar="MS",
                   help="the server pads every forward to this (a GPU's step profile on a CPU; default 0: off)")
    p.add_argument("--min-step-ms-per-token", type=float, default=0.0, metavar="MS",
                   help="and this more a token (default 0)")
    p.add_argument("--link", metavar="SPEC",
                   help="each device behind its own emulated link, e.g. delay_ms=20,jitter_ms=5,rate_mbit=50")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG=VALUE",
                   help="an extra sled-server flag, e.g. --server-arg=--dtype=bfloat16 (repeatable)")
    p.add_argument("--repeats", type=positive(int), default=5, help="passes of every configuration (default 5)")
    p.add_argument("--warmup-pass", action="store_true", help="one uncounted pass first (a fresh GPU server is slow)")
    p.add_argument("--label", help="a name for a section of its own in docs/benchmarks.md")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plots", default=str(ROOT / "docs" / "plots"), help="where PNG plots go (default docs/plots)")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="the file whose section is "
                                                                                     "rewritten")
    return p


def check_system_args(args) -> None:
    """Resolve what the options imply, or exit with the option's error: a --draft-match file's match and drafting
    speed, the link, the server's flags."""
    fail = argparse.ArgumentParser(prog="sled-bench").error
    random_target = bool(args.target and args.target.startswith("random:"))
    args.drafting_source, args.match_source = "as given", None
    if args.draft_match is not None and args.draft_match.endswith(".json"):
        try:
            measured = json.loads(Path(args.draft_match).read_text())
            args.match_source = (f"the real pair's match, measured on {measured['machine']} at {measured['date']} "
                                 f"over {measured['recordings']} greedy outputs")
            args.draft_match = float(measured["draft_match"])
            if args.device_ms_per_token is None and measured.get("drafting_ms_per_token") is not None:
                args.device_ms_per_token = float(measured["drafting_ms_per_token"])
                args.drafting_source = "the real drafter's, measured with the match"
            if args.device_prefill_ms_per_token is None and measured.get("prefill_ms_per_token") is not None:
                args.device_prefill_ms_per_token = float(measured["prefill_ms_per_token"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(f"--draft-match {args.draft_match}: not a --match-only JSON file ({err})")
    elif args.draft_match is not None:
        try:
            args.draft_match = float(args.draft_match)
        except ValueError:
            fail(f"--draft-match must be a probability or a --match-only JSON file, got {args.draft_match!r}")
    if args.draft_match is None and random_target:
        args.draft_match = 0.95
    if args.draft_match is not None and not 0 <= args.draft_match <= 1:
        fail("--draft-match must be in [0, 1]")
    if args.device_prefill_ms_per_token is not None and not 0 <= args.device_prefill_ms_per_token < 60_000:
        fail("--device-prefill-ms-per-token must be in [0, 60000)")
    if not 0 <= args.max_wait_ms < 60_000 or args.warmup_s < 0:
        fail("--max-wait-ms must be in [0, 60000) and --warmup-s not negative")
    if not (0 <= args.min_step_ms < 60_000 and 0 <= args.min_step_ms_per_token < 60_000):
        fail("--min-step-ms and --min-step-ms-per-token must be in [0, 60000)")
    if args.match_only and (args.draft_match is not None or random_target):
        fail("--match-only measures the real drafter against the real target: no --draft-match or random target")
    if args.tokenizer and not random_target:
        fail("--tokenizer goes with a random target (--target random:...): the default target brings its own")
    if importlib.util.find_spec("llama_cpp") is None and (args.draft_match is None or args.device_ms_per_token is None):
        fail("llama.cpp is not installed here: give --draft-match and --device-ms-per-token (a --match-only JSON "
             "file given to --draft-match carries both)")
    args.link_spec = None
    if args.link is not None:
        from sim.linkemu import LinkSpec

        try:
            args.link_spec = LinkSpec.parse(args.link)
        except ValueError as err:
            fail(f"--link: {err}")
        args.label = args.label or f"devices over an emulated link of {args.link_spec.describe()}"
    extra = [a for arg in args.server_arg for a in arg.split("=", 1)]
    if args.min_step_ms or args.min_step_ms_per_token:
        extra += ["--min-step-ms", str(args.min_step_ms), "--min-step-ms-per-token", str(args.min_step_ms_per_token)]
    extra += ["--target", args.target] if args.target else []
    extra += ["--tokenizer", args.tokenizer] if args.tokenizer else []

    def server_flags(devices: int) -> list[str]:
        """A slot for every device (and two spare), every device's draft in one step."""
        return ["--max-sessions", str(devices + 2), "--max-seq-len", "512", "--max-batch-sessions", str(devices),
                "--max-batch-tokens", str(max(512, devices * 10)), "--max-wait-ms", str(args.max_wait_ms), *extra]

    args.server_flags = server_flags
