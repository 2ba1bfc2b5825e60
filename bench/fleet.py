"""A fleet of devices and one verify server as a discrete-event model, for what this machine cannot run: SLED against
server-only on a named GPU and target, at device counts no benchmark here reaches.

Devices run requests back to back (a prompt, then `--max-tokens` tokens). A SLED device prefills its drafter, then
drafts at a time per token, drafts ahead while its draft is verified and answers verdicts as the device does: each
decision is the device's own round object (edge_client.round.RoundRules) with its adaptive draft-length controller,
fed what a device measures. Its drafts are the real pair's, replayed as `sled-bench capacity` replays them (the
llama.cpp drafter's proposals recorded along the target's greedy text of each prompt), so a request meets its own
prompt's misses where they fall; a draft not recorded is accepted with a probability by its position in the draft.
A server-only device's session is decoded by the server, a token a step.

The server runs one step at a time over what is waiting: the drafts that arrived (it waits at most its batching window
for every session's draft), sessions it decodes itself, and prompt chunks (up to its token budget). A step costs a fit
of this CPU's measured steps (`--calibrate`: a floor, then a line in tokens), or a roofline for a GPU and a target
shape: the weights and every session's KV read once, or the FLOPs of the step's tokens, whichever takes longer, plus a
launch and, in tensor parallel, two all-reduces a layer. Its KV pool bounds the sessions. Reported per count and mode:
the same rows and capacity list as `sled-bench capacity` (system tok/s, p50/p95 TPOT, p95 TTFT, inter-token gaps).
"""

from __future__ import annotations

import heapq
import random
import shlex
import statistics
from dataclasses import dataclass, field

import numpy as np

from edge_client.adaptive import RoundSample
from edge_client.policy import DraftPolicy
from edge_client.round import RoundRules

from .replay import K_MAX  # the replayed devices' longest draft, as sled-bench capacity runs them


@dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth_gbs: float  # HBM or LPDDR bandwidth, GB/s
    tflops: float  # dense bf16/fp16 tensor TFLOPS
    memory_gb: float
    launch_ms: float = 0.05  # a step's fixed cost at its floor (a CUDA graph's replay, sampling)
    allreduce_us: float = 8.0  # one small all-reduce over NVLink, in tensor parallel


@dataclass(frozen=True)
class Shape:
    name: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16


# Vendors' data sheets (dense tensor throughput, without sparsity).
GPUS = {
    "h200": Gpu("NVIDIA H200 SXM", 4800, 989, 141),
    "l4": Gpu("NVIDIA L4", 300, 121, 24),
}
SHAPES = {
    "llama-8b": Shape("Llama 3.1 8B", 8.03, 32, 8, 128),
    "llama-70b": Shape("Llama 3.1 70B", 70.6, 80, 8, 128),
}


@dataclass(frozen=True)
class LinearCost:
    """A step's seconds as fitted on a machine: the larger of a floor (reading the weights once, what a small step
    costs) and fixed + per token (the arithmetic, once it dominates), plus per session."""
    fixed_s: float
    token_s: float
    session_s: float = 0.0
    floor_s: float = 0.0

    def __call__(self, tokens: int, sessions: int, kv_tokens: int) -> float:
        return max(self.floor_s, self.fixed_s + self.token_s * tokens) + self.session_s * sessions

    def scaled(self, factor: float) -> LinearCost:
        return LinearCost(self.fixed_s * factor, self.token_s * factor, self.session_s * factor,
                          self.floor_s * factor)


@dataclass(frozen=True)
class Roofline:
    """A step at an engine's floor on `tp` GPUs: max(bytes / bandwidth, FLOPs / peak) + launch (+ all-reduces)."""
    gpu: Gpu
    shape: Shape
    tp: int = 1

    def __call__(self, tokens: int, sessions: int, kv_tokens: int) -> float:
        read = (self.shape.weight_bytes + kv_tokens * self.shape.kv_bytes_per_token) / self.tp
        flops = 2 * self.shape.params_b * 1e9 * tokens / self.tp
        step = max(read / (self.gpu.bandwidth_gbs * 1e9), flops / (self.gpu.tflops * 1e12))
        comm = 2 * self.shape.layers * self.gpu.allreduce_us * 1e-6 if self.tp > 1 else 0.0
        return step + self.gpu.launch_ms / 1000 + comm

    def kv_tokens(self, share: float = 0.9) -> int:
        """The KV pool: what `share` of the GPUs' memory holds after the weights."""
        free = self.gpu.memory_gb * 1e9 * self.tp * share - self.shape.weight_bytes
        return max(0, int(free / self.shape.kv_bytes_per_token))


