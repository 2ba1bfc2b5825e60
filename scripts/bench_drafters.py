"""Acceptance of every drafter on repetitive and on free text, against one real verify server.

For each drafter and text set, the prompts run one after another (one device), greedy, and the
figures are acceptance rate (accepted / drafted), mean acceptance length (1 + accepted / rounds) and
device tokens/s. One drafter instance serves a whole set, so Cacheback's tables warm up across the
set's prompts, as on a device that keeps running. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_client.drafters import DrafterOptions, create_drafter  # noqa: E402
from edge_client.generation import generate  # noqa: E402
from edge_client.tokenizer import Tokenizer  # noqa: E402
from edge_client.transport import VerifierClient  # noqa: E402
from bench.processes import ServerProcess  # noqa: E402
from bench.report import machine, publish  # noqa: E402

REPETITIVE = [
    "Repeat this sentence five times, one per line: The quick brown fox jumps over the lazy dog.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 10.",
    "List the days of the week, then list them again in reverse order.",
    "Write a Python class Point with x and y, and methods add, sub, mul and div that each return a new Point.",
    "Write an HTML table with three rows, each with the cells Name, Age and City.",
    "Count from 1 to 30, separated by commas.",
]
FREE = [
    "Explain why the sky is blue.", "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?", "Describe how a bicycle works.",
    "Give me three tips for learning to cook.", "How do airplanes stay in the air?",
]


async def run_set(address, tokenizer, drafter, prompts, max_tokens, k):
    client = VerifierClient(address)
    rows = []
    try:
        for p in prompts:
            ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": p}]))
            rows.append(await generate(client, drafter, tokenizer, ids, max_tokens=max_tokens, draft_tokens=k,
                                        adaptive=False))
    finally:
        await client.close()
    drafted = sum(r.draft_tokens for r in rows)
    accepted = sum(r.accepted_tokens for r in rows)
    rounds = sum(r.rounds for r in rows)
    tokens = sum(len(r.token_ids) for r in rows)
    return {"acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
            "draft_tokens_per_round": drafted / rounds if rounds else 0.0,
            "tokens_per_s": tokens / sum(r.elapsed_s for r in rows)}


# With this model most tensors of a q2_k request fall back to q4_0 (576 columns is not a multiple of 256).
REQUANTIZED_NAMES = {"q2_k": "llama.cpp requantized (q2_k request; q4_0 fallback)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="K (default 4)")
    ap.add_argument("--onnx-model", help="ONNX draft to use (default: export the full model, int8, to a temp dir)")
    ap.add_argument("--requantized", default="q2_k", metavar="TYPES",
                    help="comma-separated quantizations the Q4_1 drafter is requantized to, one row each, e.g. "
                         "q2_k,q4_0,q8_0,iq4_nl: a weaker drafter (q2_k), or another format to draft in (default q2_k)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    if args.max_tokens < 1 or args.draft_tokens < 1:
        ap.error("--max-tokens and --draft-tokens must be at least 1")
    from scripts.requantize_gguf import TYPES, requantize

    kinds = [k for k in args.requantized.split(",") if k]
    if any(k not in TYPES for k in kinds):
        ap.error(f"--requantized: types must be among {', '.join(TYPES)}, got {args.requantized!r}")
    work = Path(tempfile.mkdtemp(prefix="sled-drafters-"))
    requantized = {REQUANTIZED_NAMES.get(k, f"llama.cpp requantized to {k}"):
                   requantize(None, work / f"smollm2-{k}.gguf", k) for k in kinds}
    onnx_model = args.onnx_model
    if not onnx_model:
        from scripts.export_onnx_draft import export

        onnx_model = str(export(None, work / "smollm2-int8.onnx", None, True))
    drafters = {
        "llama.cpp Q4_1": ("llama-cpp", DrafterOptions(threads=1)),
        **{name: ("llama-cpp", DrafterOptions(model_path=str(path), threads=1)) for name, path in requantized.items()},
        "ONNX Runtime, int8 weights": ("onnx", DrafterOptions(onnx_model=onnx_model, threads=1)),
        "Cacheback (LRU n-gram caches)": ("cacheback", DrafterOptions()),
        "prompt lookup (n-gram)": ("ngram", DrafterOptions()),
    }
    rows = []
    try:
        with ServerProcess("--max-sessions", "4", "--max-seq-len", "1024") as address:
            tokenizer = Tokenizer()
            for name, (kind, opts) in drafters.items():
                for label, prompts in (("repetitive", REPETITIVE), ("free", FREE)):
                    print(f"[bench] {name}, {label} text ...", end=" ", flush=True)
                    d = create_drafter(kind, opts)
                    try:
                        row = asyncio.run(run_set(address, tokenizer, d, prompts, args.max_tokens, args.draft_tokens))
                    finally:
                        d.close()
                    row.update(drafter=name, text=label)
                    rows.append(row)
                    print(f"acceptance {row['acceptance_rate']:.2f}, mean length {row['mean_acceptance_length']:.2f}",
                          flush=True)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    lines = ["| drafter | text | acceptance | mean accept. length | drafted / round | device tok/s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['text']} | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
                     f"| {r['draft_tokens_per_round']:.2f} | {r['tokens_per_s']:.1f} |")
    table = "\n".join(lines)
    print("\n" + table)
    section = (
        "## Drafters: acceptance on repetitive and free text\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()} (no GPU)\n"
        f"- command: `python scripts/bench_drafters.py {' '.join(sys.argv[1:])}`\n"
        f"- target: SmolLM2-135M-Instruct (float32, torch); greedy; K = {args.draft_tokens}; {args.max_tokens} tokens "
        f"per prompt; {len(REPETITIVE)} repetitive prompts (repeat, tables, counting, code) and {len(FREE)} free "
        "questions, chat template; one device, prompts one after another, one drafter instance per set\n"
        "- acceptance = accepted / drafted; mean acceptance length = 1 + accepted / rounds (vLLM); "
        "n-gram drafters propose nothing when they find no match, so their drafted / round is below K\n\n"
        + table + "\n"
    )
    publish(args.markdown, "## Drafters:", section, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
