"""The verify server's grammar library, chosen by measurement: llguidance against xgrammar on the target's tokenizer.

Both libraries are given the same work, single-threaded: the structured benchmark's JSON Schemas and any JSON
object, compiled cold, then walked along valid answers token by token as verification walks a draft: the mask of
allowed tokens at each position, the token taken, and every few tokens a rejection (two tokens rolled back and
taken again). Reported per library: the tokenizer's one-time preparation, compile time to the first mask, and the
median and p99 of a position's mask-and-advance and of a rollback. Writes its section of docs/benchmarks.md.

xgrammar is not among SLED's dependencies (on Linux it pulls triton, for GPU kernels this measurement does not
use). Install it beside SLED to run this: `.venv/bin/pip install --no-deps xgrammar apache-tvm-ffi`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from sled.constraints import Constraint

from .cli import positive
from .report import machine, publish
from .structured import EVENT, PERSON, PRODUCT, WEATHER_CALL

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## Grammar library: llguidance against xgrammar at the verifier"

# (name, schema or None for any JSON object, valid answers in the server's layout: ", " and ": ")
TASKS = [
    ("person", PERSON, ['{"name": "Ada Lovelace", "age": 36, "city": "London"}',
                        '{"name": "Hercule Poirot", "age": 61, "city": "Brussels"}']),
    ("product", PRODUCT, ['{"product": "Organic bananas", "price": 2.49, "in_stock": true}',
                          '{"product": "ThinkPad X1 Carbon", "price": 1299.0, "in_stock": false}']),
    ("event", EVENT, ['{"title": "Team sync", "day": "Tuesday", "hour": 10}',
                      '{"title": "Dentist appointment", "day": "Friday", "hour": 15}']),
    ("tool call", WEATHER_CALL, ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
                                 '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "fahrenheit"}}']),
    ("any JSON object", None, ['{"cat": {"name": "Misty", "age": 4, "toys": ["ball", "mouse"]}, "owner": null}']),
]
REJECT_EVERY = 5  # a rejection every so many positions: two tokens rolled back and taken again


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int, eos: int):
        import llguidance
        import llguidance.numpy as llnp
        from llguidance.hf import from_tokenizer

        self._ll, self._np = llguidance, llnp
        self.tokenizer = from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.bitmask = llnp.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        grammar = (Constraint("json_object") if schema is None else Constraint.json_schema(schema)).grammar()
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher):
        self._np.fill_next_token_bitmask(matcher, self.bitmask, 0)
        return self.bitmask[0]

    def take(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos: int):
        import xgrammar

        self._xg = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        if schema is None:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                         separators=(", ", ": "), strict_mode=True)
        return self._xg.GrammarMatcher(compiled)

    def mask(self, matcher):
        matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0].numpy()

    def take(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


def allowed(bitmask_row, token: int) -> bool:
    return bool((int(np.uint32(bitmask_row[token // 32])) >> (token % 32)) & 1)


def measure(lib, hf, eos: int, repeats: int) -> dict:
    """One library's times over every task, `repeats` times; each answer must be taken whole and end the grammar."""
    compile_ms, step_us, rollback_us = [], [], []
    for _ in range(repeats):
        for name, schema, answers in TASKS:
            start = time.perf_counter()
            template = lib.compile(schema)
            lib.mask(template)
            compile_ms.append((time.perf_counter() - start) * 1e3)
            for answer in answers:
                tokens = hf.encode(answer, add_special_tokens=False) + [eos]
                matcher = lib.compile(schema)
                for i, token in enumerate(tokens):
                    start = time.perf_counter()
                    row = lib.mask(matcher)
                    ok = allowed(row, token) and lib.take(matcher, token)
                    step_us.append((time.perf_counter() - start) * 1e6)
                    if not ok:
                        raise RuntimeError(f"{lib.name}: {name} answer {answer!r} refused at token {i} ({token})")
                    if i % REJECT_EVERY == REJECT_EVERY - 1 and i + 1 < len(tokens):
                        start = time.perf_counter()
                        lib.rollback(matcher, 2)
                        rollback_us.append((time.perf_counter() - start) * 1e6)
                        for again in tokens[i - 1:i + 1]:
                            lib.take(matcher, again)
    return {"library": lib.name, "compile_ms_p50": statistics.median(compile_ms), "compile_ms_max": max(compile_ms),
            "step_us_p50": statistics.median(step_us), "step_us_p99": float(np.percentile(step_us, 99)),
            "rollback_us_p50": statistics.median(rollback_us), "positions": len(step_us)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=positive(int), default=5, help="passes over every task (default 5)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def main(args) -> int:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("sled-bench grammars compares llguidance with xgrammar, which is not installed: "
              ".venv/bin/pip install --no-deps xgrammar apache-tvm-ffi", file=sys.stderr)
        return 1
    from importlib.metadata import version

    from verify_server.model_loader import vocabulary_tokenizer

    hf = vocabulary_tokenizer()
    eos, vocab_size = hf.eos_token_id, len(hf)
    rows = []
    for kind in (Llguidance, Xgrammar):
        start = time.perf_counter()
        lib = kind(hf, vocab_size, eos)
        prepare_s = time.perf_counter() - start
        print(f"[bench] {kind.name}: tokenizer prepared in {prepare_s:.2f} s; compiling and walking "
              f"{sum(len(a) for *_, a in TASKS)} answers x {args.repeats} ...", flush=True)
        rows.append({"version": version(kind.name), "prepare_s": prepare_s, **measure(lib, hf, eos, args.repeats)})
    lines = ["| library | version | tokenizer prepared | compile to first mask, median (max) | mask + advance a "
             "position, median (p99) | rollback of 2 |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['library']} | {r['version']} | {r['prepare_s']:.2f} s | {r['compile_ms_p50']:.1f} ms "
                     f"({r['compile_ms_max']:.1f} ms) | {r['step_us_p50']:.0f} µs ({r['step_us_p99']:.0f} µs) | "
                     f"{r['rollback_us_p50']:.1f} µs |")
    table = "\n".join(lines)
    print("\n" + table)
    section = (
        f"{MARKER}\n\n`sled-bench grammars {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- the target's tokenizer (SmolLM2, {vocab_size:,} tokens), one thread; {len(TASKS)} constraints ("
        + ", ".join(n for n, *_ in TASKS) + f"), each compiled cold {args.repeats} times and its valid answers "
        f"walked ({rows[0]['positions']:,} positions a library): at each, the mask of allowed tokens, the token "
        f"checked against it and taken, and every {REJECT_EVERY} positions two tokens rolled back and taken again\n"
        "- xgrammar installed for this run only (`pip install --no-deps xgrammar apache-tvm-ffi`); the server uses "
        "llguidance\n\n" + table + "\n")
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0
