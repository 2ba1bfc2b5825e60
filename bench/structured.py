"""Structured output through SLED: JSON Schemas and a tool call's arguments, under the constraint, with the real
model pair.

One real sled-server (SmolLM2-135M-Instruct); one device drafting with llama.cpp (SmolLM2 Q4_1), chat prompts one
after another, greedy, side by side in one run: the server decoding alone under the constraint (server-only), SLED
with a drafter that drafts free text (the server's mask alone rejects what breaks the schema), SLED with the drafter
masked by the constraint on the device, and SLED on the same prompts without a constraint (free text). Reported per
mode: valid outputs (they parse and fit the schema), acceptance, mean acceptance length and device tokens/s. Writes
its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from edge_client.drafters import create_drafter
from edge_client.policy import DraftPolicy
from edge_client.request import Request
from edge_client.tokenizer import Tokenizer
from sim.processes import ServerProcess
from sled.constraints import Constraint

from .cli import positive
from .report import machine, publish
from .runner import Job, chat, run, summary

ROOT = Path(__file__).resolve().parent.parent
MARKER = "## Structured output: JSON Schemas and a tool call under the constraint"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"title": {"type": "string"}, "day": {"enum": [
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}, "hour": {"type": "integer"}},
         "required": ["title", "day", "hour"], "additionalProperties": False}
# A tool call as a forced tool_choice asks for it: the function's name and its arguments.
WEATHER_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
TASKS = {
    "person": (PERSON, ["Describe a made-up person as JSON with their name, age and city.",
                        "Invent a fictional detective and give their name, age and city as JSON."]),
    "product": (PRODUCT, ["Give a grocery product, its price and whether it is in stock, as JSON.",
                          "Describe a laptop for sale as JSON: product, price, in stock."]),
    "event": (EVENT, ["Plan a team meeting: give its title, day and hour as JSON.",
                      "Schedule a dentist appointment as JSON with title, day and hour."]),
    "tool call": (WEATHER_CALL, ["Call the get_weather function for the weather in Paris.",
                                 "Use the get_weather tool to find the temperature in Tokyo in fahrenheit."]),
}
MODES = ("server-only", "SLED, drafts unmasked", "SLED, drafts masked", "SLED, masked + forced tokens",
         "SLED, free text")
FREE = "SLED, free text"  # the same prompts without a constraint, each as long as its constrained answer


def valid(text: str, schema: dict) -> bool:
    """Whether the text parses as JSON and fits the schema (jsonschema, the reference validator)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def policy(mode: str, k: int) -> DraftPolicy:
    if mode == "server-only":
        return DraftPolicy(draft_tokens=0, adaptive=False)
    return DraftPolicy(draft_tokens=k, adaptive=False, mask_drafts=mode != "SLED, drafts unmasked",
                       forced_tokens=mode == "SLED, masked + forced tokens")


