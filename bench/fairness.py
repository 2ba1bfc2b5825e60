"""Fairness: prompts' time to first verdict (TTFT) and light devices' round times, each alone and beside the other,
side by side in one run.

For each prefill setting (the server's --prefill-chunk-tokens, or `auto` for its default rule), one server runs four
phases, alternated --repeats times:

- prompt alone: --ttft-prompts prompts of --ttft-tokens tokens, one after another, each timed from its Open to its
  first verdict;
- beside an idle session: the same with one more session open that was prefilled and then sends nothing;
- beside devices in rounds: --light devices send one round after another (an empty draft each: the server's token
  alone, the shortest round there is), first alone, then while the prompts are sent; each round is timed from its
  Draft to its Verdict;
- long prompts: one --prompt-tokens prompt alone (the server does nothing else: its prefill's ceiling in prompts a
  minute), then one light device beside --heavy devices that each open a session with such a prompt, take its first
  verdict, close it and start again, for --seconds: prompts served per minute.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone

import grpc

from sled.v1 import verify_pb2 as pb

MARKER = "## Fairness: prompts beside devices in rounds"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Client:
    """Sessions on one channel to the server, as a device opens them."""

    def __init__(self, channel, fingerprint: str):
        from sled.v1 import verify_pb2_grpc as pb_grpc

        self.stub, self.fingerprint = pb_grpc.VerifierStub(channel), fingerprint

    async def open(self, prompt: list[int], max_tokens: int):
        call = self.stub.Session()
        await call.write(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=self.fingerprint,
                                                       context_token_ids=prompt, max_tokens=max_tokens)))
        return call, (await call.read()).opened.session_id

    async def first_verdict(self, prompt: list[int]) -> float:
        """A prompt's time to first verdict: Open, an empty draft, its verdict; then close."""
        t0 = time.perf_counter()
        call, sid = await self.open(prompt, 1)
        await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid)))
        await call.read()
        took = time.perf_counter() - t0
        call.cancel()
        return took

    async def rounds(self, prompt: list[int], stop: asyncio.Event, times: list[float]) -> None:
        """Rounds of one light session, each timed from its Draft to its Verdict, until `stop`."""
        while not stop.is_set():
            call, sid = await self.open(prompt, 200)
            for round_ in range(200):
                t0 = time.perf_counter()
                await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid, round=round_)))
                verdict = (await call.read()).verdict
                times.append(time.perf_counter() - t0)
                if verdict.finished or stop.is_set():
                    break
            call.cancel()


def random_prompt(rng: random.Random, vocab: int, tokens: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(tokens)]


async def phases(address: str, args, tokenizer, rng: random.Random, log) -> dict[str, list[float]]:
    """Every phase's timings (seconds), --repeats passes of each."""
    short = tokenizer.encode("The best way to learn a language is")
    got: dict[str, list[float]] = {k: [] for k in ("alone", "idle", "beside", "rounds_alone", "rounds_beside",
                                                   "light_alone", "light_heavy", "heavy", "heavy_alone")}
    prompt = lambda n: random_prompt(rng, tokenizer.vocab_size, n)  # noqa: E731
    async with grpc.aio.insecure_channel(address) as channel:
        client = Client(channel, tokenizer.fingerprint)

        async def prompts(into: list[float]) -> None:
            for _ in range(args.ttft_prompts):
                into.append(await client.first_verdict(prompt(args.ttft_tokens)))

        async def beside_rounds(devices: int, alone: list[float], beside: list[float], load) -> None:
            stop = asyncio.Event()
            measured: list[float] = []
            jobs = [asyncio.ensure_future(client.rounds(short, stop, measured)) for _ in range(devices)]
            await asyncio.sleep(1.0)  # every device in its rounds
            measured.clear()
            await asyncio.sleep(args.seconds / 2)
            alone.extend(measured)
            measured.clear()
            await load()
            beside.extend(measured)
            stop.set()
            await asyncio.gather(*jobs)

        async def heavy_for(seconds: float) -> None:
            stop = asyncio.Event()

            async def one() -> None:
                while not stop.is_set():
                    took = await client.first_verdict(prompt(args.prompt_tokens))
                    if not stop.is_set():  # a prompt that ends after the phase is not counted in it
                        got["heavy"].append(took)

            jobs = [asyncio.ensure_future(one()) for _ in range(args.heavy)]
            await asyncio.sleep(seconds)
            stop.set()
            await asyncio.gather(*jobs)

        for repeat in range(args.repeats):
            await prompts(got["alone"])
            idle, _ = await client.open(short, 200)  # prefilled at once, then silent
            await asyncio.sleep(1.5)
            await prompts(got["idle"])
            idle.cancel()
            await beside_rounds(args.light, got["rounds_alone"], got["rounds_beside"],
                                lambda: prompts(got["beside"]))
            got["heavy_alone"].append(await client.first_verdict(prompt(args.prompt_tokens)))
            await beside_rounds(1, got["light_alone"], got["light_heavy"], lambda: heavy_for(args.seconds))
            log(f"[fairness]   pass {repeat + 1}/{args.repeats}: prompt alone {_median(got['alone']) * 1000:.0f} ms, "
                f"beside an idle session {_median(got['idle']) * 1000:.0f} ms, beside {args.light} devices "
                f"{_median(got['beside']) * 1000:.0f} ms; {len(got['heavy'])} long prompts so far")
    return got