@dataclass(frozen=True)
class Devices:
    draft_s: float  # drafting time per token
    prefill_s: float  # the drafter's prefill per prompt token
    accept: tuple[float, ...]  # chance a drafted token is accepted, by its position, given those before it were
    rtt_s: float = 0.0005  # the link's round trip
    # Per prompt of the workload: the recorded drafts (context length -> proposal) and the target's text, replayed as
    # sled-bench capacity's devices replay them, so a request meets its own prompt's misses where they fall. Drafts
    # not recorded (all, where replay is None) are drawn by position from `accept`.
    replay: tuple[tuple[dict[int, list[int]], list[int]], ...] | None = None

    def accepts(self, position: int) -> float:
        return self.accept[min(position, len(self.accept) - 1)]

    def judge(self, prompt: int, context: int, k: int, rng: random.Random) -> tuple[int, bool]:
        """A draft of k tokens at `context` of the workload's prompt: the tokens the target accepts, and whether the
        drafter's own next token is the target's too (the bonus it drafts ahead from)."""
        table, full = self.replay[prompt % len(self.replay)] if self.replay else ({}, [])
        proposal = table.get(context)
        accepted = 0
        if proposal is None:
            while accepted < k and rng.random() < self.accepts(accepted):
                accepted += 1
            return accepted, accepted == k and rng.random() < self.accepts(k)
        ends = min(k, len(proposal), len(full) - context)
        while accepted < ends and proposal[accepted] == full[context + accepted]:
            accepted += 1
        if accepted < k:
            return accepted, False
        if k < len(proposal) and context + k < len(full):
            return accepted, proposal[k] == full[context + k]
        return accepted, rng.random() < self.accepts(k)  # past what was recorded


@dataclass(frozen=True)
class Server:
    cost: object  # (tokens, sessions, kv_tokens) -> seconds
    kv_tokens: int  # the KV pool, in tokens
    window_s: float = 0.003  # the batching window
    max_batch_tokens: int = 512
    max_batch_sessions: int = 16
    gap_s: float = 0.0  # the host's time between steps (verdicts out, the next batch built), the server idle
    gap_session_s: float = 0.0  # and more for each session in the step


@dataclass(frozen=True)
class Workload:
    prompts: tuple[int, ...]  # prompt lengths, taken in turn
    cached: int  # of each prompt, the tokens the server's prefix cache holds (the chat template's system part)
    tokens: int  # tokens a request

    def slot(self) -> int:
        return max(self.prompts) + self.tokens


def acceptance_by_position(tables: list[dict[int, list[int]]], fulls: list[list[int]], k: int = K_MAX
                           ) -> tuple[float, ...]:
    """From recorded drafts (context length -> the drafter's proposal there) and the target's greedy text: the chance
    that a proposal's token at each position is the target's, given the ones before it were."""
    reached, right = [0] * k, [0] * k
    for table, full in zip(tables, fulls):
        for n, proposal in table.items():
            for i, token in enumerate(proposal[:k]):
                if n + i >= len(full):
                    break
                reached[i] += 1
                if token != full[n + i]:
                    break
                right[i] += 1
    return tuple(right[i] / reached[i] if reached[i] else right[0] / max(reached[0], 1) for i in range(k))


@dataclass
class _Dev:
    rules: RoundRules | None
    rng: random.Random
    prompt: int  # index of the request's prompt
    start: float = 0.0  # the request's start
    done: int = 0  # tokens committed in the request
    commits: list[float] = field(default_factory=list)  # when each round's tokens came
    rounds: list[tuple[float, int]] = field(default_factory=list)  # (gap, tokens) of each round in the window
    prefilled: bool = False
    waiting: bool = False  # a draft is ready but the session's prefill is not done
    carry: int = 0
    offset: float = 0.0
    drafted: int = 0
    round_start: float = 0.0
    sent: float = 0.0
    arrived: float = 0.0
    server: float = 0.0
    sessions: int = 1
    queue: float = 0.0
    step: float = 0.0
    at_once_now: bool = False


