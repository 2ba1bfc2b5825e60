"""System benchmark: SLED vs server-only vs device-only across device counts, capacity under an SLO.

    python scripts/bench_system.py --devices 1,4,16,32 --slo-ms 150 --json runs/bench_system.json

1. Record: for each prompt, the target's greedy output (through SLED) and, at every prefix of it,
   the real drafter's greedy proposal of up to 8 tokens (llama.cpp Q4_1); and one drafter's time per
   token when it runs alone on this machine before the server starts (a device has its own hardware: the
   drafter uses this machine's cores, --device-threads; the median of three runs), and its prefill time per
   prompt token, from each request's first token as it goes through the prompts in turn (its KV cache keeps the
   system prompt they share, so a request prefills only the rest).
2. Replay: devices propose exactly what the real drafter proposes at their context (contexts are
   prefixes of the fixed greedy output), sleeping for the drafting time instead of computing (and for the
   prompt's prefill before a request's first token), so the server's capacity is measured apart from drafting:
   on one 2-core machine, drafters and server would otherwise share the cores. Any K, fixed or adaptive, replays
   the same drafter.
   Modes: `sled` (replayed drafts), `server-only` (the same server decodes every token, batched, and streams it:
   no round trip between tokens),
   `device-only` (the drafter alone, unverified: each device is its own hardware, so N devices give
   N times one device's measured rate over requests of --max-tokens, each prompt's prefill included).
3. `sled` rows use the adaptive draft length and drafting ahead (the defaults); fixed K = 2, 4, 8 run beside it,
   and so does the adaptive K without drafting ahead (`sled-no-ahead` in the JSON: each device waits for its
   verdict before drafting on), and with a device that finishes the token it drafts ahead before answering a
   verdict, drafting the rest of K first (`sled-finish-first`: the device before commit d1c17cb, which answers
   at once with what it drafted ahead, unless the server queues its drafts), and with a device that drafts K
   afresh after every miss (`sled-afresh-after-miss`, where the default answers a miss with an empty draft from an acceptance of 0.8:
   edge_client.generation.EMPTY_AFTER_MISS). Each device drafts on its own thread, as on its own hardware.
4. Non-model time per step at 16 sessions (the batch-1 step against the bandwidth limit: bench_engine.py).
5. The server's steps alone, before and after the runs: a few sessions' drafts of together 1 token up to the most
   the devices can send, in one step with nothing else running; and SLED / server-only if every step cost that
   (server-only at its steps' size, SLED at its best), an estimate beside the measured ratio. Then where each
   mode's steps under load part from those costs, from the verdicts of the rounds counted (each gives its step's
   tokens, time and sessions): the load (their time over what steps of their sizes cost alone) and the spread
   (what steps of their sizes cost alone over as many steps of their mean size).
6. How fast the devices answer each verdict with their next draft (from its arrival to the draft going out, and the
   part spent finishing a token being drafted ahead when it came), against the server's batching window: a draft
   that comes later than the window waits a step more.

GPU capacity runs (`--target random:llama-1b`): the target is a Llama of that shape with random weights, whose text
the real drafter cannot predict. Drafts are then synthesized from the target's own greedy output instead: each
drafted position carries the target's next token with probability `--draft-match` (else another token), so the
acceptance is controlled; `--device-ms-per-token` gives the drafting time. Where llama.cpp is not installed, the
devices' tokenizer is the same vocabulary read through transformers.

A GPU's step profile on this CPU (`--target random:llama-tiny --min-step-ms 14 --min-step-ms-per-token 0.1`): the
server pads every forward of a tiny random target to that floor (its `--min-step-ms` flags), so a step costs
nearly the same at any size, as on a GPU, and the devices' side of a GPU run (drafting ahead, the adaptive K, the
batching window) can be studied without one. An emulation, not a GPU: the section says so.

Over a network (`--link delay_ms=20,jitter_ms=5,rate_mbit=50`): each device reaches the server through its own
emulated link (scripts/linkemu.py's relay, a process of its own; one TCP connection a device), delay and jitter each
way, where it otherwise uses loopback. SLED then pays the round trip once a round, server-only once a request (its
Open): the server decodes and streams every token itself (Open.server_decodes), as any streaming server does. Before
that field, a server-only device asked each token with an empty draft and paid the round trip for every token, which
flattered SLED over a link. The section gets a heading of its own and says how much CPU the relay took.

Load: a closed loop. Each device sends requests back to back (device d starts at prompt d and takes the prompts
in turn) and the figures count what was committed in a window of --seconds that opens --warmup-s after the start,
or later, once every device has committed its first round (at many devices the first prompts' prefill, all opened
together, can outlast the warm-up), so every device is busy all through the window: system tokens/s is the sum of
the devices' rates at that load, not one request each over the time the slowest device took (which counted the
idle tail of devices done early).
Inter-token latency: a round that commits n tokens in t seconds gives each of them t / n.
Writes JSON rows, PNG plots (--out-dir) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import importlib.util
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_client import codec  # noqa: E402
from edge_client.adaptive import AdaptiveDraftLength  # noqa: E402
from edge_client.cli import describe_kernels  # noqa: E402
from edge_client.drafters import DrafterOptions, create_drafter  # noqa: E402
from edge_client.drafters.base import Proposal  # noqa: E402
from edge_client.drafters.kv_drafter import common_prefix  # noqa: E402
from edge_client.generation import EMPTY_AFTER_MISS, generate  # noqa: E402
from edge_client.sampling import SamplingParams  # noqa: E402
from edge_client.transport import VerifierClient, fetch_info  # noqa: E402
from edge_client.workload import QUESTIONS  # noqa: E402
from bench.cli import counts_arg  # noqa: E402
from bench.processes import ServerProcess  # noqa: E402
from bench.report import cpu_counters, gpu_name, machine, publish, stolen_share  # noqa: E402
from bench.tokenizers import device_tokenizer  # noqa: E402
from scripts.linkemu import LinkProcess, LinkSpec  # noqa: E402


class DraftClock:
    """The drafting time replayed drafters asked for and took (wall time, the wait to resume after each sleep
    included), over every drafter that shares it: what drafting speed the benchmark's devices reached."""

    def __init__(self):
        self._lock = threading.Lock()
        self.asked = self.took = 0.0
        self.tokens = 0
        # the prompts' prefill, apart from the tokens: what it asked (and was charged), over how many requests
        self.prefill_asked = 0.0
        self.prefills = 0

    def add(self, asked: float, took: float, tokens: int) -> None:
        with self._lock:
            self.asked, self.took, self.tokens = self.asked + asked, self.took + took, self.tokens + tokens

    def add_prefill(self, asked: float) -> None:
        with self._lock:
            self.prefill_asked += asked
            self.prefills += 1

    def ms_per_token(self) -> float:
        """The tokens' drafting time a token. Every overrun counts here (the prefill is charged only what it asked),
        and an overrun carried to a later sleep only pays itself back, so this is never under the rate asked."""
        return self.took / self.tokens * 1000 if self.tokens else float("nan")

    def prefill_share(self) -> float:
        """The share of the drafters' time spent prefilling prompts; nan before any drafting."""
        total = self.took + self.prefill_asked
        return self.prefill_asked / total if total else float("nan")


class ReplayDrafter:
    """Proposes what a real drafter proposed at the same context, after its measured drafting time.

    A context off the recorded output (a drafted token the target rejects came before) gets filler tokens,
    after the same time: a real drafter's tokens there are never accepted either, since verification stops
    at the first rejected token, so only the time they take matters. With the drafter's recorded confidence in
    each token, the adaptive controller's stop rule ends a draft where the real drafter would have."""

    name = "replay"

    def __init__(self, rounds: dict[int, list[int]], seconds_per_token: float, full: list[int] | None = None,
                 confidence: dict[int, list[float]] | None = None, clock: DraftClock | None = None,
                 prefill_s: float = 0.0):
        self.rounds, self.spt, self.prefixes, self.confidence = rounds, seconds_per_token, full, confidence
        self.clock = clock
        self.owed = 0.0  # what earlier sleeps overran, taken off the next ones
        # The prompt's prefill, spent before the first token: a real drafter feeds the prompt's tokens past what its
        # KV cache kept from the device's last request (the shared system prompt) at its first propose.
        self.prefill_s = prefill_s

    def begin(self, context, sampling):
        pass

    def propose(self, context, k, stop=None):
        tokens, sure = self.rounds.get(len(context)), None
        if tokens is None or (self.prefixes is not None and list(context) != self.prefixes[:len(context)]):
            tokens = [context[-1] ^ 1] * k  # off the recording: filler, never the last token (a random target repeats it)
        elif self.confidence is not None:
            sure = self.confidence[len(context)]
        tokens = tokens[:k]
        drafted = len(tokens)
        if sure is not None and stop is not None:
            n = drafted = 0
            while n < len(tokens):
                drafted += 1  # a token is drafted before its confidence is known
                if not stop.take(sure[n]):
                    break
                n += 1
                if not stop.more():
                    break
            tokens = tokens[:n]
        self._spend(drafted)
        return Proposal(list(tokens), confidence=None if sure is None else list(sure[:len(tokens)]))

    def _spend(self, drafted: int) -> None:
        """Sleep the drafting time of `drafted` tokens, less what this drafter's earlier sleeps overran. The
        benchmark runs every device in one process, and a sleep ends only when its thread has the GIL back: with 32
        devices on the H100 machine the devices drafted about a quarter slower than asked (a probe, not in the repo;
        its figures are in commit fd13708's message), which a real device, drafting on its own cores, does not. Carried over, the overrun leaves the average at the rate asked
        while it stays under a token's time (the section reports the rate reached)."""
        prefill, self.prefill_s = self.prefill_s, 0.0  # the prompt's, before the first token only
        asked = self.spt * drafted + prefill
        t0 = time.perf_counter()
        if asked - self.owed > 0:
            time.sleep(asked - self.owed)
        took = time.perf_counter() - t0
        self.owed = max(0.0, self.owed + took - asked)
        if self.clock is not None:
            if prefill:
                # One sleep for both. The prefill is charged what it asked and the tokens the rest, overruns and the
                # carry that paid them off included: sharing out what the sleep took as asked let a carry from
                # token-only sleeps shorten the prefill's share, and the tokens' rate came out faster than asked
                # (9.98 ms for 10 asked, a CI run of 6b87e22).
                self.clock.add_prefill(prefill)
                took -= prefill
            self.clock.add(asked - prefill, took, drafted)

    def accept(self, context, ahead=()):
        pass

    def close(self):
        pass


