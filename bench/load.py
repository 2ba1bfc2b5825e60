"""Device load for the benchmarks: N devices in a closed loop, each sending requests back to back, and what they
committed inside a measured window while every one of them was busy."""

from __future__ import annotations

import asyncio
import bisect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from edge_client.policy import DraftPolicy
from edge_client.request import Callbacks, Request

from .report import cpu_counters, stolen_share
from .runner import Job, Runner, summary


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
    # per request that ended inside the window, not cut at its end: (TTFT, TPOT) in seconds (request_latency)
    latencies: list[tuple[float, float]] = field(default_factory=list)


# The window waits for every device's first commit, but not past this: a device the server starves is then
# counted as it is (it shows as a low per-device rate).
MAX_OPEN_WAIT_S = 120.0


async def run_window(address, tokenizer, make_drafter, prompt_ids, n, max_tokens, policy: DraftPolicy, warmup_s,
                     seconds, link=None) -> Window:
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
    runner = Runner(address, tokenizer)
    t0 = time.perf_counter()
    start = end = float("inf")  # set when the window opens
    first_commit = [False] * n  # written from the drafting threads; read by window()

    async def device(d):
        # per round committed inside the window, from each request: (time, tokens, seconds), the step that verified
        # it, the reply before it, its wait through earlier steps; and over the whole run, the drafting and the ends
        got = {"rounds": [], "steps": [], "replies": [], "queued": [], "results": [], "drafting": [], "ends": [],
               "latencies": []}
        # The device's draft-length controller, kept across its requests as the agent keeps one per drafter.
        controller = policy.controller() if policy.adaptive and policy.drafts else None
        own = Runner(link.address, tokenizer, own_connection=True) if link else None
        try:
            j = 0
            while time.perf_counter() < end:
                p = (d + j) % len(prompt_ids)
                drafter = Timeline(make_drafter(p), on_commit=lambda: first_commit.__setitem__(d, True))
                cut = []  # not empty once the window's end stopped the request

                def stop() -> bool:
                    if time.perf_counter() >= end:
                        cut.append(True)
                    return bool(cut)

                asked = time.perf_counter()
                request = Request(prompt_ids[p], max_tokens=max_tokens, policy=policy)
                r = await (own or runner).generate(Job(drafter, request, Callbacks(should_stop=stop)), controller)
                if not r.token_ids and time.perf_counter() >= end:
                    break  # the window ended before this request reached the server: it was never made
                inside = [start <= t < end for t in drafter.commits]
                for key, per_round in (("rounds", zip(drafter.commits, r.round_tokens, r.round_times)),
                                       ("steps", r.round_steps), ("replies", r.round_replies),
                                       ("queued", r.round_queue_ms)):
                    got[key] += [x for x, keep in zip(per_round, inside) if keep]
                got["results"].append(r)
                if not cut and drafter.commits and start <= drafter.commits[-1] < end:
                    got["latencies"].append(request_latency(asked, drafter.commits, len(r.token_ids)))
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
        before = await runner.stats()
        ticks = cpu_counters()
        cpu = time.process_time()
        relay = link.cpu_seconds() if link else 0.0
        start = time.perf_counter()
        end = start + seconds
        await asyncio.sleep(seconds)
        used = time.process_time() - cpu
        relayed = (link.cpu_seconds() - relay) / seconds if link else None
        return (before, await runner.stats(), start - t0, stolen_share(ticks, cpu_counters()), used / seconds,
                relayed)

    try:
        done = await asyncio.gather(window(), *[device(d) for d in range(n)])
    finally:
        await runner.close()
    before, after, opened_s, stolen, devices_cpu, link_cpu = done[0]
    devices = done[1:]

    def joined(key: str) -> list:
        return [x for dev in devices for x in dev[key]]

    return Window(seconds, [dev["rounds"] for dev in devices], joined("results"), before, after, opened_s, stolen,
                  devices_cpu, link_cpu, steps=joined("steps"), replies=joined("replies"),
                  drafting=[(dev["drafting"], dev["ends"]) for dev in devices], start=t0 + opened_s,
                  queued=joined("queued"), latencies=joined("latencies"))


def request_latency(asked: float, commits: list[float], tokens: int) -> tuple[float, float]:
    """A request's TTFT (from its start to its first committed tokens) and TPOT, as vLLM defines them: (end-to-end
    − TTFT) / (tokens − 1), nan for a single token. Tokens committed together count as arriving together."""
    ttft = commits[0] - asked
    return ttft, (commits[-1] - commits[0]) / (tokens - 1) if tokens > 1 else float("nan")


def latency_figures(latencies: list[tuple[float, float]]) -> dict:
    """The window's requests (Window.latencies) as row fields, in ms; nan where no request ended inside it."""
    ttft = np.array([t for t, _ in latencies], dtype=float) * 1000
    tpot = np.array([t for _, t in latencies if not np.isnan(t)], dtype=float) * 1000
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    return {"p50_tpot_ms": pct(tpot, 50), "p95_tpot_ms": pct(tpot, 95), "p95_ttft_ms": pct(ttft, 95),
            "requests_timed": len(latencies)}


def summarize(mode, n, w: Window):
    rounds = [x for dev in w.rounds for x in dev]
    itl = np.concatenate([np.repeat(t / max(tok, 1), tok) for _, tok, t in rounds]) if rounds else np.zeros(1)
    per_device = [sum(tok for _, tok, _ in dev) / w.seconds for dev in w.rounds]
    s = summary(w.results)
    drafted = s["drafted"]
    before, after = w.before, w.after
    steps = after.steps - before.steps
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    prefilled = after.prefill_tokens - before.prefill_tokens
    return {
        "mode": mode,
        "devices": n,
        "system_tokens_per_s": sum(per_device),
        "per_device_tokens_per_s": float(np.mean(per_device)),
        "p50_inter_token_ms": float(np.percentile(itl, 50) * 1000),
        "p95_inter_token_ms": float(np.percentile(itl, 95) * 1000),
        "acceptance_rate": s["acceptance_rate"],
        "mean_draft_tokens": s["draft_tokens_per_round"],
        "drafted_ahead_share": sum(r.ahead_tokens for r in w.results) / drafted if drafted else 0.0,
        "requests": len(w.results),
        "server_step_ms": (after.step_seconds_total - before.step_seconds_total) / steps * 1000 if steps else 0.0,
        "server_forward_ms": (
            (after.forward_seconds_total - before.forward_seconds_total) / steps * 1000 if steps else 0.0
        ),
        "server_batch_sessions": (after.verifications - before.verifications) / steps if steps else 0.0,
        "server_busy_share": (after.step_seconds_total - before.step_seconds_total) / w.seconds,
        # Tokens through the forward per step (prefill, and each verification's draft and the token before it), and
        # tokens committed per step: what step_cost_ratio prices at the steps' cost alone.
        "server_step_tokens": (
            (prefilled + after.verifications - before.verifications + after.draft_tokens - before.draft_tokens) / steps
            if steps
            else 0.0
        ),
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
        **latency_figures(w.latencies),
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