class Fleet:
    """One run: `n` devices of `mode` ('sled' or 'server-only') for `seconds` after `warmup_s`."""

    def __init__(self, mode: str, n: int, devices: Devices, workload: Workload, server: Server, seed: int = 0):
        self.mode, self.n, self.d, self.w, self.s = mode, n, devices, workload, server
        self.rng = random.Random(seed)
        policy = DraftPolicy(adaptive=True, max_draft_tokens=K_MAX)  # as sled-bench capacity's devices
        self.devs = [_Dev(RoundRules(policy, policy.controller()) if mode == "sled" else None,
                          random.Random(self.rng.random()), i % len(workload.prompts)) for i in range(n)]
        self.events: list = []
        self.seq = 0
        self.pending: list[int] = []  # devices whose draft waits at the server
        self.prefill: list[list[int]] = []  # [device, prompt tokens left] in arrival order
        self.decoding: dict[int, int] = {}  # server-only sessions the server decodes -> tokens it has made
        self.busy = False
        self.start_at: float | None = None
        self.last_done = 0.0
        self.steps: list[tuple[float, int]] = []
        self.latencies: list[tuple[float, float]] = []
        self.tokens = 0  # committed inside the window
        self.current: tuple[list[int], list[int], list[int]] = ([], [], [])  # the step's drafts, decodes, prompts done
        self.warmup_s, self.end = 0.0, 0.0  # the window, set by run()

    def at(self, t: float, kind: str, d: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, d))

    def context(self, d: int) -> int:
        dev = self.devs[d]
        return self.w.prompts[dev.prompt] + dev.done

    # the device side -----------------------------------------------------------------------------------------------
    def begin_request(self, d: int, now: float) -> None:
        dev = self.devs[d]
        dev.start, dev.done, dev.commits, dev.prefilled, dev.carry = now, 0, [], False, 0
        prompt = self.w.prompts[dev.prompt]
        self.at(now + self.d.rtt_s / 2, "open", d)
        if self.mode == "sled":  # the drafter prefills the prompt (the common prefix kept), then drafts
            self.begin_round(d, now + (prompt - self.w.cached) * self.d.prefill_s)

    def begin_round(self, d: int, now: float) -> None:
        dev = self.devs[d]
        k = dev.rules.draft_length(self.w.tokens - dev.done)
        fresh = max(0, k - dev.carry)
        dev.round_start, dev.drafted, dev.carry = now, k, 0
        dev.at_once_now = False
        self.at(now + fresh * self.d.draft_s, "send", d)

    def commit(self, d: int, now: float, tokens: int) -> bool:
        """Tokens reach the device; True where the request is done (the next one begun)."""
        dev = self.devs[d]
        tokens = min(tokens, self.w.tokens - dev.done)
        if self.warmup_s <= now <= self.end:
            self.tokens += tokens
            gap = now - (dev.commits[-1] if dev.commits else dev.start)
            if dev.commits:
                dev.rounds.append((gap, tokens))
        dev.done += tokens
        dev.commits.append(now)
        if dev.done < self.w.tokens:
            return False
        if self.warmup_s <= now <= self.end:
            ttft = dev.commits[0] - dev.start
            tpot = (dev.commits[-1] - dev.commits[0]) / (dev.done - 1) if dev.done > 1 else float("nan")
            self.latencies.append((ttft, tpot))
        dev.prompt = (dev.prompt + 1) % len(self.w.prompts)
        self.begin_request(d, now)
        return True

    def verdict(self, d: int, now: float) -> None:
        dev, r = self.devs[d], self.d
        k = dev.drafted
        accepted, guessed = r.judge(dev.prompt, self.context(d), k, dev.rng)
        progress = min((now - dev.sent) / r.draft_s + dev.offset, K_MAX + 1.0)  # tokens drafted ahead by now
        dev.offset = 0.0
        resume = now
        if progress < 0:  # still finishing the token an empty draft went out beside
            resume, progress = now - progress * r.draft_s, 0.0
        ctrl = dev.rules.controller
        ctrl_sample = RoundSample(k, accepted, dev.sent - dev.round_start, now - dev.sent, dev.server, r.draft_s,
                                  dev.sessions, None, dev.step, dev.queue, dev.at_once_now,
                                  committed=min(accepted + 1, self.w.tokens - dev.done),
                                  cycle_s=now - dev.commits[-1] if dev.commits else None)
        dev.rules.verdict_came()
        ctrl.observe(ctrl_sample)
        if self.commit(d, now, accepted + 1):
            return
        made = int(progress)
        busy = made < K_MAX + 1
        if busy and progress > made:
            made += 1
            resume = max(resume, now + (made - progress) * r.draft_s)
        room = self.w.tokens - dev.done
        n = dev.rules.answer(dev.rules.draft_length(room), hit=guessed, ahead=max(int(progress) - 1, 0), busy=busy)
        if n is not None:  # answered at once with what was drafted ahead (or empty after a miss)
            dev.round_start, dev.drafted, dev.carry, dev.at_once_now = now, n, 0, True
            dev.offset = progress - 1 - n if n else -(resume - now) / r.draft_s
            self.at(now, "send", d)
            return
        if guessed and made > 1:
            dev.carry = made - 1
        self.begin_round(d, resume)
        dev.at_once_now = resume == now

    # the server side -----------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> None:
        if self.busy:
            return
        if self.prefill or self.decoding:
            t = now
        elif self.pending:
            rounds = sum(1 for dev in self.devs if dev.prefilled)
            oldest = min(self.devs[p].arrived for p in self.pending)
            t = now if len(self.pending) >= rounds else max(now, oldest + self.s.window_s)
        else:
            return
        if self.start_at is None or t < self.start_at:
            self.start_at = t
            self.at(t, "start")

    def step(self, now: float) -> None:
        self.start_at = None
        batch = self.pending[:self.s.max_batch_sessions]
        self.pending = self.pending[len(batch):]
        decode = list(self.decoding)[:self.s.max_batch_sessions]
        for p in decode:  # taken in turn past max_batch_sessions; a session ends at the request's last token
            made = self.decoding.pop(p) + 1
            if made < self.w.tokens:
                self.decoding[p] = made
        tokens = sum(self.devs[p].drafted + 1 for p in batch) + len(decode)
        budget = max(self.s.max_batch_tokens - tokens, 16 if self.prefill else 0)
        chunks = []
        for item in self.prefill:
            if budget <= 0:
                break
            take = min(item[1], budget)
            chunks.append((item[0], take))
            item[1] -= take
            budget -= take
            tokens += take
        kv = sum(self.context(p) for p in batch + decode)
        cost = self.s.cost(tokens, len(batch) + len(decode) + len(chunks), kv)
        for p in batch:
            dev = self.devs[p]
            dev.queue, dev.step = max(0.0, self.last_done - dev.arrived), cost
        self.steps.append((cost, tokens))
        del self.steps[:-16]
        self.busy = True
        self.current = (batch, decode, [d for d, _ in chunks if not any(i[0] == d and i[1] for i in self.prefill)])
        self.prefill = [i for i in self.prefill if i[1] > 0]
        self.at(now + cost, "done")

    def token_cost(self) -> float:
        tokens = [t for _, t in self.steps]
        if len(set(tokens)) < 2:
            return 0.0
        return max(statistics.linear_regression(tokens, [s for s, _ in self.steps]).slope, 0.0)

    def step_done(self, now: float) -> None:
        self.last_done = now
        sessions = len(self.current[0]) + len(self.current[1])
        self.at(now + self.s.gap_s + self.s.gap_session_s * sessions, "free")
        batch, decode, prefilled = self.current
        c = self.token_cost()
        for p in batch:
            self.devs[p].server, self.devs[p].sessions = c, len(batch)
            self.at(now + self.d.rtt_s / 2, "verdict", p)
        for p in decode:
            self.at(now + self.d.rtt_s / 2, "token", p)
        for p in prefilled:
            dev = self.devs[p]
            dev.prefilled = True
            if self.mode == "server-only":
                self.at(now + self.d.rtt_s / 2, "token", p)  # the prompt's last logits give the first token
            elif dev.waiting:
                dev.waiting = False
                self.pending.append(p)

    def run(self, seconds: float, warmup_s: float) -> dict:
        self.warmup_s, self.end = warmup_s, warmup_s + seconds
        for d in range(self.n):
            self.begin_request(d, 0.0005 * self.rng.random())
        while self.events:
            now, _, kind, d = heapq.heappop(self.events)
            if now > self.end:
                break
            dev = self.devs[d] if d >= 0 else None
            if kind == "open":
                self.prefill.append([d, self.w.prompts[dev.prompt] - self.w.cached])
                self.schedule(now)
            elif kind == "send":
                dev.sent = now
                self.at(now + self.d.rtt_s / 2, "arrive", d)
            elif kind == "arrive":
                dev.arrived = now
                if dev.prefilled:
                    self.pending.append(d)
                else:
                    dev.waiting = True
                self.schedule(now)
            elif kind == "start":
                if not self.busy and self.start_at is not None and now >= self.start_at:
                    self.step(now)
            elif kind == "done":
                if self.mode == "server-only":
                    for p in self.current[2]:
                        if self.w.tokens > 1:
                            self.decoding[p] = 1  # the first token came with the prompt
                self.step_done(now)
            elif kind == "free":
                self.busy = False
                self.schedule(now)
            elif kind == "verdict":
                self.verdict(d, now)
            elif kind == "token":
                self.commit(d, now, 1)
        return self.row(seconds)

    def row(self, seconds: float) -> dict:
        gaps = [g / t for dev in self.devs for g, t in dev.rounds for _ in range(t)]
        ttft = [t * 1000 for t, _ in self.latencies]
        tpot = [t * 1000 for _, t in self.latencies if t == t]
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
        return {"mode": self.mode, "devices": self.n, "system_tokens_per_s": self.tokens / seconds,
                "p50_tpot_ms": pct(tpot, 50), "p95_tpot_ms": pct(tpot, 95), "p95_ttft_ms": pct(ttft, 95),
                "p50_inter_token_ms": pct(gaps, 50) * 1000, "p95_inter_token_ms": pct(gaps, 95) * 1000,
                "requests_timed": len(self.latencies)}