K_MAX = 8
# The adaptive configurations' JSON modes: the default (`sled`), waiting for each verdict instead of drafting ahead,
# finishing the token being drafted ahead before answering a verdict (the device before commit d1c17cb), and drafting
# K afresh after every miss (the device before the empty draft after a miss).
VARIANTS = {"adaptive": "sled", "no-ahead": "sled-no-ahead", "finish-first": "sled-finish-first",
            "afresh-after-miss": "sled-afresh-after-miss"}


def record_tables(address, tokenizer, prompt_ids, max_tokens, model_path: str | None = None
                  ) -> tuple[list[dict[int, list[int]]], list[list[int]], list[dict[int, list[float]]]]:
    """Per prompt: context length -> the real drafter's greedy proposal of K_MAX tokens there; the greedy
    outputs (prompt included) they were recorded along; and context length -> the drafter's confidence in each
    token of its proposal."""
    drafter = create_drafter("llama-cpp", DrafterOptions(model_path=model_path, context_size=512))
    tables, confidences = [], []
    fulls = greedy_outputs(address, tokenizer, prompt_ids, max_tokens)
    for ids, full in zip(prompt_ids, fulls):
        drafter.begin(list(ids), SamplingParams())
        proposals = {n: drafter.propose(full[:n], K_MAX) for n in range(len(ids), len(full))}
        tables.append({n: p.token_ids for n, p in proposals.items()})
        confidences.append({n: p.confidence for n, p in proposals.items()})
    drafter.close()
    return tables, fulls, confidences


def match_rate(tables: list[dict[int, list[int]]], fulls: list[list[int]]) -> tuple[float, list[float]]:
    """How often a recorded draft's token is the target's greedy token, given that the draft's tokens before it
    were: overall and per draft position. This is the probability `--draft-match` synthesizes drafts with, so a GPU
    run with a random target replays the acceptance measured here with the real models."""
    hit, seen = np.zeros(K_MAX), np.zeros(K_MAX)
    for table, full in zip(tables, fulls):
        for n, draft in table.items():
            for i, tok in enumerate(draft[:len(full) - n]):
                seen[i] += 1
                if tok != full[n + i]:
                    break
                hit[i] += 1
    per = [float(h / s) if s else float("nan") for h, s in zip(hit, seen)]
    return float(hit.sum() / seen.sum()) if seen.sum() else float("nan"), per


def greedy_outputs(address, tokenizer, prompt_ids, max_tokens) -> list[list[int]]:
    """Per prompt: the prompt and the target's greedy output after it (the server decoding every token)."""
    async def once():
        client = VerifierClient(address)
        try:
            return await asyncio.gather(*[generate(client, create_drafter("none"), tokenizer, ids,
                                                   max_tokens=max_tokens, draft_tokens=0, adaptive=False)
                                          for ids in prompt_ids])
        finally:
            await client.close()

    return [list(ids) + run.token_ids for ids, run in zip(prompt_ids, asyncio.run(once()))]


def synthesize_tables(fulls: list[list[int]], prompt_lens: list[int], match: float, vocab_size: int,
                      seed: int = 0) -> list[dict[int, list[int]]]:
    """Per prompt: context length -> K_MAX drafted tokens, each the target's greedy next token with probability
    `match`, else a different token. Seeded, so every mode and K replays the same drafts."""
    rng = np.random.default_rng(seed)
    tables = []
    for full, start in zip(fulls, prompt_lens):
        table = {}
        for n in range(start, len(full)):
            draft = []
            for tok in full[n:n + K_MAX]:
                draft.append(tok if rng.random() < match else int((tok + 1 + rng.integers(vocab_size - 1)) % vocab_size))
            table[n] = draft
        tables.append(table)
    return tables


def prompts(tokenizer, n):
    return [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(n)]


def drafting_ms_alone(drafter, prompt: list[int], tokens: int, runs: int = 3) -> list[float]:
    """A drafter alone: ms per token of each of `runs` runs of `tokens` greedy tokens after `prompt` (the first run
    also prefills the prompt; the later ones find it in the drafter's KV cache)."""
    out = []
    for _ in range(runs):
        context = list(prompt)
        drafter.begin(context, SamplingParams())
        t1 = time.perf_counter()
        for _ in range(tokens):
            context += drafter.propose(context, 1).token_ids
        out.append((time.perf_counter() - t1) / tokens * 1000)
    return out


def prefill_tokens(prompt_ids: list[list[int]]) -> list[int]:
    """Per prompt: the tokens a device's drafter prefills for it when its last request was the prompt before it (the
    devices take the prompts in turn), past the first: the drafter's KV cache keeps the common prefix (the chat
    template's system prompt) and feeds the rest in one batch, whose last token's cost is that of a drafting step."""
    return [max(0, len(ids) - common_prefix(prompt_ids[i - 1], ids) - 1) for i, ids in enumerate(prompt_ids)]


def measure_prefill(drafter, prompt_ids: list[list[int]], seconds_per_token: float, passes: int = 2,
                    tokens: int = 8) -> tuple[float, list[float]]:
    """The real drafter's prefill time per prompt token (prefill_tokens), as a device meets it: requests of `tokens`
    tokens through the prompts in turn, `passes` times (the first pass uncounted: its first prompt finds a cache
    from elsewhere); each request's first token takes a drafting step plus the prefill. Returns the median over the
    counted requests, in seconds per token, and each one's ms."""
    counts, samples = prefill_tokens(prompt_ids), []
    for rep in range(passes):
        for ids, n in zip(prompt_ids, counts):
            context = list(ids)
            t0 = time.perf_counter()
            context += drafter.propose(context, 1).token_ids
            first = time.perf_counter() - t0
            for _ in range(tokens - 1):
                context += drafter.propose(context, 1).token_ids
            if rep and n:
                samples.append((first - seconds_per_token) / n)
    per = max(0.0, float(np.median(samples))) if samples else 0.0
    return per, [x * 1000 for x in samples]


def device_only_rate(seconds_per_token: float, prefill_s: list[float], max_tokens: int) -> float:
    """One device's drafter alone, in tokens/s over requests of max_tokens: their drafting steps and, per request,
    its prompt's prefill (the mean over the prompts, which the devices take in turn)."""
    return max_tokens / (max_tokens * seconds_per_token + (float(np.mean(prefill_s)) if prefill_s else 0.0))


class Timeline:
    """A device's drafter, noting when each round's tokens are committed (the drafter's accept) and when it drafted."""

    def __init__(self, drafter, on_commit=None):
        self.drafter, self.commits, self.on_commit = drafter, [], on_commit
        self.drafting: list[tuple[float, float]] = []  # when the drafter drafted: (start, end) of each propose call

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.drafter.propose(*args, **kwargs)
        finally:
            self.drafting.append((t0, time.perf_counter()))

    def accept(self, context, ahead=()):
        self.commits.append(time.perf_counter())
        if self.on_commit is not None:
            self.on_commit()
        self.drafter.accept(context, ahead)


@dataclass
class Window:
    """What N devices did inside the measured window: per device, its committed rounds as (time, tokens,
    seconds), and the request totals; the server's statistics at the window's two ends; when the window opened,
    in seconds from the start."""
    seconds: float
    rounds: list[list[tuple[float, int, float]]]
    results: list
    before: object
    after: object
    opened_s: float = 0.0
    stolen: float | None = None  # the share of the host's CPU time the hypervisor took during the window
    devices_cpu: float | None = None  # CPU time this process (the replayed devices, their gRPC) used in it, in cores
    link_cpu: float | None = None  # and the emulated links' relay process (--link), in cores
    # the server's steps that verified the rounds committed in it, as their verdicts said: (tokens, ms, sessions)
    steps: list[tuple[int, float, int]] = field(default_factory=list)
    # the devices' replies to the verdict before each of those rounds, as generate() timed them: (ms, ms of it
    # finishing the token being drafted ahead); nan for a session's first round
    replies: list[tuple[float, float]] = field(default_factory=list)
    # per device, when its drafter drafted (start, end) and when each of its requests ended (its final verdict), over
    # the whole run; with the window's start (perf_counter), for drafting_use
    drafting: list[tuple[list[tuple[float, float]], list[float]]] = field(default_factory=list)
    start: float = 0.0
    # per counted round, how long its draft waited at the server through earlier steps (ms, Verdict.queue_ms)
    queued: list[float] = field(default_factory=list)


# The window waits for every device's first commit, but not past this: a device the server starves is then
# counted as it is (it shows as a low per-device rate).
MAX_OPEN_WAIT_S = 120.0


def kernel_line(info) -> str:
    """The server's kernels as its Info gives them (as `sled-edge info` prints them), for the benchmark section."""
    above = " (unless set, timed against PyTorch at start-up), PyTorch above" if info.fused_max_tokens else ""
    return f"- server kernels: {describe_kernels(info)}{above}\n"


