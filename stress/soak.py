"""Soak: many devices for a while against one server that is killed, drained, restarted and sent garbage.

Devices generate greedily, one request after another, each through the device's own round loop
(edge_client.generation) with a cheap drafter (n-gram, none, or an oracle that proposes the target's text with
random tokens wrong), so the server's verification, rollback and reopen paths all run. Some requests are cancelled
at a random point. Every few seconds the server is killed (SIGKILL) or drained (SIGTERM) and started again; the
devices wait for it and reopen with their whole context. Meanwhile a sender keeps sending malformed traffic.

Reported: sessions served, tokens committed, tokens lost (every finished text must equal the target's own greedy
text, computed apart with transformers; a cancelled one must be a prefix of it), calls that ended INTERNAL or
UNKNOWN, KV slots leaked once the devices stop, and each server process's memory growth over its life.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import grpc

from sled.v1 import verify_pb2 as pb

MARKER = "## Soak: devices, kills, restarts and malformed traffic"
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at", "List three fruits: apple,", "The quick brown fox",
    "In machine learning, overfitting means", "1, 2, 3, 4, 5,", "The best way to learn a language is",
    "Photosynthesis is the process by which", "SELECT name FROM users WHERE", "Here is a recipe for pancakes:",
    "The largest planet in the solar system is", "Monday, Tuesday, Wednesday,", "The history of the Roman Empire",
]


class OracleDrafter:
    """Proposes the target's own greedy continuation with each token replaced by a random one at `noise`: drafts
    that are mostly accepted and sometimes rejected, at no drafting cost."""

    name = "oracle"

    def __init__(self, reference: dict[tuple, list[int]], vocab: int, noise: float, rng: random.Random):
        self.reference, self.vocab, self.noise, self.rng = reference, vocab, noise, rng
        self.prompt: tuple = ()

    def begin(self, context, sampling):
        self.prompt = next((p for p in self.reference if tuple(context[:len(p)]) == p), tuple(context))

    def propose(self, context, k, stop=None):
        from edge_client.drafters.base import Proposal

        full = list(self.prompt) + self.reference.get(self.prompt, [])
        if list(context) != full[:len(context)]:
            return Proposal([])
        tokens = full[len(context):len(context) + k]
        return Proposal([t if self.rng.random() > self.noise else self.rng.randrange(self.vocab) for t in tokens])

    def accept(self, context, ahead=()):
        pass

    def close(self):
        pass


def reference_texts(prompts: list[list[int]], max_tokens: int, target: str | None) -> dict[tuple, list[int]]:
    """Each prompt's greedy continuation by the target alone (transformers' generate), cut at EOS."""
    import torch

    from verify_server.model_loader import load_target

    model = load_target(target, torch.device("cpu"), torch.float32)
    eos = list(model.eos_token_ids)
    out = {}
    with torch.inference_mode():
        for ids in prompts:
            gen = model.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
            cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
            out[tuple(ids)] = gen[:cut]
    return out


@dataclass
class Tally:
    served: int = 0  # requests finished
    cancelled: int = 0
    tokens: int = 0
    lost: int = 0  # tokens of finished (or cancelled) requests that are not the target's
    wrong: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # requests that ended with an error
    malformed: int = 0
    bad_status: list = field(default_factory=list)  # malformed calls that ended INTERNAL or UNKNOWN
    reopens: int = 0
    seconds: float = 0.0  # the run's wall time, restarts included


async def device(index: int, address: str, tokenizer, reference, args, tally: Tally, stop: asyncio.Event,
                 rng: random.Random) -> None:
    from edge_client.drafters import create_drafter
    from edge_client.policy import DraftPolicy
    from edge_client.request import Request
    from edge_client.resilience import Resilience
    from edge_client.transport import VerifyError

    from bench.runner import Job, Runner

    kind = ("oracle", "ngram", "none", "oracle")[index % 4]
    drafter = (OracleDrafter(reference, tokenizer.vocab_size, args.noise, rng) if kind == "oracle"
               else create_drafter(kind))
    resilience = Resilience(fallback="wait", wait_deadline_s=args.wait_deadline, round_timeout_s=10.0)
    runner = Runner(address, tokenizer, own_connection=True, resilience=resilience)
    prompts = list(reference)
    try:
        while not stop.is_set():
            prompt = list(rng.choice(prompts))
            want = reference[tuple(prompt)]
            request = Request(prompt, max_tokens=args.max_tokens,
                              policy=DraftPolicy(draft_tokens=4, adaptive=index % 2 == 0), client_id=f"soak-{index}")
            job = asyncio.ensure_future(runner.generate(Job(drafter, request)))
            cancel = rng.random() < args.cancel_share
            try:
                if cancel:
                    done, _ = await asyncio.wait({job}, timeout=rng.uniform(0.05, 1.5))
                    if not done:
                        job.cancel()
                        tally.cancelled += 1
                        await asyncio.gather(job, return_exceptions=True)
                        continue
                result = await job
            except VerifyError as err:
                tally.failed.append(f"device {index}: {err}")
                continue
            tally.served += 1
            tally.reopens += result.reconnects
            tally.tokens += len(result.token_ids)
            if result.token_ids != want[:len(result.token_ids)] or (result.finish_reason != "stop"
                                                                   and len(result.token_ids) < len(want)):
                tally.lost += len(result.token_ids)
                tally.wrong.append((index, kind, tokenizer.decode(prompt)))
    finally:
        await runner.close(drain_timeout=2.0)
        drafter.close()


async def malformed(address: str, fingerprint: str, tally: Tally, stop: asyncio.Event, rng: random.Random,
                    per_second: float) -> None:
    """Garbage, broken Opens, oversized messages and abandoned streams, one after another."""
    def sends():
        yield b"\x12\xff\xff\xff\xff\x0f"
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        yield pb.ClientMessage(open=pb.Open(tokenizer_fingerprint="sha256:nope", context_token_ids=[1, 2],
                                            max_tokens=4)).SerializeToString()
        yield pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=[70000],
                                            max_tokens=4)).SerializeToString()
        yield pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=[1] * 200_000,
                                            max_tokens=4)).SerializeToString()
        yield pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=[1, 2, 3],
                                            max_tokens=4, sampling=pb.SamplingParams(temperature=float("nan")))
                               ).SerializeToString()
        yield pb.ClientMessage(draft=pb.Draft(session_id="nobody", token_ids=[1])).SerializeToString()
        yield pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint, context_token_ids=[1, 2, 3],
                                            max_tokens=4)).SerializeToString()  # then cancelled unread

    while not stop.is_set():
        for data in sends():
            if stop.is_set():
                return
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    call = channel.stream_stream("/sled.v1.Verifier/Session", request_serializer=lambda b: b,
                                                 response_deserializer=pb.ServerMessage.FromString)()
                    await call.write(data)
                    if rng.random() < 0.3:
                        call.cancel()
                    else:
                        await asyncio.wait_for(call.read(), 10)
                        call.cancel()
                    code = await call.code()
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
                code = None
            tally.malformed += 1
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and \
                    "Internal error from Core" not in (await call.details() or ""):
                tally.bad_status.append((code.name, data[:40]))
            await asyncio.sleep(rng.expovariate(per_second))


class Server:
    """The server process and its memory, life by life."""

    def __init__(self, flags: list[str]):
        from sim.processes import ServerProcess

        self.proc = ServerProcess(*flags)
        self.lives: list[dict] = []  # per start: RSS after start, at its end, seconds alive, how it ended

    def rss(self) -> int:
        import psutil

        try:
            return psutil.Process(self.proc.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def start(self) -> str:
        address = self.proc.start()
        self.lives.append({"rss_start": self.rss(), "started": time.monotonic()})
        return address

    def end(self, how: str) -> None:
        life = self.lives[-1]
        life.update(rss_end=self.rss(), seconds=time.monotonic() - life["started"], ended=how)
        if how == "SIGKILL":
            self.proc.proc.send_signal(signal.SIGKILL)
            self.proc.proc.wait()
        else:
            self.proc.stop()


async def free_slots(address: str, max_sessions: int, within_s: float) -> tuple[int, int]:
    from stress.fuzz import Server as Facts
    from stress.fuzz import free_slots as wait_free

    return await wait_free(Facts(address, "", 0, 0, 0, max_sessions), within_s)


def _say(message: str) -> None:
    print(message, flush=True)


async def soak(args, tokenizer, reference, server: Server, address: str, log=_say) -> tuple[Tally, tuple[int, int]]:
    rng = random.Random(args.seed)
    tally = Tally()
    stop = asyncio.Event()
    devices = [asyncio.ensure_future(device(i, address, tokenizer, reference, args, tally, stop,
                                            random.Random(rng.random())))
               for i in range(args.devices)]
    garbage = asyncio.ensure_future(malformed(address, tokenizer.fingerprint, tally, stop, random.Random(rng.random()),
                                              args.malformed_per_s))
    t0 = time.monotonic()
    next_chaos = t0 + args.kill_every
    kills = 0
    while time.monotonic() - t0 < args.seconds:
        await asyncio.sleep(min(5.0, max(0.0, next_chaos - time.monotonic()), args.seconds))
        if time.monotonic() >= next_chaos and time.monotonic() - t0 < args.seconds - args.kill_every / 2:
            how = "SIGKILL" if kills % 2 == 0 else "SIGTERM"
            kills += 1
            log(f"[soak] {time.monotonic() - t0:.0f}s: {how} to the server, restarting it in {args.down_s:g}s")
            await asyncio.to_thread(server.end, how)
            await asyncio.sleep(args.down_s)
            await asyncio.to_thread(server.start)
            next_chaos = time.monotonic() + args.kill_every
        log(f"[soak] {time.monotonic() - t0:.0f}s/{args.seconds:g}s: {tally.served} requests served, "
            f"{tally.cancelled} cancelled, {tally.tokens} tokens, {tally.lost} lost, {tally.malformed} malformed "
            f"calls, {kills} kills")
    stop.set()
    log("[soak] stopping: devices finish the request they are on")
    await asyncio.gather(garbage, *devices, return_exceptions=True)
    tally.seconds = time.monotonic() - t0
    slots = await free_slots(address, args.max_sessions, within_s=30.0)
    return tally, slots


def section(args, tally: Tally, slots: tuple[int, int], lives: list[dict], machine: str, command: str) -> str:
    mib = 2 ** 20
    growth = [(life["rss_end"] - life["rss_start"]) / mib for life in lives if "rss_end" in life]
    longest = max((life for life in lives if "rss_end" in life), key=lambda life: life["seconds"])
    rows = [
        ("requests served (finished)", tally.served),
        ("requests cancelled mid-way", tally.cancelled),
        ("tokens committed", tally.tokens),
        ("tokens lost (finished texts not the target's greedy text)", tally.lost),
        ("requests that failed with an error", len(tally.failed)),
        ("reopens after a lost server", tally.reopens),
        ("malformed calls sent", tally.malformed),
        ("malformed calls answered INTERNAL or UNKNOWN", len(tally.bad_status)),
        ("server lives (kills and drains + 1)", len(lives)),
        ("KV slots leaked after the run", args.max_sessions - slots[1]),
        ("RSS growth over the longest life (MiB)",
         f"{(longest['rss_end'] - longest['rss_start']) / mib:+.1f} in {longest['seconds']:.0f} s "
         f"({longest['rss_start'] / mib:.0f} to {longest['rss_end'] / mib:.0f})"),
        ("RSS growth per life, median (MiB)", f"{statistics.median(growth):+.1f}"),
    ]
    table = "\n".join(f"| {what} | {value} |" for what, value in rows)
    return (
        f"{MARKER}\n\n`{command}` on {machine}, {datetime.now(timezone.utc):%Y-%m-%d}: {args.devices} devices "
        f"for {tally.seconds:.0f} s ({args.seconds:g} s asked; restarts take longer) against the default target "
        f"(SmolLM2-135M-Instruct), {args.max_tokens} tokens a request, a kill or drain every {args.kill_every:g} s (down {args.down_s:g} s), "
        f"{args.cancel_share:.0%} of requests cancelled, ~{args.malformed_per_s:g} malformed calls a second.\n\n"
        f"| what | figure |\n|---|---:|\n{table}\n\n"
        "Tokens lost counts every token of a finished text that differs from the target's greedy text "
        "(transformers' generate on the same weights); KV slots leaked is the server's slots less those free "
        "once the devices stop.\n"
    )


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import positive

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=positive(), default=120.0, help="how long to soak (default 120)")
    p.add_argument("--devices", type=positive(int), default=64, help="concurrent devices (default 64)")
    p.add_argument("--max-tokens", type=positive(int), default=32, help="tokens a request (default 32)")
    p.add_argument("--kill-every", type=positive(), default=30.0, metavar="S",
                   help="kill (SIGKILL) or drain (SIGTERM), in turn, the server this often (default 30)")
    p.add_argument("--down-s", type=float, default=2.0, help="seconds the server stays down (default 2)")
    p.add_argument("--cancel-share", type=float, default=0.1, help="share of requests cancelled (default 0.1)")
    p.add_argument("--noise", type=float, default=0.15,
                   help="share of the oracle drafter's tokens replaced by random ones (default 0.15)")
    p.add_argument("--malformed-per-s", type=positive(), default=5.0, help="malformed calls a second (default 5)")
    p.add_argument("--wait-deadline", type=positive(), default=300.0, help="devices' wait for the server (default 300)")
    p.add_argument("--max-sessions", type=positive(int), default=96, help="the server's KV slots (default 96)")
    p.add_argument("--target", help="target model (default: the SmolLM2 GGUF)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run's random choices (default 0)")
    p.add_argument(
        "--markdown", default="docs/benchmarks.md", help="where the section goes (default docs/benchmarks.md)"
    )
    p.add_argument("--no-markdown", action="store_true", help="print the section only")
    return p


def main(args) -> int:
    import sys

    from bench.report import machine, publish
    from bench.tokenizers import device_tokenizer

    tokenizer = device_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    print(f"[soak] the target's greedy texts for {len(prompts)} prompts (transformers)", flush=True)
    reference = reference_texts(prompts, args.max_tokens, args.target)
    flags = ["--max-sessions", str(args.max_sessions), "--max-seq-len", "256", "--idle-timeout-s", "60",
             "--fused-max-tokens", "64", *(["--target", args.target] if args.target else [])]
    server = Server(flags)
    address = server.start()
    try:
        tally, slots = asyncio.run(soak(args, tokenizer, reference, server, address))
    finally:
        server.end("SIGTERM")
    text = section(args, tally, slots, server.lives, machine(), "sled-bench soak " + " ".join(sys.argv[2:]))
    print(text)
    for what in tally.wrong[:5] + tally.failed[:5] + tally.bad_status[:5]:
        print(f"[soak] {what}")
    if not args.no_markdown:
        publish(args.markdown, MARKER, text, None, [])
    ok = tally.lost == 0 and not tally.bad_status and slots == (0, args.max_sessions) and not tally.failed
    print(f"[soak] {'PASS' if ok else 'FAIL'}: {tally.lost} tokens lost, {len(tally.failed)} failed requests, "
          f"{len(tally.bad_status)} INTERNAL/UNKNOWN, {args.max_sessions - slots[1]} slots leaked")
    return 0 if ok else 1