# Devices that draft, by their drafting time per token; prefill per prompt token is PREFILL_SHARE of it.
DEVICE_PROFILES = {
    # Jetson Orin Nano Super 8GB at 25 W, llama.cpp CUDA: LFM2.5-1.2B at 54.1 tok/s (smolhub.com, "Tiny LLM
    # Benchmark: Jetson Orin Nano Super 8GB", June 2026)
    "Jetson Orin Nano": 1000 / 54.1,
    # Raspberry Pi 5: decoding is bandwidth-bound; a 1B drafter at Q4 (about 0.75 GB read a token) over the 11.4 GB/s
    # a Pi 5 sustains (hellomatik.com, "Pushing Four Raspberry Pis to the Limit", May 2026)
    "Raspberry Pi 5": 0.75 / 11.4 * 1000,
}
# llama.cpp's prefill per prompt token against a drafting step, as measured on this host's CPU (prompt tokens go
# through in batches)
PREFILL_SHARE = 0.4
SCENARIOS = {  # name -> (GPU, target shape, tensor-parallel degree)
    "H200, Llama 3.1 8B": ("h200", "llama-8b", 1),
    "4x H200, Llama 3.1 70B (TP 4)": ("h200", "llama-70b", 4),
    "L4, Llama 3.1 8B": ("l4", "llama-8b", 1),
}
COUNTS = tuple(2 ** i for i in range(13))  # 1 .. 4096, then bisected to within REFINE of the count met
REFINE = 1 / 16