async def run_window(address, tokenizer, make_drafter, prompt_ids, n, max_tokens, k, warmup_s, seconds,
                     adaptive=False, draft_ahead=True, answer_at_once=True,
                     empty_after_miss=EMPTY_AFTER_MISS, link=None) -> Window:
    """N devices in a closed loop: each runs requests back to back (device d starts at prompt d and goes through
    them in turn) until the window ends; tokens count when they are committed inside the window of `seconds`.
    The window opens `warmup_s` after the start, or later, once every device has committed its first round: the
    first requests all open together, and at many devices their prompts' prefill can outlast the warm-up; a
    window that opened during it would count a start-up phase, not the steady load. A request in progress at the
    end stops at its next round.
    link: a running LinkProcess in front of the server (--link): each device then reaches the server through it over a
    TCP connection of its own, its own emulated link; the window's statistics are read directly."""
    # Devices draft in threads (asyncio.to_thread): one thread each, as each device is its own hardware (the
    # default pool, cores + 4 threads, would queue the drafting of 16 or 32 devices).
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=n + 4))
    client = VerifierClient(address)
    t0 = time.perf_counter()
    start = end = float("inf")  # set when the window opens
    first_commit = [False] * n  # written from the drafting threads; read by window()

    async def device(d):
        # per round committed inside the window, from each request: (time, tokens, seconds), the step that verified
        # it, the reply before it, its wait through earlier steps; and over the whole run, the drafting and the ends
        got = {"rounds": [], "steps": [], "replies": [], "queued": [], "results": [], "drafting": [], "ends": []}
        # The device's draft-length controller, kept across its requests as the agent keeps one per drafter.
        controller = AdaptiveDraftLength.for_device(K_MAX, draft_ahead) if adaptive else None
        own = VerifierClient(link.address, own_connection=True) if link else None
        try:
            j = 0
            while time.perf_counter() < end:
                p = (d + j) % len(prompt_ids)
                drafter = Timeline(make_drafter(p), on_commit=lambda: first_commit.__setitem__(d, True))
                r = await generate(own or client, drafter, tokenizer, prompt_ids[p], max_tokens=max_tokens,
                                   draft_tokens=k, adaptive=adaptive, draft_ahead=draft_ahead, max_draft_tokens=K_MAX,
                                   controller=controller, should_stop=lambda: time.perf_counter() >= end,
                                   answer_at_once=answer_at_once, empty_after_miss=empty_after_miss)
                inside = [start <= t < end for t in drafter.commits]
                for key, per_round in (("rounds", zip(drafter.commits, r.round_tokens, r.round_times)),
                                       ("steps", r.round_steps), ("replies", r.round_replies),
                                       ("queued", r.round_queue_ms)):
                    got[key] += [x for x, keep in zip(per_round, inside) if keep]
                got["results"].append(r)
                got["drafting"] += drafter.drafting
                if drafter.commits:  # its final verdict (one cut at the window's end comes after the window)
                    got["ends"].append(drafter.commits[-1])
                j += 1
        finally:
            if own:  # its own connection, also when a request failed
                await own.close()
        return got

    async def window():
        nonlocal start, end
        await asyncio.sleep(max(0.0, t0 + warmup_s - time.perf_counter()))
        while not all(first_commit) and time.perf_counter() - t0 < MAX_OPEN_WAIT_S:
            await asyncio.sleep(0.01)
        before = (await client.info()).stats
        ticks = cpu_counters()
        cpu = time.process_time()
        relay = link.cpu_seconds() if link else 0.0
        start = time.perf_counter()
        end = start + seconds
        await asyncio.sleep(seconds)
        used = time.process_time() - cpu
        relayed = (link.cpu_seconds() - relay) / seconds if link else None
        return (before, (await client.info()).stats, start - t0, stolen_share(ticks, cpu_counters()), used / seconds,
                relayed)

    try:
        done = await asyncio.gather(window(), *[device(d) for d in range(n)])
    finally:
        await client.close()
    before, after, opened_s, stolen, devices_cpu, link_cpu = done[0]
    devices = done[1:]

    def joined(key: str) -> list:
        return [x for dev in devices for x in dev[key]]

    return Window(seconds, [dev["rounds"] for dev in devices], joined("results"), before, after, opened_s, stolen,
                  devices_cpu, link_cpu, steps=joined("steps"), replies=joined("replies"),
                  drafting=[(dev["drafting"], dev["ends"]) for dev in devices], start=t0 + opened_s,
                  queued=joined("queued"))


def summarize(mode, n, w: Window):
    rounds = [x for dev in w.rounds for x in dev]
    itl = np.concatenate([np.repeat(t / max(tok, 1), tok) for _, tok, t in rounds]) if rounds else np.zeros(1)
    per_device = [sum(tok for _, tok, _ in dev) / w.seconds for dev in w.rounds]
    drafted = sum(r.draft_tokens for r in w.results)
    before, after = w.before, w.after
    steps = after.steps - before.steps
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    prefilled = after.prefill_tokens - before.prefill_tokens
    return {
        "mode": mode, "devices": n, "system_tokens_per_s": sum(per_device),
        "per_device_tokens_per_s": float(np.mean(per_device)),
        "p50_inter_token_ms": float(np.percentile(itl, 50) * 1000), "p95_inter_token_ms": float(np.percentile(itl, 95) * 1000),
        "acceptance_rate": sum(r.accepted_tokens for r in w.results) / drafted if drafted else 0.0,
        "mean_draft_tokens": drafted / max(sum(r.rounds for r in w.results), 1),
        "drafted_ahead_share": sum(r.ahead_tokens for r in w.results) / drafted if drafted else 0.0,
        "requests": len(w.results),
        "server_step_ms": (after.step_seconds_total - before.step_seconds_total) / steps * 1000 if steps else 0.0,
        "server_forward_ms": (after.forward_seconds_total - before.forward_seconds_total) / steps * 1000 if steps else 0.0,
        "server_batch_sessions": (after.verifications - before.verifications) / steps if steps else 0.0,
        "server_busy_share": (after.step_seconds_total - before.step_seconds_total) / w.seconds,
        # Tokens through the forward per step (prefill, and each verification's draft and the token before it), and
        # tokens committed per step: what step_cost_ratio prices at the steps' cost alone.
        "server_step_tokens": (prefilled + after.verifications - before.verifications + after.draft_tokens
                               - before.draft_tokens) / steps if steps else 0.0,
        "server_committed_per_step": (after.emitted_tokens - before.emitted_tokens) / steps if steps else 0.0,
        "window_opened_s": w.opened_s,
        "host_cpu_stolen_share": w.stolen,
        "devices_cpu_cores": w.devices_cpu,
        "link_cpu_cores": w.link_cpu,
        # None: no request started inside the window (a slow server-only run), so no prompt to count.
        "prompt_tokens_from_prefix_cache": hits / (hits + prefilled) if hits + prefilled else None,
        "server_step_sizes": step_sizes(w.steps),
        **drafting_figures(w),
        **reply_figures(w.replies),
        **queue_figures(w.queued),
    }


def drafting_use(intervals: list[tuple[float, float]], ends: list[float], start: float, end: float
                 ) -> tuple[float, float]:
    """One device's drafter inside the window [start, end): (the share of it spent drafting; the share it stood idle
    around the end of a request: in the gap between drafting that holds a request's final verdict, from the last
    token drafted before it to the first of the next request). The rest of the idle time falls inside requests.
    `intervals` are the drafter's (start, end) of each propose call, in any order, never overlapping (one drafter a
    device); `ends` the times of the requests' final verdicts."""
    length = end - start
    if length <= 0:
        return float("nan"), float("nan")

    def inside(a: float, b: float) -> float:
        return max(0.0, min(b, end) - max(a, start))

    spans = sorted(intervals)  # never overlapping, so their ends are in order too
    starts = [a for a, _ in spans]
    busy = sum(inside(a, b) for a, b in spans)
    gaps = set()  # a gap holding two requests' ends (a request that drafted nothing) counts once
    for f in ends:
        i = bisect.bisect_right(starts, f)  # spans[:i] began by f, spans[i:] after it
        gaps.add((spans[i - 1][1] if i else start, spans[i][0] if i < len(spans) else end))
    return busy / length, sum(inside(a, b) for a, b in gaps) / length


def drafting_figures(w: Window) -> dict:
    """The devices' drafting inside the window (drafting_use), averaged over the devices, as row fields; None where
    the window holds no drafting record."""
    if not w.drafting:
        return {"drafting_busy_share": None, "drafting_idle_at_request_ends_share": None}
    use = [drafting_use(spans, ends, w.start, w.start + w.seconds) for spans, ends in w.drafting]
    return {"drafting_busy_share": float(np.mean([u[0] for u in use])),
            "drafting_idle_at_request_ends_share": float(np.mean([u[1] for u in use]))}


def reply_figures(replies: list[tuple[float, float]]) -> dict:
    """The devices' replies to verdicts (Window.replies) as row fields: the median and 90th percentile of the time
    from a verdict's arrival to the next draft going out, and of the part spent finishing the token being drafted
    ahead when it came; None without replies (every counted round was a session's first)."""
    timed = np.array([x for x in replies if not np.isnan(x[0])], dtype=float).reshape(-1, 2)
    if not len(timed):
        return {"device_reply_ms": None, "device_reply_drafting_ms": None}
    return {"device_reply_ms": [float(np.percentile(timed[:, 0], q)) for q in (50, 90)],
            "device_reply_drafting_ms": [float(np.percentile(timed[:, 1], q)) for q in (50, 90)]}


def queue_figures(queued: list[float]) -> dict:
    """The counted rounds' waits at the server through earlier steps (Window.queued) as row fields: the share of
    drafts that arrived while another step ran and waited for it to end, and the median of those waits (ms; None
    where no draft waited, or no round was counted)."""
    if not queued:
        return {"queued_drafts_share": None, "queued_drafts_wait_ms": None}
    waited = [x for x in queued if x > 0]
    return {"queued_drafts_share": len(waited) / len(queued),
            "queued_drafts_wait_ms": float(np.median(waited)) if waited else None}


def step_sizes(steps: list[tuple[int, float, int]]) -> list[list[float]]:
    """The steps that verified a window's rounds, by size: [tokens, steps, mean ms] per step size, from each round's
    verdict (tokens, ms, sessions). A step of s sessions is reported to each of them, so each report counts 1 / s
    of a step (a step whose other sessions' rounds fell outside the window counts in part). Steps that only
    prefilled are not reported to any device and are not in it."""
    by: dict[int, list[float]] = {}
    for tokens, ms, sessions in steps:
        share = 1.0 / max(sessions, 1)
        entry = by.setdefault(int(tokens), [0.0, 0.0])
        entry[0] += share
        entry[1] += share * ms
    return [[n, w, total / w] for n, (w, total) in sorted(by.items())]


def load_and_spread(costs: dict[int, float], sizes: list[list[float]]) -> tuple[float, float, float]:
    """How a run's steps (step_sizes) compare with `costs` (step_costs_alone): (the load: their time over what steps
    of their sizes cost alone; the spread: what steps of their sizes cost alone over as many steps of their mean
    size; their mean size). A step costs nearly as much at a few tokens as at 10 (reading the weights), so steps of
    unequal sizes cost more than as many of their mean size. nan without steps."""
    weight = sum(w for _, w, _ in sizes)
    if not weight:
        return float("nan"), float("nan"), float("nan")
    took = sum(w * ms for _, w, ms in sizes)
    alone = sum(w * interpolate_cost(costs, n) for n, w, _ in sizes)
    mean = sum(w * n for n, w, _ in sizes) / weight
    return ratio(took, alone), ratio(alone, weight * interpolate_cost(costs, mean)), mean