def chunks_arg(text: str) -> list[int | None]:
    """Chunk sizes to compare: whole numbers, or `auto` for the server's default rule."""
    from bench.cli import counts_arg

    return [None if part == "auto" else counts_arg(part)[0] for part in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import positive

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=chunks_arg, default=[None],
                   help="the server's prefill_chunk_tokens to compare, `auto` for its default rule (sized by the "
                        "rounds waiting or due); default auto")
    p.add_argument("--ttft-tokens", type=positive(int), default=1000,
                   help="the timed prompts' length (default 1000)")
    p.add_argument("--ttft-prompts", type=positive(int), default=3, help="timed prompts a phase (default 3)")
    p.add_argument("--light", type=positive(int), default=4, help="devices in rounds beside the prompts (default 4)")
    p.add_argument("--heavy", type=positive(int), default=4, help="devices sending long prompts (default 4)")
    p.add_argument("--prompt-tokens", type=positive(int), default=2000, help="their prompts' length (default 2000)")
    p.add_argument("--seconds", type=positive(), default=40.0,
                   help="seconds of the long-prompt phase, and twice the light devices' rounds alone (default 40: a "
                        "prompt still under way at its end is not counted, so a short phase undercounts)")
    p.add_argument("--repeats", type=positive(int), default=2, help="passes of every phase (default 2)")
    p.add_argument("--target", help="target model (default: the SmolLM2 GGUF)")
    p.add_argument("--markdown", default="docs/benchmarks.md", help="where the section goes (default docs/benchmarks.md)")
    p.add_argument("--no-markdown", action="store_true", help="print the section only")
    return p


def summary(chunk: int | None, got: dict[str, list[float]], seconds: float) -> dict:
    ms = {k: [t * 1000 for t in v] for k, v in got.items()}
    alone = _median(ms["alone"])
    return {"chunk": chunk or "auto", "ttft_alone_ms": alone, "ttft_idle_ms": _median(ms["idle"]),
            "ttft_beside_ms": _median(ms["beside"]), "ttft_idle_ratio": _median(ms["idle"]) / alone,
            "ttft_beside_ratio": _median(ms["beside"]) / alone,
            "rounds_alone_median_ms": _median(ms["rounds_alone"]),
            "rounds_beside_median_ms": _median(ms["rounds_beside"]),
            "rounds_beside_p95_ms": _percentile(ms["rounds_beside"], 0.95),
            "rounds_ratio": _median(ms["rounds_beside"]) / _median(ms["rounds_alone"]),
            "long_prompts": len(ms["heavy"]), "long_prompts_per_minute": len(ms["heavy"]) / seconds * 60,
            "long_ttft_median_ms": _median(ms["heavy"]),
            "long_alone_ms": _median(ms["heavy_alone"]), "long_ceiling_per_minute": 60_000 / _median(ms["heavy_alone"]),
            "light_alone_median_ms": _median(ms["light_alone"]),
            "light_heavy_median_ms": _median(ms["light_heavy"]),
            "light_heavy_p95_ms": _percentile(ms["light_heavy"], 0.95),
            "light_ratio": _median(ms["light_heavy"]) / _median(ms["light_alone"])}