def capacity(devices: Devices, workload: Workload, server_for, slo: dict[str, float], seconds: float,
             counts=COUNTS, refine: float = REFINE, log=None) -> tuple[list[dict], list[dict]]:
    """Counts rise until both modes miss the target or the KV pool cannot hold the sessions, then each mode's gap
    between its last count met and its first missed is bisected, as sled-bench capacity searches them; `server_for(n)`
    is the server for n devices. Returns the rows and each mode's capacity, as sled-bench capacity does."""
    from .capacity import CountSearch

    rows, search = [], CountSearch(counts, ("sled", "server-only"), refine)
    while (step := search.next()) is not None:
        n, active = step
        server = server_for(n)
        if n * workload.slot() > server.kv_tokens:
            for mode in active:
                search.record(mode, n, None, "kv memory")
            continue
        for mode in active:
            row = Fleet(mode, n, devices, workload, server).run(seconds, warmup_s=min(5.0, seconds / 2))
            rows.append(row)
            if log:
                log(row)
            search.record(mode, n, row, None if all(row[k] <= v for k, v in slo.items()) else "slo")
    return sorted(rows, key=lambda r: r["devices"]), search.capacity(slo)


def fit_cost(rows: list[dict]) -> LinearCost:
    """Over every step size the rows report (server_step_sizes: tokens, steps, mean ms), each weighted by its steps:
    a floor up to a knee and a non-negative line past it, the knee where the squared error is least (no knee: the
    line alone). Over the rows' mean steps, fixed + per token + per session, where none reports sizes."""
    from scipy.optimize import nnls

    sizes = [s for r in rows for s in r.get("server_step_sizes") or ()]
    if sizes:
        t, n, ms = (np.array(c, dtype=float) for c in zip(*sizes))
        y = ms / 1000
        best: tuple[float, LinearCost] | None = None
        for knee in [0.0, *sorted(set(t))[:-2]]:  # at least two sizes past the knee for the line
            low, high = t <= knee, t > knee
            floor = float(np.average(y[low], weights=n[low])) if low.any() else 0.0
            w = np.sqrt(n[high])
            (fixed, token), _ = nnls(np.stack([np.ones(high.sum()), t[high]], 1) * w[:, None], y[high] * w)
            cost = LinearCost(float(fixed), float(token), 0.0, floor)
            error = float(np.sum(n * (np.array([cost(x, 0, 0) for x in t]) - y) ** 2))
            if best is None or error < best[0]:
                best = (error, cost)
        return best[1]
    use = [r for r in rows if r.get("server_step_ms")]
    a = np.array([[1.0, r["server_step_tokens"], r["server_batch_sessions"]] for r in use])
    b = np.array([r["server_step_ms"] / 1000 for r in use])
    (fixed, token, session), _ = nnls(a, b)
    return LinearCost(float(fixed), float(token), float(session))