def run_mode(address, tokenizer, mode: str, args, lengths: list[int] | None = None) -> dict:
    """Every task's prompts through one device in `mode`: its summary and how many outputs were valid. `lengths`:
    each prompt's tokens at most (free text as long as the constrained answers), else --max-tokens."""
    drafter = create_drafter("none" if mode == "server-only" else "llama-cpp")
    try:
        jobs, schemas = [], []
        for schema, prompts in TASKS.values():
            constraint = None if mode == FREE else Constraint.json_schema(schema)
            for ids in chat(tokenizer, prompts):
                most = lengths[len(jobs)] if lengths else args.max_tokens
                jobs.append(Job(drafter, Request(ids, max_tokens=most, policy=policy(mode, args.draft_tokens),
                                                 constraint=constraint)))
                schemas.append(schema)
        results = run(address, tokenizer, jobs, together=False).results
    finally:
        drafter.close()
    eos = tokenizer.eos_token_id
    texts = [tokenizer.decode([t for t in r.token_ids if t != eos]) for r in results]
    return {"mode": mode, "outputs": len(results), "valid": sum(valid(t, s) for t, s in zip(texts, schemas)),
            "texts": texts, "lengths": [len(r.token_ids) for r in results],
            "forced_tokens": sum(r.forced_tokens for r in results), **summary(results)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=positive(int), default=96, help="tokens an output at most (default 96)")
    p.add_argument("--draft-tokens", type=positive(int), default=6, help="K, fixed (default 6)")
    p.add_argument("--repeats", type=positive(int), default=2,
                   help="passes over every mode, interleaved; the table has each mode's median pass (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    return p


def main(args) -> int:
    passes: dict[str, list[dict]] = {}
    try:
        with ServerProcess("--max-sessions", "4", "--max-seq-len", "1024",
                           "--max-draft-tokens", str(max(16, args.draft_tokens))) as address:
            tokenizer = Tokenizer()
            # the constrained answers' lengths (greedy: the same every pass), for free text of the same lengths
            lengths = run_mode(address, tokenizer, "SLED, masked + forced tokens", args)["lengths"]
            for repeat in range(args.repeats):
                for mode in MODES if repeat % 2 == 0 else reversed(MODES):
                    print(f"[bench] pass {repeat + 1}/{args.repeats}: {mode} ...", end=" ", flush=True)
                    row = run_mode(address, tokenizer, mode, args, lengths if mode == FREE else None)
                    passes.setdefault(mode, []).append(row)
                    print(f"{row['valid']}/{row['outputs']} valid, acceptance {row['acceptance_rate']:.2f}, "
                          f"{row['tokens_per_s']:.1f} tok/s", flush=True)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    rows = [sorted(done, key=lambda r: r["tokens_per_s"])[(len(done) - 1) // 2] | {
        "runs_tokens_per_s": [r["tokens_per_s"] for r in done]} for done in passes.values()]
    by = {r["mode"]: r for r in rows}
    lines = ["| mode | valid | acceptance | mean accept. length | forced tokens | device tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        valid_cell = "—" if r["mode"] == FREE else f"{r['valid']} / {r['outputs']}"
        lines.append(f"| {r['mode']} | {valid_cell} | {r['acceptance_rate']:.2f} | "
                     f"{r['mean_acceptance_length']:.2f} | {r['forced_tokens']} | {r['tokens_per_s']:.1f} |")
    best, masked, unmasked, free = (by[m]["tokens_per_s"] for m in (
        "SLED, masked + forced tokens", "SLED, drafts masked", "SLED, drafts unmasked", "SLED, free text"))
    goals = (f"- device tok/s, masked + forced tokens against drafts unmasked: {best / unmasked:.2f}x (goal at least "
             f"1.3x; drafts masked alone {masked / unmasked:.2f}x); against free text: {best / free:.2f}x (goal at "
             "least 1.0x)")
    table = "\n".join(lines) + "\n\n" + goals
    print("\n" + table)
    section = (
        f"{MARKER}\n\n`sled-bench structured {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.\n\n"
        f"- target SmolLM2-135M-Instruct (float32, torch), drafter SmolLM2 Q4_1 (llama.cpp); greedy; K = "
        f"{args.draft_tokens} fixed, no drafting ahead; at most {args.max_tokens} tokens an output; "
        f"{sum(len(p) for _, p in TASKS.values())} chat prompts over {len(TASKS)} tasks ("
        + ", ".join(TASKS) + "; the tool call is the function's name and arguments, as a forced tool choice asks)"
        f"; one device, prompts one after another; {args.repeats} passes, the modes' order reversed every other "
        "one, each row the median pass\n"
        "- valid: the output parses as JSON and fits its schema; free text runs the same prompts without a "
        "constraint, each cut at its constrained answer's length (its outputs are not checked); a first, uncounted "
        "run warms both sides (the grammar library's tokenizer, each schema's compilation) and measures those "
        "lengths\n\n" + table + "\n")
    publish(args.markdown, MARKER, section, args.json, rows)
    return 0