def section(args, rows: list[dict]) -> str:
    command = "sled-bench fairness " + shlex.join(sys.argv[2:])
    first = "\n".join(
        f"| {r['chunk']} | {r['ttft_alone_ms']:.0f} | {r['ttft_idle_ms']:.0f} ({r['ttft_idle_ratio']:.2f}x) | "
        f"{r['ttft_beside_ms']:.0f} ({r['ttft_beside_ratio']:.2f}x) | {r['rounds_alone_median_ms']:.1f} | "
        f"{r['rounds_beside_median_ms']:.1f} ({r['rounds_ratio']:.2f}x) | {r['rounds_beside_p95_ms']:.1f} |"
        for r in rows)
    long = "\n".join(
        f"| {r['chunk']} | {r['long_prompts']} | {r['long_prompts_per_minute']:.1f} "
        f"({r['long_prompts_per_minute'] / r['long_ceiling_per_minute']:.2f} of {r['long_ceiling_per_minute']:.1f}) | "
        f"{r['long_ttft_median_ms']:.0f} | "
        f"{r['light_alone_median_ms']:.1f} | {r['light_heavy_median_ms']:.1f} ({r['light_ratio']:.2f}x) | "
        f"{r['light_heavy_p95_ms']:.1f} |" for r in rows)
    from bench.report import machine

    return (f"{MARKER}\n\n`{command}` on {machine()}, {datetime.now(timezone.utc):%Y-%m-%d}: "
            f"{args.repeats} passes of every phase, alternated; "
            f"{'the default target' if not args.target else args.target}. TTFT is a prompt's time from its Open to "
            "its first verdict; a round, a light device's time from its Draft (empty: the server's token alone) to "
            "its Verdict.\n\n"
            f"{args.ttft_tokens}-token prompts ({args.ttft_prompts} a phase) alone, beside an idle session (prefilled, "
            f"then silent) and beside {args.light} devices in rounds:\n\n"
            "| prefill chunk | TTFT alone, median ms | beside an idle session | beside devices in rounds | "
            "their round alone, median ms | beside the prompts | p95 |\n"
            "|---:|---:|---:|---:|---:|---:|---:|\n" + first + "\n\n"
            f"{args.heavy} devices sending {args.prompt_tokens}-token prompts for {args.seconds:g} s a pass beside "
            "one device in rounds; the ceiling is a minute over one such prompt's TTFT alone (the server prefilling "
            "nothing else):\n\n"
            "| prefill chunk | prompts served | prompts a minute (share of the ceiling) | TTFT, median ms | "
            "light round alone, median ms | beside the prompts | p95 |\n"
            "|---:|---:|---:|---:|---:|---:|---:|\n" + long + "\n\n"
            "`auto` is the server's rule (docs/architecture.md, \"Prefill\"): a step's prompt chunk is bounded by "
            "its target time only while drafts are waiting or due; a number is a fixed chunk in its place.\n")


def main(args) -> int:
    from sim.processes import ServerProcess
    from bench.report import publish
    from bench.tokenizers import device_tokenizer

    tokenizer = device_tokenizer()
    rng = random.Random(0)
    rows = []
    longest = max(args.ttft_tokens, args.prompt_tokens)
    for chunk in args.chunks:
        flags = ["--max-sessions", str(args.heavy + args.light + 4), "--max-seq-len", str(longest + 64),
                 "--fused-max-tokens", "64", *(["--prefill-chunk-tokens", str(chunk)] if chunk else []),
                 *(["--target", args.target] if args.target else [])]
        print(f"[fairness] prefill_chunk_tokens {chunk or 'auto'}", flush=True)
        with ServerProcess(*flags) as address:
            got = asyncio.run(phases(address, args, tokenizer, rng, lambda m: print(m, flush=True)))
        rows.append(summary(chunk, got, args.seconds * args.repeats))
    text = section(args, rows)
    print(text)
    if not args.no_markdown:
        publish(args.markdown, MARKER, text, None, rows)
    return 0