def plot(rows, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in (("system_tokens_per_s", "system tokens/s"), ("p95_inter_token_ms", "p95 inter-token latency (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("sled", "server-only", "device-only"):
            pts = sorted((r["devices"], r[key]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"bench_system_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def ratio(x: float, y: float) -> float:
    """x / y, or nan when the denominator committed nothing (a starved run): the table shows it, nothing raises."""
    return x / y if y > 0 else float("nan")


def drafting_per_step(device_only_tok_s: float, devices: int, step_ms: float) -> float:
    """r·s: the tokens one device drafts alone (device_only_tok_s / devices a second) in a step of step_ms."""
    return device_only_tok_s / devices * step_ms / 1000.0


def drafting_bound(device_only_tok_s: float, mean_k: float, devices: int, step_ms: float) -> float:
    """The most tokens/s `devices` devices, each drafting at device_only_tok_s / devices alone, can commit with
    drafts of mean_k tokens when a verification step takes step_ms. Every committed token was drafted by its device,
    at one drafting step each, except at most one a round: the correction after a rejected token, or the bonus after
    a wholly accepted draft whose next token the device had not drafted ahead. That token comes with the verdict,
    after a round trip that holds the draft's step, and the device spends that time waiting or drafting ahead what
    the verdict throws away (had the ahead draft stood, its first token was the bonus, drafted and not free). So
    the free token costs at least a step of the device's time and gains only where a step is shorter than drafting
    one token: a device commits at most rate x (1 + max(0, 1 - rate x step) / K). Where the step is the longer (a
    CPU target no larger than the drafter), the drafters' own rate, device-only, is the bound; with step_ms 0, the
    plain count (a round commits at most its drafted tokens + 1). nan when no draft was made (a starved run)."""
    free = max(0.0, 1.0 - drafting_per_step(device_only_tok_s, devices, step_ms))
    return device_only_tok_s * (1 + free * ratio(1, mean_k))


def server_rate(row: dict) -> float:
    """Tokens a run committed per second of server step time (tok/s over the share of the window the server spent
    in steps): what it would commit with the server never idle, at the steps it ran. nan for a server never busy."""
    return ratio(row["system_tokens_per_s"], row["server_busy_share"])


def step_costs_alone(address, tokenizer, prompt_ids, max_sessions: int, repeats: int = 7,
                     sizes=(1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128, 192, 256)
                     ) -> dict[int, float]:
    """The server's step time (ms, median of `repeats`) at each of `sizes` tokens with nothing else running: a
    few sessions verify drafts of together that many tokens (a draft of d tokens puts d + 1 through the forward),
    concurrently, so that they share one step; each verdict says how many tokens its step had and how long it
    took, and a step that came out of another size counts for the size it had. Sizes past what `max_sessions`
    sessions can send in one step are skipped, and that most is timed too, so that the sizes cover every step
    the devices' drafts can fill (step_cost_ratio takes the least cost per token among them)."""
    per = K_MAX + 1  # the most tokens one session puts in a step
    sizes = sorted({n for n in sizes if n < max_sessions * per} | {max_sessions * per})
    width = -(-max(sizes) // per)

    async def measure():
        client = VerifierClient(address)
        room = (await client.info()).context_limit - max(len(i) for i in prompt_ids) - 1  # tokens a session may add
        opened: list = [None] * width
        ids = [list(prompt_ids[i % len(prompt_ids)]) for i in range(width)]
        rounds = [0] * width
        seen: dict[int, list[float]] = {}

        async def open_session(i):
            opened[i] = await client.open(codec.open_message(ids[i], SamplingParams(), room, tokenizer.fingerprint))
            rounds[i] = 0
            await verify(i, 1)  # after its prompt's prefill: not a timed step

        async def verify(i, tokens):
            v = await opened[i].verify(rounds[i], Proposal([0] * (tokens - 1)))  # token 0 is rarely accepted
            rounds[i] += 1
            if v.finished:  # the target ended its text: a new session for the next step
                await opened[i].close()
                opened[i] = None
            return v

        try:
            for _ in range(repeats):
                for n in sizes:
                    split = [per] * (n // per) + ([n % per] if n % per else [])
                    for i in range(len(split)):  # open (and prefill) first, so the timed step has only the drafts
                        while opened[i] is None:
                            await open_session(i)
                    verdicts = await asyncio.gather(*[verify(i, t) for i, t in enumerate(split)])
                    for v in {(v.step_tokens, v.step_ms) for v in verdicts}:
                        seen.setdefault(v[0], []).append(v[1])
        finally:
            for session in opened:
                if session is not None:
                    await session.close()
            await client.close()
        return {n: float(np.median(t)) for n, t in sorted(seen.items())}

    return asyncio.run(measure())


def interpolate_cost(costs: dict[int, float], n: float) -> float:
    """The step time at n tokens, linear between the sizes measured (and past the ends, along the nearest two)."""
    xs = sorted(costs)
    if len(xs) == 1:
        return costs[xs[0]]
    i = min(max(int(np.searchsorted(xs, n)), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return costs[x0] + (costs[x1] - costs[x0]) * (n - x0) / (x1 - x0)


def step_cost_ratio(costs: dict[int, float], sled: dict, base: dict, devices: int) -> tuple[float, float, float, int]:
    """What SLED / server-only would be if every step cost what `costs` (step_costs_alone) says: server-only spends
    c(T) / C per committed token at its run's T tokens and C committed a step; SLED forwards F tokens per committed
    one (prefill, the token before each draft, rejected drafts; counted in its run), each at the least c(n) / n over
    the sizes its devices can fill (n up to devices × (K_MAX + 1)). Not a bound: the timings have a few sessions a
    step, and a step of many one-token sessions (server-only at 16 and 32 devices) costs more than that. Returns
    (the ratio, server-only's ms per committed token, SLED's least ms per forwarded token, the n where it is least)."""
    fit = {n: c for n, c in costs.items() if n <= devices * (K_MAX + 1)} or costs
    best_n = min(fit, key=lambda n: fit[n] / n)
    per_forwarded = fit[best_n] / best_n
    # ratio(): a run that committed nothing (starved) gives nan, shown as such, as in the tables
    base_per_token = ratio(interpolate_cost(costs, base["server_step_tokens"]), base["server_committed_per_step"])
    forwarded = ratio(sled["server_step_tokens"], sled["server_committed_per_step"])
    return ratio(base_per_token, forwarded * per_forwarded), base_per_token, per_forwarded, best_n


def drafting_line(runs: dict, spt: float) -> str:
    """The section's line on the drafting speed the replayed devices reached, over every counted run."""
    reached = [r["drafting_ms_per_token"] for cfg in runs.values() for r in cfg
               if not np.isnan(r.get("drafting_ms_per_token", float("nan")))]
    if not reached:
        return ""
    return (f"- the replayed devices drafted at {min(reached):.2f}-{max(reached):.2f} ms/token (median "
            f"{float(np.median(reached)):.2f}) over the counted runs, {spt * 1000:.2f} asked: each device sleeps its "
            "drafting time (and each prompt's prefill) less what its earlier sleeps overran (every device runs in "
            "this one process)\n")


def prefill_line(counts: list[int], ms_per_token: float, source: str | None) -> str:
    """The section's line on the devices' prompt prefill, which the replayed drafters spend before each request's
    first token."""
    if not ms_per_token:
        return ("- the devices' prompt prefill is not charged (" + (source or "no llama.cpp where this ran to measure it, "
                "and none given") + "): SLED's and device-only's figures leave out a real drafter's time on each "
                "request's prompt\n")
    return (f"- each request's prompt prefill, spent by the replayed drafter before its first token: "
            f"{ms_per_token:.2f} ms per prompt token past the system prompt its KV cache keeps from the device's last "
            f"request" + (f" ({source})" if source else "") + f", {min(counts)}-{max(counts)} tokens a prompt, so "
            f"{min(counts) * ms_per_token:.0f}-{max(counts) * ms_per_token:.0f} ms a request\n")


def server_flags(devices: int, max_wait_ms: float) -> list[str]:
    """sled-server's flags for a load of up to `devices` devices: a slot for each (and two spare), every device's
    draft in one step."""
    return ["--max-sessions", str(devices + 2), "--max-seq-len", "512", "--max-batch-sessions", str(devices),
            "--max-batch-tokens", str(max(512, devices * 10)), "--max-wait-ms", str(max_wait_ms)]


def share(row: dict) -> str:
    """A row's share of prompt tokens from the prefix cache, or 'none' when no prompt fell in its window."""
    value = row["prompt_tokens_from_prefix_cache"]
    return "none" if value is None else f"{value:.0%}"


def pick_medians(runs: dict[tuple[int, str], list[dict]]) -> tuple[list[dict], list[dict], list[dict]]:
    """Per configuration (devices, mode), the run with the median system tok/s (the lower middle of an even
    count), with every repeat's tok/s in repeat order and, for every mode but server-only, SLED / server-only of
    each repeat (paired by repeat number). Returns the main rows (server-only, and adaptive as `sled`), the
    adaptive and fixed-K rows, and the other adaptive variants' rows (no-ahead, finish-first, afresh-after-miss), each
    in the order of `runs`."""
    for done in runs.values():
        done.sort(key=lambda r: r["repeat"])
    rows, adaptive_rows, waiting_rows = [], [], []
    for (n, mode), done in runs.items():
        row = dict(sorted(done, key=lambda r: r["system_tokens_per_s"])[(len(done) - 1) // 2])
        row["repeats_system_tokens_per_s"] = [r["system_tokens_per_s"] for r in done]
        row["repeats_host_cpu_stolen_share"] = [r.get("host_cpu_stolen_share") for r in done]
        if mode != "server-only":
            base = [r["system_tokens_per_s"] for r in runs[(n, "server-only")]]
            row["repeats_ratio_to_server_only"] = [ratio(r["system_tokens_per_s"], b) for r, b in zip(done, base)]
        if mode == "server-only":
            rows.append(row)
        elif mode in VARIANTS and mode != "adaptive":
            waiting_rows.append(row)
        else:
            adaptive_rows.append(row)
            if mode == "adaptive":
                rows.append(row)
    return rows, adaptive_rows, waiting_rows


def answer_table(finishing_rows: list[dict], by: dict, names: tuple[str, str] = ("at once", "finishing first")
                 ) -> list[str]:
    """`sled` against another way of answering a verdict (adaptive K both): by default finishing the token being
    drafted ahead first (`sled-finish-first`), or, named so, drafting K afresh after a miss
    (`sled-afresh-after-miss`). Tok/s, their ratio, the sessions a step, the devices' median reply to a verdict,
    and the ratio pass by pass; no lines without the other rows."""
    if not finishing_rows:
        return []
    lines = [f"| devices | {names[0]} tok/s | {names[1]} tok/s | ratio | sessions a step | median reply ms | "
             "ratio per repeat |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for f in finishing_rows:
        a = by[("sled", f["devices"])]
        per = [ratio(x, y) for x, y in zip(a["repeats_system_tokens_per_s"], f["repeats_system_tokens_per_s"])]
        reply = [f"{r['device_reply_ms'][0]:.1f}" if r.get("device_reply_ms") else "-" for r in (a, f)]
        lines.append(f"| {f['devices']} | {a['system_tokens_per_s']:.1f} | {f['system_tokens_per_s']:.1f} | "
                     f"{ratio(a['system_tokens_per_s'], f['system_tokens_per_s']):.2f}x | "
                     f"{a['server_batch_sessions']:.1f} / {f['server_batch_sessions']:.1f} | {reply[0]} / {reply[1]} | "
                     + ", ".join(f"{x:.2f}x" for x in per) + " |")
    return lines


def report_tables(counts: list[int], rows: list[dict], adaptive_rows: list[dict], waiting_rows: list[dict],
                  slo_ms: float, costs: list[tuple[str, dict[int, float]]] = ()) -> dict:
    """The section's tables and verdicts from the reported rows: `main` (a row per count and mode, with SLED /
    server-only), `k` (adaptive vs fixed K), `ahead` (drafting ahead vs waiting) and `answer` (answer_table) as
    markdown lines,
    `capacity` per mode (the largest count whose p95 inter-token latency is within slo_ms, else 0), `verdicts`
    (adaptive vs the best fixed K per count), `overhead` (the non-model share of a step at 16 devices), `bound`
    (drafting_bound / server-only per count, the most SLED / server-only can be from the devices' side),
    `server_side` (each mode's server_rate per count and their ratio, the most it can be from the server's side at
    the steps measured), `alone` (step_cost_ratio per count for each of `costs`, the server's step times alone
    measured when each label says, then load_line: each mode's load and spread against them; empty without them)
    and `by` (the rows by (mode, devices))."""
    sixteen = [r for r in rows if r["mode"] == "sled" and r["devices"] == 16]
    by = {(r["mode"], r["devices"]): r for r in rows}

    lines = ["| devices | mode | system tok/s | per-device tok/s | ITL p50 ms | ITL p95 ms | acceptance | "
             "server step ms | batch | server busy | SLED / server-only | per repeat |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        for mode in ("sled", "server-only", "device-only"):
            r = by[(mode, n)]
            vs = (f"{ratio(r['system_tokens_per_s'], by[('server-only', n)]['system_tokens_per_s']):.2f}x"
                  if mode == "sled" else "")
            per = (", ".join(f"{x:.2f}x" for x in r["repeats_ratio_to_server_only"]) if mode == "sled" else "")
            lines.append(f"| {n} | {mode} | {r['system_tokens_per_s']:.1f} | {r['per_device_tokens_per_s']:.1f} | "
                         f"{r['p50_inter_token_ms']:.1f} | {r['p95_inter_token_ms']:.1f} | {r['acceptance_rate']:.2f} | "
                         f"{r['server_step_ms']:.1f} | {r['server_batch_sessions']:.1f} | {r['server_busy_share']:.0%} | "
                         f"{vs} | {per} |")
    capacity = {}
    for mode in ("sled", "server-only", "device-only"):
        ok = [n for n in counts if by[(mode, n)]["p95_inter_token_ms"] <= slo_ms]
        capacity[mode] = max(ok) if ok else 0
    alines = ["| devices | K | system tok/s | mean K | acceptance | ITL p95 ms | tok/s per repeat |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for r in adaptive_rows:
        alines.append(f"| {r['devices']} | {r['k']} | {r['system_tokens_per_s']:.1f} | {r['mean_draft_tokens']:.2f} | "
                      f"{r['acceptance_rate']:.2f} | {r['p95_inter_token_ms']:.1f} | "
                      + ", ".join(f"{x:.1f}" for x in r["repeats_system_tokens_per_s"]) + " |")
    verdicts = []
    for n in counts:
        fixed = [r for r in adaptive_rows if r["devices"] == n and r["k"] != "adaptive"]
        best = max(fixed, key=lambda r: r["system_tokens_per_s"])
        ad = next(r for r in adaptive_rows if r["devices"] == n and r["k"] == "adaptive")
        # The same pair pass by pass: the two ran a minute apart in every pass, while this shared machine's speed
        # can drift by a third between passes, which the median runs above may fall on differently.
        per = [ratio(a, b) for a, b in zip(ad["repeats_system_tokens_per_s"], best["repeats_system_tokens_per_s"])]
        verdicts.append(f"{n} devices: adaptive {ad['system_tokens_per_s']:.1f} tok/s vs best fixed K={best['k']} "
                        f"{best['system_tokens_per_s']:.1f} "
                        f"({ratio(ad['system_tokens_per_s'], best['system_tokens_per_s']):.2f}x); "
                        f"pass by pass {', '.join(f'{x:.2f}x' for x in per)}, median {float(np.median(per)):.2f}x")
    wlines = ["| devices | drafting ahead tok/s | waiting tok/s | ratio | drafted tokens made ahead | "
              "ratio per repeat |", "|---:|---:|---:|---:|---:|---:|"]
    for w in (r for r in waiting_rows if r["mode"] == "sled-no-ahead"):
        a = by[("sled", w["devices"])]
        per = [ratio(x, y) for x, y in zip(a["repeats_system_tokens_per_s"], w["repeats_system_tokens_per_s"])]
        wlines.append(f"| {w['devices']} | {a['system_tokens_per_s']:.1f} | {w['system_tokens_per_s']:.1f} | "
                      f"{ratio(a['system_tokens_per_s'], w['system_tokens_per_s']):.2f}x | {a['drafted_ahead_share']:.0%} | "
                      + ", ".join(f"{x:.2f}x" for x in per) + " |")
    answer = answer_table([r for r in waiting_rows if r["mode"] == "sled-finish-first"], by)
    afresh = answer_table([r for r in waiting_rows if r["mode"] == "sled-afresh-after-miss"], by,
                          ("empty draft", "drafted afresh"))
    ceilings = [ratio(drafting_bound(by[("device-only", n)]["system_tokens_per_s"],
                                     by[("sled", n)]["mean_draft_tokens"], n, by[("sled", n)]["server_step_ms"]),
                      by[("server-only", n)]["system_tokens_per_s"]) for n in counts]
    bound = ("- the most SLED can reach from the devices' side: each committed token was drafted by its device, one "
             "drafting step each, but for at most one a round (the correction, or a bonus not drafted ahead), which "
             "comes after the round trip, at least the server's step, that the device spends waiting or drafting "
             "ahead what the verdict throws away; so at drafting rate r (device-only per device), step s and mean "
             "draft length K a device commits at most r × (1 + max(0, 1 − r·s) / K), and SLED / server-only ≤ "
             "device-only / server-only × (1 + max(0, 1 − r·s) / K), at the sled rows' K and step "
             "(r·s ≥ 1: the drafters' own rate is the bound): "
             + ", ".join(f"{n} devices {c:.2f}x (K {by[('sled', n)]['mean_draft_tokens']:.2f}, r·s "
                         f"{drafting_per_step(by[('device-only', n)]['system_tokens_per_s'], n, by[('sled', n)]['server_step_ms']):.2f})"
                         for n, c in zip(counts, ceilings)) + "\n")
    drafting = drafting_use_line(counts, by)
    served = []
    for n in counts:
        sled, base = by[("sled", n)], by[("server-only", n)]
        a, b = server_rate(sled), server_rate(base)
        served.append(f"{n} devices sled {a:.1f}, server-only {b:.1f} ({ratio(a, b):.2f}x)")
    server_side = ("- the server's side: tokens committed per second of server step time (system tok/s ÷ server "
                   "busy), what each mode would commit with the server never idle at the steps it ran; their ratio "
                   "is the most SLED / server-only can be without cheaper steps, however fast the devices draft: "
                   + ", ".join(served) + "\n")
    alone = ""
    if costs:
        parts = []
        for n in counts:
            sled, base = by[("sled", n)], by[("server-only", n)]
            got = ratio(sled["system_tokens_per_s"], base["system_tokens_per_s"])
            each = []
            for label, c in costs:
                at_cost, base_ms, sled_ms, best_n = step_cost_ratio(c, sled, base, n)
                each.append(f"{label} {at_cost:.2f}x (server-only {base_ms:.2f} ms per committed token; SLED "
                            f"{sled_ms:.2f} ms per forwarded token at {best_n})")
            parts.append(f"{n} devices: server-only {base['server_step_tokens']:.1f} tokens a step, "
                         f"{base['server_committed_per_step']:.1f} committed; SLED "
                         f"{ratio(sled['server_step_tokens'], sled['server_committed_per_step']):.2f} forwarded per "
                         f"committed; at the cost alone " + ", ".join(each) + f"; measured {got:.2f}x")
        timed = "; ".join(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()) for label, c in costs)
        alone = ("- the steps' cost alone: the server's step time with nothing else running, timed through it (ms at "
                 f"n tokens; {timed}); if every step ran at that cost, server-only would spend c(T) / C per "
                 "committed token at its run's T tokens and C committed a step, and SLED, forwarding F tokens per "
                 "committed one (prefill, the token before each draft, rejected drafts), at least F × min c(n) / n "
                 "over the sizes its devices can fill; their quotient is SLED / server-only with every step at its "
                 "cost alone and SLED's at its best size, an estimate, not a bound (the timings have a few sessions "
                 "a step; a step of many one-token sessions, server-only's at many devices, costs more): "
                 + "; ".join(parts) + "\n")
        alone += load_line(counts, by, costs)
    overhead = ""
    if sixteen:
        s = sixteen[0]
        overhead = (f"- non-model time per step at 16 sessions (scheduling, sampling, commit; step − forward): "
                    f"{s['server_step_ms'] - s['server_forward_ms']:.1f} of {s['server_step_ms']:.1f} ms "
                    f"({(1 - s['server_forward_ms'] / s['server_step_ms']) * 100:.1f}%)\n")
    return {"by": by, "main": lines, "k": alines, "ahead": wlines, "answer": answer, "afresh": afresh,
            "capacity": capacity,
            "verdicts": verdicts, "overhead": overhead, "bound": bound, "server_side": server_side, "alone": alone,
            "stolen": stolen_line(rows + adaptive_rows + waiting_rows), "devices_cpu": devices_cpu_line(counts, by),
            "drafting": drafting}


def drafting_use_line(counts: list[int], by: dict) -> str:
    """Where the sled rows' devices fall short of their drafters' own rate: the share of the window each drafter
    drafted (drafting_use) and what each token's drafting time brought in committed tokens, whose product with the
    rate reached is the per-device rate. Empty for rows without the drafting record (from before it)."""
    parts = []
    for n in counts:
        r = by[("sled", n)]
        busy, ends = r.get("drafting_busy_share"), r.get("drafting_idle_at_request_ends_share")
        ms = r.get("drafting_ms_per_token")
        if busy is None or ends is None or ms is None or np.isnan(ms):
            continue
        rate = 1000.0 / ms
        prefill = r.get("drafting_prefill_share")
        prefill = 0.0 if prefill is None or np.isnan(prefill) else prefill
        drafting = busy * (1 - prefill)  # the share on tokens, the prompts' prefill taken off
        got = ratio(r["per_device_tokens_per_s"], drafting * rate)
        parts.append(f"{n} devices busy {busy:.0%}"
                     + (f" ({busy * prefill:.0%} of the window prefilling prompts)" if prefill else "")
                     + f", idle {ends:.0%} around requests' ends and {1 - busy - ends:.0%} "
                     f"inside them, {got:.2f} committed per token drafted ({rate:.1f} × {drafting:.2f} × {got:.2f} = "
                     f"{r['per_device_tokens_per_s']:.1f} tok/s a device)")
    if not parts:
        return ""
    return ("- where the devices fall short of their drafters' rate (sled rows): the share of the window each drafter "
            "spent drafting, the share it stood idle around the end of a request (from its last token drafted before "
            "the request's final verdict to its first of the next request) and inside requests, and the tokens "
            "committed per token's drafting time (below 1 where drafts ahead are thrown away after a miss, above "
            "where the server's own tokens add to them); the drafting rate reached × the share busy on tokens (the "
            "prompts' prefill taken off) × that is the per-device rate: " + ", ".join(parts) + "\n")


def load_line(counts: list[int], by: dict, costs: list[tuple[str, dict[int, float]]]) -> str:
    """Where the reported runs' steps part from the steps' cost alone (load_and_spread), per count and mode, for
    each of `costs`; empty for rows from before the step sizes were recorded."""
    parts = []
    for n in counts:
        each = []
        for mode in ("sled", "server-only"):
            sizes = by[(mode, n)].get("server_step_sizes")
            if not sizes:
                continue
            figures = []
            for label, c in costs:
                load, spread, mean = load_and_spread(c, sizes)
                figures.append(f"{load:.2f}x and {spread:.2f}x {label}")
            each.append(f"{mode} (steps of {mean:.1f} tokens) " + ", ".join(figures))
        if each:
            parts.append(f"{n} devices: " + "; ".join(each))
    if not parts:
        return ""
    return ("- the steps under load against the steps' cost alone, from the verdicts of the rounds counted (the steps "
            "that verified a draft, a step of s sessions counted 1/s in each): the load, their time over what steps of "
            "their sizes cost alone, and the spread, what steps of their sizes cost alone over as many steps of their "
            "mean size (a step of a few tokens costs nearly what one of 10 does): " + "; ".join(parts) + "\n")


def devices_cpu_line(counts: list[int], by: dict) -> str:
    """A line on the CPU the replayed devices took from this host during the reported (median) runs, or '' where the
    rows have none: what of the devices' side still runs on the server's cores (their asyncio loop, replay and gRPC
    client; a real device's runs on its own)."""
    parts = []
    for n in counts:
        sled, base = by[("sled", n)].get("devices_cpu_cores"), by[("server-only", n)].get("devices_cpu_cores")
        if sled is not None and base is not None:
            parts.append(f"{n} devices sled {sled:.2f}, server-only {base:.2f}")
    if not parts:
        return ""
    return ("- CPU the replayed devices took on this host during the reported runs (the benchmark's own process: "
            "their asyncio loop, replay and gRPC client, which on real devices run on the devices), in cores of the "
            f"host's {os.cpu_count()}: " + "; ".join(parts) + "\n")


def link_line(spec, counts: list[int], by: dict) -> str:
    """The --link line of the section ('' on loopback): the link, and the CPU its relay took from this host."""
    if spec is None:
        return ""
    cpu = [f"{n} devices sled {by[('sled', n)]['link_cpu_cores']:.2f}, server-only "
           f"{by[('server-only', n)]['link_cpu_cores']:.2f}" for n in counts
           if by[("sled", n)].get("link_cpu_cores") is not None and by[("server-only", n)].get("link_cpu_cores") is not None]
    return (f"- network: each device reached the server over its own emulated link, {spec.describe()} (`--link`: "
            "scripts/linkemu.py, a user-space TCP relay in a process of its own, one TCP connection a device), so a "
            f"round trip takes about {2 * spec.delay_ms:g} ms more than on loopback: SLED pays it each round, "
            "server-only once a request (the server decodes and streams every token: Open.server_decodes); "
            "device-only has no link (the drafter alone); the bounds and step-cost estimates below leave the link out"
            + (f"; CPU the relay took on this host during the reported runs, in cores of the host's {os.cpu_count()}: "
               + "; ".join(cpu) if cpu else "") + "\n")


def mode_cells(counts: list[int], by: dict, cell) -> list[str]:
    """Per count, '<n> devices ' and the cells `cell(mode, row)` gives for its sled and server-only rows, the
    None ones left out; counts without any cell are left out."""
    parts = []
    for n in counts:
        cells = [c for mode in ("sled", "server-only") if (c := cell(mode, by[(mode, n)])) is not None]
        if cells:
            parts.append(f"{n} devices " + ", ".join(cells))
    return parts


def reply_line(counts: list[int], by: dict, max_wait_ms: float) -> str:
    """A line on how fast the devices answered each verdict with their next draft in the reported (median) runs of sled
    and server-only, against the server's batching window, or '' where the rows have no such figures. A draft that
    reaches the server within the window after a step joins the next step; one that comes later waits a step more,
    and at a busy server the devices can fall into two groups that take turns, each step holding about half of them
    (SLED's 'batch' column at 16 and 32 devices here and at 32 on the H100; queued_line counts them)."""
    def cell(mode: str, row: dict) -> str | None:
        reply, drafting = row.get("device_reply_ms"), row.get("device_reply_drafting_ms")
        if reply is None or drafting is None:
            return None
        return f"{mode} {reply[0]:.1f} / {reply[1]:.1f} ({drafting[0]:.1f} / {drafting[1]:.1f})"

    parts = mode_cells(counts, by, cell)
    if not parts:
        return ""
    return ("- the devices' replies to verdicts: from a verdict's arrival to the next draft going out, median / 90th "
            "percentile ms, and in brackets the part spent finishing the token being drafted ahead when it came (where "
            "the tokens drafted ahead are fewer than the next draft, the rest is drafted after that too); the server's "
            f"batching window was {max_wait_ms:g} ms: " + "; ".join(parts) + "\n")


def queued_line(counts: list[int], by: dict) -> str:
    """A line on the drafts that reached the server while another step ran and so waited for it to end, in the
    reported runs of sled and server-only (queue_figures): the share of the counted rounds, and the median of those
    waits. Over half of SLED's at 16 and 32 devices on the 2-core CPU host (62% and 78% in the main section's run at
    6d37e11), where the devices answering one step's verdicts miss the next step's start: the two groups reply_line
    tells of. '' where the rows have no such figures."""
    def cell(mode: str, row: dict) -> str | None:
        share, wait = row.get("queued_drafts_share"), row.get("queued_drafts_wait_ms")
        if share is None:
            return None
        return f"{mode} {share:.0%}" + (f" ({wait:.1f} ms)" if wait is not None else "")

    parts = mode_cells(counts, by, cell)
    if not parts:
        return ""
    return ("- drafts that reached the server while another step ran, and waited for it to end before their own (the "
            "share of the counted rounds, and in brackets the median of those waits, from each verdict's queue_ms): "
            + "; ".join(parts) + "\n")


def stolen_line(rows: list[dict]) -> str:
    """A line on the host CPU time the hypervisor took during the windows (steal), over every run of every
    configuration: the median and the highest run, or '' where /proc/stat gave none."""
    runs = {}
    for r in rows:
        for rep, x in enumerate(r.get("repeats_host_cpu_stolen_share") or []):
            if x is not None:
                runs[(r["devices"], r["mode"], rep)] = x
    if not runs:
        return ""
    (n, mode, rep), top = max(runs.items(), key=lambda kv: kv[1])
    return (f"- host CPU time taken by the hypervisor (steal, /proc/stat) during the windows: median "
            f"{float(np.median(list(runs.values()))):.1%} over {len(runs)} runs, highest {top:.1%} ({n} devices, "
            f"{mode}, pass {rep + 1}); per run in the JSON (`host_cpu_stolen_share`)\n")


def main() -> int:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=counts_arg, default="1,4,16,32", help="device counts (default 1,4,16,32)")
    ap.add_argument("--slo-ms", type=float, default=150.0, help="p95 inter-token latency bound for capacity (default 150)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--seconds", type=float, default=8.0,
                    help="length of the measured window; devices run requests back to back (default 8)")
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="time from the start before the window opens: the first requests open together (default 1)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="passed with adaptive drafting on (default 4)")
    ap.add_argument("--recordings", type=int, default=8, help="distinct recorded prompts, reused round-robin (default 8)")
    ap.add_argument("--max-wait-ms", type=float, default=3.0, help="the server's batching window (default 3)")
    ap.add_argument("--device-ms-per-token", type=float,
                    help="drafting time per token on a device (default: the one a --draft-match FILE recorded, else "
                         "measured here for llama.cpp Q4_1 with --device-threads)")
    ap.add_argument("--device-prefill-ms-per-token", type=float, metavar="MS",
                    help="a device's prefill time per prompt token past the system prompt its drafter keeps cached, "
                         "spent before each request's first token (default: the one a --draft-match FILE recorded, "
                         "else measured here for llama.cpp Q4_1 with --device-threads; 0 where neither can be had, "
                         "and the section says so)")
    ap.add_argument("--device-threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp threads of the drafter measured alone for the devices' drafting time (default: "
                         "this machine's cores, %(default)s: each replayed device stands for a machine like this one "
                         "drafting on all its cores, as the device configs do; 1 gives a one-core device)")
    ap.add_argument("--target", metavar="SPEC",
                    help="the server's target (default: SmolLM2-135M-Instruct); random:llama-1b or random:llama-8b for "
                         "a GPU capacity run, with synthesized drafts")
    ap.add_argument("--draft-match", metavar="P|FILE",
                    help="synthesize drafts from the target's greedy output, each position right with probability P "
                         "(default for random targets: 0.95), instead of replaying llama.cpp's proposals; or the "
                         "JSON file a --match-only run wrote, to replay the match measured with the real models")
    ap.add_argument("--tokenizer", metavar="DIR",
                    help="the vocabulary as a tokenizer folder (scripts/export_tokenizer.py), for the devices and a "
                         "random target, on a machine without the default GGUF (a GPU node)")
    ap.add_argument("--match-only", action="store_true",
                    help="record the real drafter along the target's greedy output, print how often its drafted "
                         "tokens match (the value to give --draft-match on a GPU run; with --json, written there) "
                         "and stop")
    ap.add_argument("--label", help="a name for this run's section of docs/benchmarks.md, beside the unlabelled one "
                                    "(e.g. 'devices drafting at 3 ms/token')")
    ap.add_argument("--min-step-ms", type=float, default=0.0, metavar="MS",
                    help="the server pads every forward to at least this long (with a tiny random target: a GPU's "
                         "step profile on this CPU; default 0: off)")
    ap.add_argument("--min-step-ms-per-token", type=float, default=0.0, metavar="MS",
                    help="and this much more per token in the step (default 0)")
    ap.add_argument("--link", metavar="SPEC",
                    help="each device reaches the server over its own emulated network link, e.g. "
                         "delay_ms=20,jitter_ms=5,rate_mbit=50 (delay and jitter each way; scripts/linkemu.py, a relay "
                         "process of its own, one TCP connection a device); default: loopback, no link. The section "
                         "gets a heading of its own")
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG=VALUE",
                    help="extra sled-server flag, e.g. --server-arg=--dtype=bfloat16 (repeatable)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs of every configuration, in alternating order; the median is reported (default 5: on a "
                         "shared 2-core host one pass can run a third slower than the next)")
    ap.add_argument("--warmup-pass", action="store_true",
                    help="run every configuration once before the counted repeats, uncounted: a GPU server's first "
                         "steps of each new shape are slow (allocations, kernel choice) and would fall on the first pass")
    ap.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "bench_system"), help="where PNG plots go")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"), help="file whose section is rewritten")
    args = ap.parse_args()
    counts = args.devices
    top = max(counts)
    random_target = bool(args.target and args.target.startswith("random:"))
    match_source = None
    drafting_source = None  # where --device-ms-per-token came from when it was not given
    prefill_source = None  # and --device-prefill-ms-per-token
    if args.draft_match is not None and args.draft_match.endswith(".json"):
        try:
            measured = json.loads(Path(args.draft_match).read_text())
            match_source = (f"the real pair's match, measured by `--match-only` on {measured['machine']} at "
                            f"{measured['date']} over {measured['recordings']} greedy outputs")
            args.draft_match = float(measured["draft_match"])
            if args.device_ms_per_token is None and measured.get("drafting_ms_per_token") is not None:
                # The drafter's speed measured with the match stands for the devices', unless one is given.
                args.device_ms_per_token = float(measured["drafting_ms_per_token"])
                drafting_source = "the real drafter's, measured with the match"
            if args.device_prefill_ms_per_token is None and measured.get("prefill_ms_per_token") is not None:
                args.device_prefill_ms_per_token = float(measured["prefill_ms_per_token"])
                prefill_source = "the real drafter's, measured with the match"
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"--draft-match {args.draft_match}: not a --match-only JSON file ({err})")
    elif args.draft_match is not None:
        try:
            args.draft_match = float(args.draft_match)
        except ValueError:
            ap.error(f"--draft-match must be a probability or a --match-only JSON file, got {args.draft_match!r}")
    if args.draft_match is None and random_target:
        args.draft_match = 0.95
    if args.device_prefill_ms_per_token is not None and prefill_source is None:
        prefill_source = "as given"
    if args.repeats < 1:
        ap.error("--repeats must be positive")
    if args.seconds <= 0 or args.warmup_s < 0:
        ap.error("--seconds must be positive and --warmup-s not negative")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be positive")
    if not args.slo_ms > 0:
        ap.error("--slo-ms must be positive")
    if args.recordings < 1 or args.draft_tokens < 1:
        ap.error("--recordings and --draft-tokens must be at least 1")
    if not 0 <= args.max_wait_ms < 60_000:
        ap.error("--max-wait-ms must be in [0, 60000)")
    if args.draft_match is not None and not 0 <= args.draft_match <= 1:
        ap.error("--draft-match must be in [0, 1]")
    if args.device_threads < 1:
        ap.error("--device-threads must be positive")
    if args.device_ms_per_token is not None and args.device_ms_per_token <= 0:
        ap.error("--device-ms-per-token must be positive")
    if args.device_prefill_ms_per_token is not None and not 0 <= args.device_prefill_ms_per_token < 60_000:
        ap.error("--device-prefill-ms-per-token must be in [0, 60000)")
    if args.match_only and (args.draft_match is not None or random_target):
        ap.error("--match-only measures the real drafter against the real target: no --draft-match or random target")
    if args.tokenizer and not random_target:
        ap.error("--tokenizer goes with a random target (--target random:...): the default target brings its own")
    if importlib.util.find_spec("llama_cpp") is None and (args.draft_match is None or args.device_ms_per_token is None):
        ap.error("llama.cpp is not installed here: give --draft-match and --device-ms-per-token (a --match-only "
                 "JSON file given to --draft-match carries both)")
    if not (0 <= args.min_step_ms < 60_000 and 0 <= args.min_step_ms_per_token < 60_000):
        ap.error("--min-step-ms and --min-step-ms-per-token must be in [0, 60000)")
    link_spec = None
    if args.link is not None:
        try:
            link_spec = LinkSpec.parse(args.link)
        except ValueError as err:
            ap.error(f"--link: {err}")
        if args.match_only:
            ap.error("--match-only records along loopback: no --link")
        if not args.label:  # its own section, beside the loopback one
            args.label = f"devices over an emulated link of {link_spec.describe()}"
    extra = [a for arg in args.server_arg for a in arg.split("=", 1)]
    floor = args.min_step_ms > 0 or args.min_step_ms_per_token > 0
    if floor:
        extra += ["--min-step-ms", str(args.min_step_ms), "--min-step-ms-per-token", str(args.min_step_ms_per_token)]
    if args.target:
        extra += ["--target", args.target]
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]

    tokenizer = device_tokenizer(args.tokenizer)
    ids = prompts(tokenizer, args.recordings)
    alone_ms, prefill_samples = [], []
    if args.device_ms_per_token is not None:
        device_spt = args.device_ms_per_token / 1000
        print(f"[bench] drafting time per token ({drafting_source or 'as given'}): {device_spt * 1000:.1f} ms",
              flush=True)
    if args.device_ms_per_token is None or (args.device_prefill_ms_per_token is None
                                            and importlib.util.find_spec("llama_cpp") is not None):
        # One drafter alone, unverified, before the server starts (a device has its own hardware): its time per token,
        # the median of three runs as this machine's speed wanders (the devices' drafting time and device-only,
        # unless given; else only to take off each request's first token below), and its prompts' prefill.
        alone = create_drafter("llama-cpp", DrafterOptions(context_size=512, threads=args.device_threads))
        timed = drafting_ms_alone(alone, ids[0], args.max_tokens)
        alone_spt = float(np.median(timed)) / 1000
        if args.device_ms_per_token is None:  # else the section's drafting time is the one given
            alone_ms, device_spt = timed, alone_spt
            print(f"[bench] one llama.cpp drafter alone, {args.device_threads} thread(s): "
                  f"{', '.join(f'{x:.1f}' for x in alone_ms)} ms/token; median {device_spt * 1000:.1f}", flush=True)
        if args.device_prefill_ms_per_token is None:
            per, prefill_samples = measure_prefill(alone, ids, alone_spt)
            args.device_prefill_ms_per_token = per * 1000
        alone.close()
    if prefill_samples:
        print(f"[bench] the drafter's prefill, per prompt token past the cached system prompt: "
              f"{', '.join(f'{x:.2f}' for x in prefill_samples)} ms; median "
              f"{args.device_prefill_ms_per_token:.2f}", flush=True)
        prefill_source = (f"one llama.cpp drafter alone, {args.device_threads} thread"
                          f"{'s' * (args.device_threads > 1)}, through the prompts in turn: the median of "
                          f"{len(prefill_samples)} requests' first token over a drafting step")
    if args.device_prefill_ms_per_token is None:
        args.device_prefill_ms_per_token = 0.0
        print("[bench] the devices' prompt prefill is not charged: no llama.cpp here and none given "
              "(--device-prefill-ms-per-token, or a --match-only file that records it)", flush=True)
    elif not prefill_samples:
        print(f"[bench] the devices' prompt prefill per token ({prefill_source}): "
              f"{args.device_prefill_ms_per_token:.2f} ms", flush=True)
    prefill_counts = prefill_tokens(ids)
    prefill_s = [n * args.device_prefill_ms_per_token / 1000 for n in prefill_counts]
    spt = device_spt
    server = ServerProcess(*server_flags(top, args.max_wait_ms), *extra)
    address = server.start()
    link = None
    try:
        fulls, confidences = None, None
        if args.draft_match is not None:
            print(f"[bench] synthesizing drafts from the target's greedy outputs ({args.recordings} prompts, "
                  f"each position right with probability {args.draft_match:g}) ...", flush=True)
            fulls = greedy_outputs(address, tokenizer, ids, args.max_tokens)
            tables = synthesize_tables(fulls, [len(i) for i in ids], args.draft_match, tokenizer.vocab_size)
        else:
            print(f"[bench] recording the llama.cpp drafter's proposals along {args.recordings} greedy outputs ...",
                  flush=True)
            tables, recorded, confidences = record_tables(address, tokenizer, ids, args.max_tokens)
            real_match = match_rate(tables, recorded)
            print(f"[bench] the real drafter's per-position match with the target's greedy output: "
                  f"{real_match[0]:.3f} (by draft position: {', '.join(f'{x:.2f}' for x in real_match[1])}); "
                  f"a GPU run replays it with --draft-match {real_match[0]:.3f}", flush=True)
            if args.match_only:
                if args.json:
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps({
                        "draft_match": real_match[0], "by_position": real_match[1], "drafting_ms_per_token": spt * 1000,
                        "prefill_ms_per_token": args.device_prefill_ms_per_token, "recordings": len(ids),
                        "max_tokens": args.max_tokens, "machine": machine(),
                        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}, indent=2))
                    print(f"[bench] wrote {args.json}")
                return 0

        costs = [("before the runs", step_costs_alone(address, tokenizer, ids, top))]
        print("[bench] the server's step alone (tokens: ms): "
              + ", ".join(f"{k}: {v:.1f}" for k, v in costs[0][1].items()), flush=True)
        plan = [(n, m) for n in counts for m in ("server-only", "2", "4", "8", *VARIANTS)]
        # Every configuration runs --repeats times, the order reversed on every other pass so that a slow
        # stretch of this shared machine does not fall on one configuration; the median run is reported.
        order = [(rep, cfg) for rep in range(args.repeats) for cfg in (plan if rep % 2 == 0 else plan[::-1])]
        if args.warmup_pass:
            order = [(-1, cfg) for cfg in plan] + order
        runs: dict[tuple[int, str], list[dict]] = {cfg: [] for cfg in plan}
        if link_spec:
            host, _, port = address.rpartition(":")
            link = LinkProcess(link_spec, host, int(port))
            print(f"[bench] devices reach the server over emulated links ({link_spec.describe()}) through "
                  f"{link.start()}", flush=True)
        for rep, (n, mode) in tqdm(order, desc="system", unit="run"):
            if mode == "server-only":
                w = asyncio.run(run_window(address, tokenizer, lambda p: create_drafter("none"), ids, n,
                                           args.max_tokens, 0, args.warmup_s, args.seconds, link=link))
                row = summarize(mode, n, w)
            else:
                adaptive = mode in VARIANTS
                k = args.draft_tokens if adaptive else int(mode)
                clock = DraftClock()
                w = asyncio.run(run_window(
                    address, tokenizer,
                    lambda p: ReplayDrafter(tables[p], spt, fulls[p] if fulls else None,
                                            confidences[p] if confidences else None, clock, prefill_s[p]), ids, n,
                    args.max_tokens, k, args.warmup_s, args.seconds, adaptive=adaptive,
                    draft_ahead=mode != "no-ahead", answer_at_once=mode != "finish-first",
                    empty_after_miss=None if mode == "afresh-after-miss" else EMPTY_AFTER_MISS, link=link))
                # Fixed-K rows are their own modes, so that `mode == "sled"` picks exactly one row per count.
                row = summarize(VARIANTS.get(mode, f"sled-k{mode}"), n, w)
                row["k"] = mode
                row["drafting_ms_per_token"] = clock.ms_per_token()
                row["drafting_prefill_share"] = clock.prefill_share()
            row["repeat"] = rep
            if rep >= 0:  # the warm-up pass is not counted
                runs[(n, mode)].append(row)
        rows, adaptive_rows, waiting_rows = pick_medians(runs)
        alone_rate = device_only_rate(device_spt, prefill_s, args.max_tokens)
        for n in counts:
            rows.append({"mode": "device-only", "devices": n, "system_tokens_per_s": n * alone_rate,
                         "per_device_tokens_per_s": alone_rate, "p50_inter_token_ms": device_spt * 1000,
                         "p95_inter_token_ms": device_spt * 1000, "acceptance_rate": 0.0, "mean_draft_tokens": 0.0,
                         "server_step_ms": 0.0, "server_forward_ms": 0.0, "server_batch_sessions": 0.0,
                         "server_busy_share": 0.0})

        # Timed again at the end: this shared machine's speed drifts over a run of many minutes.
        costs.append(("after them", step_costs_alone(address, tokenizer, ids, top)))
        # The server's kernels, with its start-up choice of kernel for large steps (its warm-up times them), which
        # moves SLED's figures at many devices: a run where it came out low is visible as such.
        kernels = asyncio.run(fetch_info(address))
    finally:
        if link:
            link.stop()
        server.stop()

    t = report_tables(counts, rows, adaptive_rows, waiting_rows, args.slo_ms, costs)
    by, lines, alines, wlines = t["by"], t["main"], t["k"], t["ahead"]
    capacity, verdicts, overhead, stolen = t["capacity"], t["verdicts"], t["overhead"], t["stolen"]
    bound, server_side = t["bound"], t["server_side"]
    gpu = gpu_name()
    # A GPU run has its own section, so that it does not replace this machine's CPU figures.
    heading = ("## GPU system benchmark" if gpu else "## System benchmark") + (f", {args.label}" if args.label else "")
    if args.draft_match is not None:
        target_line = (f"- target: {args.target or 'SmolLM2-135M-Instruct'} on the server's default device and dtype"
                       f"{' (random weights)' if random_target else ''}; drafts: synthesized from the target's greedy "
                       f"output, each drafted position right with probability {args.draft_match:.3f}"
                       + (f" ({match_source})" if match_source else "") + ", ")
        if floor:
            target_line = (f"- emulated, not a GPU: the server padded every forward to at least {args.min_step_ms:g} ms "
                           f"+ {args.min_step_ms_per_token:g} ms per token in the step (`--min-step-ms`), so its steps "
                           "cost nearly the same at any size, as on a GPU; the target's own forward is far quicker\n"
                           + target_line)
    else:
        target_line = ("- target: SmolLM2-135M-Instruct float32 on CPU; drafts: llama.cpp Q4_1's greedy proposals "
                       f"(flash attention {'on' if DrafterOptions().flash_attn else 'off'}, the device's default), "
                       "recorded and ")
    section = (
        f"{heading}: SLED vs server-only vs device-only\n\n"
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- machine: {machine()}" + (f", GPU: {gpu} (the server's)" if gpu else " (no GPU)") + "\n"
        f"- command: `python scripts/bench_system.py {' '.join(sys.argv[1:])}`\n"
        + target_line
        + f"replayed at {spt * 1000:.1f} ms/token of drafting per device"
        + (f" ({drafting_source})" if drafting_source else "")
        + (f" (one llama.cpp drafter alone, {args.device_threads} thread{'s' * (args.device_threads > 1)}, before "
           "the server started: "
           f"{', '.join(f'{x:.1f}' for x in alone_ms)} ms/token; the median)" if alone_ms else "")
        + f"; `sled` uses the adaptive draft length (K ≤ {K_MAX}) and drafts ahead (the defaults)\n"
        + prefill_line(prefill_counts, args.device_prefill_ms_per_token, prefill_source)
        + drafting_line(runs, spt)
        + "- server: prefix cache on (the default); every prompt starts with the chat template's "
        "system prompt, so prompt tokens copied from the prefix cache (sled / server-only): "
        + ", ".join(f"{n} devices {share(by[('sled', n)])} / {share(by[('server-only', n)])}" for n in counts)
        + " (none: no request started inside the window)\n"
        + kernel_line(kernels)
        + f"- load: a closed loop, each device sending requests of {args.max_tokens} greedy tokens back to back (its "
        f"own turn through the {len(ids)} prompts); tokens/s count the tokens committed in a {args.seconds:g} s "
        f"window that opens {args.warmup_s:g} s after all devices start, or later, once every device has committed "
        "its first round (the first prompts' prefill at many devices can outlast the warm-up), so every device is busy "
        "all through it; it opened after (s, the reported runs) "
        + ", ".join(f"{n} devices {max(by[(m, n)]['window_opened_s'] for m in ('sled', 'server-only')):.1f}"
                    for n in counts) + "\n"
        f"- capacity (largest tested device count with p95 inter-token latency ≤ {args.slo_ms:g} ms): "
        + ", ".join(f"{m} {c}" for m, c in capacity.items()) + "\n"
        "- device-only is the drafter alone (not target quality), N devices = N × one device's rate: requests of "
        f"{args.max_tokens} tokens at the drafting time per token, each after its prompt's prefill\n"
        "- server busy: the share of the window the server spent in its steps (batching, forward, sampling)\n"
        + ("- a warm-up pass ran every configuration once before the counted ones\n" if args.warmup_pass else "")
        + f"- every configuration ran {args.repeats} times, the order reversed on every other pass; each row is the run "
        "with the median system tok/s, and 'per repeat' gives SLED / server-only of each pass (the adaptive verdicts "
        "below likewise give adaptive / the best fixed K of each pass)\n"
        + stolen + t["devices_cpu"] + link_line(link_spec, counts, by) + reply_line(counts, by, args.max_wait_ms) + queued_line(counts, by) + "\n"
        + "\n".join(lines) + "\n\n" + bound + t["drafting"] + server_side + t["alone"] + "\n"
        "### Step time under load\n\n" + overhead
        + "- the decode step at batch 1 against the memory-bandwidth limit is measured alone, without client "
        "processes sharing the cores: see the engine speed section (`scripts/bench_engine.py`)\n\n"
        "### Adaptive draft length vs fixed K (same replayed drafter, same run)\n\n"
        + "\n".join(alines) + "\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n\n"
        "### Drafting ahead vs waiting for the verdict (adaptive K both)\n\n"
        "While a draft is verified, a device drafting ahead goes on as if all of it will be accepted with its own "
        "next token as the bonus; when that holds, the next draft is ready at once (`--no-draft-ahead` waits).\n\n"
        + "\n".join(wlines) + "\n"
        + ("\n### Answering a verdict at once vs finishing the token first (adaptive K, drafting ahead both)\n\n"
           "A verdict that comes while a device drafts ahead is answered at once with what was drafted ahead (K at "
           "most, after a hit) while the drafter finishes its token, or (`sled-finish-first`, the "
           "device before commit d1c17cb) after that token, with the rest of K drafted first; the default answers "
           "at once only while the server does not queue its drafts (since 20ecf0d: where most recent drafts waited "
           "through an earlier step it finishes first too); sessions a step and median reply: at once / finishing "
           "first.\n\n" + "\n".join(t["answer"]) + "\n" if t["answer"] else "")
        + ("\n### After a miss: an empty draft vs drafting K afresh (adaptive K, answering at once both)\n\n"
           f"A miss that comes while a device drafts ahead is answered with an empty draft (the server's token alone, "
           f"in the step that verdict's window opens) where the device's acceptance is at least {EMPTY_AFTER_MISS:g}, "
           "or (`sled-afresh-after-miss`, the device before this option) with K drafted afresh, which joins a later "
           "step; sessions a step and median reply: empty draft / drafted afresh.\n\n"
           + "\n".join(t["afresh"]) + "\n" if t["afresh"] else "")
    )
    publish(args.markdown, heading + ":", section, args.json,
            rows + [r for r in adaptive_rows if r["k"] != "adaptive"] + waiting_rows)
    paths = plot(rows, Path(args.out_dir))
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(alines) + "\n\n"
          + "\n".join(wlines + [""] + t["answer"] + [""] + t["afresh"]))
    print(f"[bench] capacity: {capacity}; plots: {[str(p) for p in paths]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