def speed_of(row: dict, cost: LinearCost) -> float:
    """How slowly the host ran a row's steps against the fit (its steps' time over the fit's, weighted by steps; 1
    where the row reports no sizes): a shared host's speed drifts between the counts of one run."""
    sizes = row.get("server_step_sizes") or ()
    fitted = sum(n * cost(t, 0, 0) * 1000 for t, n, _ in sizes)
    return sum(n * ms for _, n, ms in sizes) / fitted if fitted else 1.0


def fit_gap(rows: list[dict]) -> tuple[float, float]:
    """The host's time between steps, fixed and a session, from server-only rows: their server is never idle for
    want of drafts, so what their steps leave of the window is that gap (a least-squares line over the rows' mean
    sessions a step)."""
    from scipy.optimize import nnls

    use = [r for r in rows if r["mode"] == "server-only" and r.get("server_busy_share") and r.get("server_step_ms")]
    if not use:
        return 0.0, 0.0
    gaps = np.array([r["server_step_ms"] / 1000 * (1 / r["server_busy_share"] - 1) for r in use])
    if len(use) == 1:
        return max(0.0, float(gaps[0])), 0.0
    (fixed, session), _ = nnls(np.array([[1.0, r["server_batch_sessions"]] for r in use]), gaps)
    return float(fixed), float(session)


def workload_of(ids: list[list[int]], tokens: int) -> Workload:
    from edge_client.drafters.kv_drafter import common_prefix

    cached = min(common_prefix(ids[0], i) for i in ids[1:]) if len(ids) > 1 else 0
    return Workload(tuple(len(i) for i in ids), cached, tokens)


def build_parser():
    import argparse

    from .cli import counts_arg, positive

    def targets(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated milliseconds, got {text!r}") from None
        if not all(v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"targets must be above 0 ms, got {text!r}")
        return values

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibrate-devices", type=counts_arg, default=counts_arg("1,2,4,8,16"), metavar="N,N,...",
                   help="device counts of the calibration: sled-bench capacity's run on this CPU, with the model's "
                        "prediction of each count beside it (default 1,2,4,8,16)")
    p.add_argument("--calibrate-repeats", type=positive(int), default=3,
                   help="passes of each calibration count, the pass with the median p95 TPOT kept (default 3)")
    p.add_argument("--max-tokens", type=positive(int), default=64, help="tokens a request (default 64)")
    p.add_argument("--seconds", type=positive(), default=8.0,
                   help="the measured window of each calibration run (default 8); the model runs 60 s")
    p.add_argument("--slo-tpot-ms", type=targets, default=targets("20,50"),
                   help="p95 TPOT targets of the scenarios, comma-separated (default 20,50)")
    p.add_argument("--slo-ttft-ms", type=positive(), default=2000.0, help="p95 TTFT target (default 2000)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", default=None, help="the file whose section is rewritten (default docs/benchmarks.md)")
    return p


