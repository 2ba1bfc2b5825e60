"""Fairness: a light device's round time alone and beside devices that send long prompts, side by side in one run.

For each prefill chunk size (the server's --prefill-chunk-tokens; 512, the whole step budget, prefills a prompt as
fast as the steps allow and makes the others wait, as the server did before chunking), one server runs phases in
turn: the light device alone, then the light device beside --heavy devices that each open a session with a
--prompt-tokens prompt, take its first verdict, close it and start again. The light device sends one round after
another (an empty draft: the server's token alone, the shortest round there is) and times each from its Draft to its
Verdict. Reported per chunk size: the light device's median and p95 round alone and beside the prompts, their ratio,
and the heavy devices' median time from Open to their first verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from datetime import datetime, timezone

import grpc

from sled.v1 import verify_pb2 as pb

MARKER = "## Fairness: a light device beside long prompts"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def light_rounds(address: str, fingerprint: str, prompt: list[int], stop: asyncio.Event, times: list[float]):
    """Rounds of one light session, each timed from its Draft to its Verdict, until `stop`."""
    from sled.v1 import verify_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        while not stop.is_set():
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=prompt,
                                                           max_tokens=200)))
            sid = (await call.read()).opened.session_id
            for round_ in range(200):
                t0 = time.perf_counter()
                await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid, round=round_)))
                verdict = (await call.read()).verdict
                times.append(time.perf_counter() - t0)
                if verdict.finished or stop.is_set():
                    break
            call.cancel()


async def heavy_prompts(address: str, fingerprint: str, vocab: int, tokens: int, stop: asyncio.Event,
                        firsts: list[float], rng: random.Random):
    """Long prompts one after another: Open, the first verdict, close."""
    from sled.v1 import verify_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        while not stop.is_set():
            prompt = [rng.randrange(1, vocab) for _ in range(tokens)]
            t0 = time.perf_counter()
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=prompt,
                                                           max_tokens=1)))
            sid = (await call.read()).opened.session_id
            await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid)))
            await call.read()
            firsts.append(time.perf_counter() - t0)
            call.cancel()


async def phases(address: str, args, tokenizer, rng: random.Random, log) -> dict:
    """The light device alone and with the heavy devices, alternated --repeats times."""
    prompt = tokenizer.encode("The best way to learn a language is")
    alone, beside, firsts = [], [], []
    for repeat in range(args.repeats):
        for heavy in (False, True):
            stop = asyncio.Event()
            times = beside if heavy else alone
            jobs = [asyncio.ensure_future(light_rounds(address, tokenizer.fingerprint, prompt, stop, times))]
            if heavy:
                jobs += [asyncio.ensure_future(heavy_prompts(address, tokenizer.fingerprint, tokenizer.vocab_size,
                                                             args.prompt_tokens, stop, firsts,
                                                             random.Random(rng.random())))
                         for _ in range(args.heavy)]
            await asyncio.sleep(args.seconds)
            stop.set()
            await asyncio.gather(*jobs)
            log(f"[fairness]   pass {repeat + 1}/{args.repeats} {'beside prompts' if heavy else 'alone'}: "
                f"{len(times)} rounds so far")
    return {"alone": alone, "beside": beside, "firsts": firsts}


def chunks_arg(text: str) -> list[int | None]:
    """Chunk sizes to compare: whole numbers, or `auto` for the server's default (sized from its step costs)."""
    from bench.cli import counts_arg

    return [None if part == "auto" else counts_arg(part)[0] for part in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import positive

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=chunks_arg, default=[512, None],
                   help="the server's prefill_chunk_tokens to compare, `auto` for its default (sized from its step "
                        "costs); default 512,auto: unchunked, and the default")
    p.add_argument("--heavy", type=positive(int), default=4, help="devices sending long prompts (default 4)")
    p.add_argument("--prompt-tokens", type=positive(int), default=2000, help="their prompts' length (default 2000)")
    p.add_argument("--seconds", type=positive(), default=15.0, help="seconds a phase (default 15)")
    p.add_argument("--repeats", type=positive(int), default=2, help="passes of both phases (default 2)")
    p.add_argument("--target", help="target model (default: the SmolLM2 GGUF)")
    p.add_argument("--markdown", default="docs/benchmarks.md", help="where the section goes (default docs/benchmarks.md)")
    p.add_argument("--no-markdown", action="store_true", help="print the section only")
    return p


def main(args) -> int:
    import sys

    from bench.processes import ServerProcess
    from bench.report import machine, publish
    from bench.tokenizers import device_tokenizer

    tokenizer = device_tokenizer()
    rng = random.Random(0)
    rows = []
    for chunk in args.chunks:
        flags = ["--max-sessions", str(args.heavy + 4), "--max-seq-len", str(args.prompt_tokens + 64),
                 "--fused-max-tokens", "64", *(["--prefill-chunk-tokens", str(chunk)] if chunk else []),
                 *(["--target", args.target] if args.target else [])]
        print(f"[fairness] prefill_chunk_tokens {chunk or 'auto'}", flush=True)
        with ServerProcess(*flags) as address:
            got = asyncio.run(phases(address, args, tokenizer, rng, lambda m: print(m, flush=True)))
        ms = {k: [t * 1000 for t in v] for k, v in got.items()}
        rows.append({"chunk": chunk or "auto", "alone_median_ms": statistics.median(ms["alone"]),
                     "alone_p95_ms": _percentile(ms["alone"], 0.95),
                     "beside_median_ms": statistics.median(ms["beside"]),
                     "beside_p95_ms": _percentile(ms["beside"], 0.95),
                     "first_verdict_median_ms": statistics.median(ms["firsts"]) if ms["firsts"] else float("nan"),
                     "prompts": len(ms["firsts"]), "rounds": len(ms["beside"])})
    table = "\n".join(
        f"| {r['chunk']} | {r['alone_median_ms']:.1f} | {r['alone_p95_ms']:.1f} | {r['beside_median_ms']:.1f} | "
        f"{r['beside_p95_ms']:.1f} | {r['beside_median_ms'] / r['alone_median_ms']:.2f}x | "
        f"{r['first_verdict_median_ms']:.0f} | {r['prompts']} |" for r in rows)
    command = "sled-bench fairness " + " ".join(sys.argv[2:])
    text = (f"{MARKER}\n\n`{command}` on {machine()}, {datetime.now(timezone.utc):%Y-%m-%d}: one light device's "
            f"rounds (an empty draft each) alone and beside {args.heavy} devices sending {args.prompt_tokens}-token "
            f"prompts, {args.repeats} passes of {args.seconds:g} s each, alternated; the default target.\n\n"
            "| prefill chunk (tokens) | light round alone, median ms | p95 | beside prompts, median ms | p95 | "
            "median beside / alone | a prompt's first verdict, median ms | prompts served |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|\n" + table + "\n\n"
            "A chunk of 512 (the whole step budget) prefills as the server did before prompts were chunked; `auto` "
            "is the server's default, as many prompt tokens a step as add about half its fixed cost.\n")
    print(text)
    if not args.no_markdown:
        publish(args.markdown, MARKER, text, None, rows)
    return 0
