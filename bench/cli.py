"""sled-bench: SLED's benchmarks and stress checks. `sled-bench` lists them; `sled-bench NAME --help` tells what
one measures or checks."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with build_parser() and main(args), what it measures)
COMMANDS = {
    "system": ("bench.system", "SLED, server-only and device-only at several device counts with replayed drafts; "
                               "adaptive against fixed K, drafting ahead against waiting"),
    "capacity": ("bench.capacity", "the most devices each mode serves within a p95 TPOT and TTFT target"),
    "first": ("bench.first", "first figures (make bench): SLED against server-only, devices on the server's cores"),
    "drafters": ("bench.drafters", "every drafter's acceptance and speed on repetitive, edit and free text; "
                                   "stacked drafters against the model alone"),
    "engine": ("bench.engine", "the target's decode step at batch 1 against the memory-bandwidth floor (CPU)"),
    "compiled": ("bench.compiled", "the compiled step beside eager PyTorch and the fused C step, per family (CPU)"),
    "gpu-check": ("bench.gpu_check", "for a lent GPU: the step against the floor and transformers' compiled static "
                                     "cache, and the compiled step's greedy agreement with eager"),
    "gpu-step": ("bench.gpu_step", "the target's step on a GPU: per-segment attention against one padded call"),
    "sim-rounds": ("bench.sim_rounds", "a discrete-event model of devices and one server: the adaptive K against "
                                       "fixed K"),
    "soak": ("stress.soak", "64 devices for a while against a server that is killed, restarted and sent garbage: "
                           "sessions served, tokens lost, slots leaked, memory growth"),
    "fuzz": ("stress.fuzz", "random message sequences, cancelled at random points, against a real server: no "
                           "INTERNAL or UNKNOWN, no hang, every slot free after"),
    "fairness": ("bench.fairness", "a light device's round time alone and beside devices sending long prompts"),
    "fly": ("bench.fly", "FLy's loose verification against exact on HumanEval: acceptance length, speed, accuracy"),
    "structured": ("bench.structured", "JSON Schemas and a tool call under the constraint: server-only, drafts "
                                       "unmasked and masked, free text: validity, acceptance, speed"),
    "fleet": ("bench.fleet", "a calibrated discrete-event model of devices and one server: capacity at a TPOT target "
                             "on named GPUs and targets, checked against this CPU's capacity run"),
    "grammars": ("bench.grammars", "the verifier's grammar library: llguidance against xgrammar, compile and "
                                   "per-token mask times on the target's tokenizer"),
}


def counts_arg(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers, each at least 1 (device or session counts)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return counts


def positive(kind=float):
    """An argparse type: a number above 0 (NaN refused)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
        return value

    return parse


def at_least(floor: float):
    """An argparse type: a number of at least `floor` (NaN refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number at least {floor:g}, got {text!r}") from None
        if not value >= floor:
            raise argparse.ArgumentTypeError(f"must be at least {floor:g}, got {text!r}")
        return value

    return parse


def usage() -> str:
    width = max(map(len, COMMANDS))

    def listed(package: str) -> str:
        return "\n".join(f"  {name:<{width}}  {what}" for name, (module, what) in COMMANDS.items()
                         if module.startswith(package + "."))

    return ("usage: sled-bench NAME [options]   (sled-bench NAME --help for one)\n\nbenchmarks:\n" + listed("bench")
            + "\n\nstress checks (pass or fail):\n" + listed("stress"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sled-bench: no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = module.build_parser()
    parser.prog = f"sled-bench {name}"
    return module.main(parser.parse_args(rest)) or 0


if __name__ == "__main__":
    sys.exit(main())