MARKER = "## Fleet model: capacity on GPUs, calibrated on this CPU"
GOAL_ERROR = 0.15  # the calibration's goal: every prediction within this of the measurement


def report(args, drafting, cost: LinearCost, gap: tuple[float, float], accept, workload: Workload, check: list[dict],
           scenarios: list[dict]) -> str:
    import sys
    from datetime import datetime, timezone

    from .report import machine

    worst = max(abs(e) for c in check for e in c["error"].values())
    lines = ["| devices | mode | steps / fit | tok/s measured | modelled | error | p95 TPOT ms measured | modelled | error |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in check:
        me, mo, er = c["measured"], c["modelled"], c["error"]
        lines.append(f"| {c['devices']} | {c['mode']} | {c['speed']:.2f}x | {me['system_tokens_per_s']:.0f} | "
                     f"{mo['system_tokens_per_s']:.0f} | {er['system_tokens_per_s']:+.1%} | {me['p95_tpot_ms']:.1f} | "
                     f"{mo['p95_tpot_ms']:.1f} | {er['p95_tpot_ms']:+.1%} |")
    scen = ["| server | devices (drafting ms/token) | p95 TPOT target | SLED devices | server-only devices | "
            "SLED / server-only | what stopped each |", "|---|---|---:|---:|---:|---:|---|"]
    for sc in scenarios:
        sled, base = sc["capacity"]
        vs = f"{sled['devices'] / base['devices']:.2f}x" if base["devices"] else "—"
        scen.append(f"| {sc['scenario']} | {sc['devices']} ({sc['draft_ms']:.1f}) | {sc['slo']['p95_tpot_ms']:g} ms | "
                    f"{sled['devices']} | {base['devices']} | {vs} | {sled['bound']}, {base['bound']} |")
    return (
        f"{MARKER}\n\n`sled-bench fleet {shlex.join(sys.argv[2:])}` on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}. Modelled, not measured, except the calibration's "
        "measured columns.\n\n"
        f"- calibration: `sled-bench capacity`'s run on this CPU ({args.calibrate_repeats} passes a count, the median "
        f"p95 TPOT's kept, {args.seconds:g} s windows; the "
        f"real pair's drafts replayed at {drafting.ms_per_token:.2f} ms/token, prefill "
        f"{drafting.prefill_ms_per_token:.2f} ms a prompt token), and the model of each count beside it, with the "
        "step cost fitted on that run's steps by size: "
        + (f"the larger of {cost.floor_s * 1000:.2f} ms and " if cost.floor_s else "")
        + f"{cost.fixed_s * 1000:.2f} ms + {cost.token_s * 1000:.3f} ms a token, "
        f"+ {cost.session_s * 1000:.3f} ms a session, scaled at each count by its own steps' time over the fit's "
        f"({min(c['speed'] for c in check):.2f}x to {max(c['speed'] for c in check):.2f}x: a shared host's speed "
        f"drifts between the counts of a run), and {gap[0] * 1000:.2f} ms + {gap[1] * 1000:.3f} ms a session of "
        "the host's between steps (what server-only's steps leave of its windows); the model's devices replay the "
        "same recorded drafts along each prompt's text (acceptance by position over them: "
        + ", ".join(f"{a:.3f}" for a in accept) + ")\n"
        f"- the largest error is {worst:.1%}: the goal, at most {GOAL_ERROR:.0%}, is "
        f"{'met' if worst <= GOAL_ERROR else 'not met'}\n\n" + "\n".join(lines) + "\n\n"
        "Scenarios: the roofline of each server (weights and KV read once a step, or the step's FLOPs, whichever is "
        "longer, plus a launch, and two all-reduces a layer in tensor parallel), the same for SLED and server-only "
        "(server-only on an engine at its floor); bf16 weights and KV, the KV pool 90% of the GPUs' memory after the "
        f"weights; requests of {workload.tokens} tokens after this workload's prompts; a 20 ms link round trip; the "
        "real pair's drafts replayed as above; p95 TTFT within "
        f"{args.slo_ttft_ms:g} ms; counts double from 1 until both modes miss the target, then each mode's are "
        f"bisected between its last count met and its first missed to within {REFINE:.0%} of the count met.\n\n"
        + "\n".join(scen) + "\n")


def main(args) -> int:
    from pathlib import Path

    from . import capacity as measured
    from .options import check_system_args
    from .report import publish
    from .runner import prompts
    from .system import measure_drafting
    from .tokenizers import device_tokenizer

    counts, slos = args.calibrate_devices, args.slo_tpot_ms
    cargs = measured.build_parser().parse_args(["--devices", ",".join(map(str, counts)),
                                                "--repeats", str(args.calibrate_repeats),
                                                "--max-tokens", str(args.max_tokens), "--seconds", str(args.seconds),
                                                "--slo-tpot-ms", "1e9", "--slo-ttft-ms", "1e9"])
    check_system_args(cargs)
    tokenizer = device_tokenizer(None)
    ids = prompts(tokenizer, cargs.recordings)
    drafting = measure_drafting(cargs, ids)
    print(f"[fleet] calibration: devices draft at {drafting.ms_per_token:.2f} ms/token; measuring {counts} ...",
          flush=True)
    recorded: list = []
    rows, _, _ = measured.sweep(cargs, tokenizer, ids, drafting, recorded=recorded)
    tables, fulls, _ = recorded[0]
    accept = acceptance_by_position(tables, fulls)
    cost, gap = fit_cost(rows), fit_gap(rows)
    workload = workload_of(ids, args.max_tokens)
    replay = tuple(zip(tables, fulls))
    here = Devices(drafting.ms_per_token / 1000, drafting.prefill_ms_per_token / 1000, accept, replay=replay)
    check = []
    for r in rows:
        n = r["devices"]
        speed = speed_of(r, cost)
        server = Server(cost.scaled(speed), 10 ** 9, cargs.max_wait_ms / 1000, max(512, n * 10), n, *gap)
        m = Fleet(r["mode"], n, here, workload, server).run(60.0, 5.0)
        err = {k: m[k] / r[k] - 1 for k in ("system_tokens_per_s", "p95_tpot_ms")}
        check.append({"devices": n, "mode": r["mode"], "speed": speed, "measured": {k: r[k] for k in err},
                      "modelled": {k: m[k] for k in err}, "error": err})
        print(f"[fleet] {n} {r['mode']}: measured {r['system_tokens_per_s']:.0f} tok/s, p95 TPOT "
              f"{r['p95_tpot_ms']:.1f} ms; modelled {m['system_tokens_per_s']:.0f} tok/s, {m['p95_tpot_ms']:.1f} ms",
              flush=True)
    scenarios = []
    for name, (gpu, shape, tp) in SCENARIOS.items():
        roof = Roofline(GPUS[gpu], SHAPES[shape], tp)
        for profile, draft_ms in DEVICE_PROFILES.items():
            dev = Devices(draft_ms / 1000, PREFILL_SHARE * draft_ms / 1000, accept, rtt_s=0.02, replay=replay)
            for slo in slos:
                target = {"p95_tpot_ms": slo, "p95_ttft_ms": args.slo_ttft_ms}
                srv = lambda n: Server(roof, roof.kv_tokens(), 0.003, max(512, n * 10), n)  # noqa: E731
                _, caps = capacity(dev, workload, srv, target, 10.0)
                scenarios.append({"scenario": name, "devices": profile, "draft_ms": draft_ms, "slo": target,
                                  "capacity": caps, "kv_tokens": roof.kv_tokens(),
                                  "step_ms_1": roof(1, 1, workload.slot()) * 1000})
                sled, base = caps
                print(f"[fleet] {name}, {profile}, TPOT {slo:g} ms: SLED {sled['devices']} ({sled['bound']}), "
                      f"server-only {base['devices']} ({base['bound']})", flush=True)
    section = report(args, drafting, cost, gap, accept, workload, check, scenarios)
    print("\n" + section)
    publish(args.markdown or str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"), MARKER,
            section, args.json, {"calibration": check, "cost": cost.__dict__, "gap_s": gap, "accept": accept,
                                 "measured": rows, "scenarios": scenarios})
    return 0
