"""A discrete-event model of N devices and one batching verify server, to test the draft-length controller.

    sled-bench sim-rounds --devices 4,16,32 --step-fixed-ms 50 --step-token-ms 0.05 --draft-ms 16.8

The server runs one step at a time: it starts when every device's draft is waiting or the oldest has waited
`max_wait_ms`, verifies all that wait, and takes `fixed + per_token * tokens` (a launch-bound GPU: a large fixed
part; a CPU: a large per-token part). Each device drafts at `draft_ms` per token, each drafted token right with
probability `match` (independently, as the target's greedy text is fixed), drafts ahead while its draft is
verified (finishing the token in progress when the verdict comes, as a device does with a fixed K or
`answer_at_once=False`; with `--at-once`, an adaptive device answers as a device does by default: a hit at once
with the tokens drafted ahead, K at most, a miss with an empty draft, neither while the server queues its drafts),
each decision taken by the device's own round rules (edge_client.round.RoundRules), and chooses K with the real
edge_client.adaptive controller, fed what a device measures and its verdicts report (the step's time,
sessions and token cost, and how long the draft waited through earlier steps). The figures are the model's, not a
measurement: the point is the controller's choice against fixed K under the same model, fast and repeatable.

With `--confidence`, each drafted token also carries the drafter's confidence, drawn from a mix of kinds (share,
confidence, chance it is right), and the controller's confidence stop rule ends drafts as on a device: it is asked
before a token is drafted now, and again, with the token's confidence, whether each drafted token goes out.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field

from edge_client.adaptive import RoundSample
from edge_client.policy import EMPTY_AFTER_MISS, DraftLength, DraftPolicy
from edge_client.round import RoundRules

from .cli import counts_arg, positive


@dataclass(frozen=True)
class Regime:
    step_fixed_s: float  # a step's cost at zero tokens
    step_token_s: float  # and per verified token
    draft_s: float  # a device's drafting time per token
    match: float = 0.98  # probability that a drafted token is the target's
    max_wait_s: float = 0.003  # the server's batching window
    net_s: float = 0.0005  # one way
    step_session_s: float = 0.0  # and per session in the step (per-segment launches and bookkeeping)
    # The drafter's tokens as kinds (share, confidence, chance the token is right), or None: no confidence, each
    # token right with probability `match`.
    confidence: tuple[tuple[float, float, float], ...] | None = None

    def draw(self, rng: random.Random) -> tuple[float, bool]:
        """One drafted token's confidence and whether it is the target's."""
        x = rng.random()
        for share, sure, right in self.confidence:
            if x < share:
                return sure, rng.random() < right
            x -= share
        sure, right = self.confidence[-1][1:]
        return sure, rng.random() < right


@dataclass
class _Device:
    rules: RoundRules  # the device's own round rules and draft-length controller (fixed K or adaptive)
    rng: random.Random
    carry: int = 0  # tokens drafted ahead that continue the committed context
    offset: float = 0.0  # tokens already drafted ahead past the draft out now when it went out (answered at once)
    tokens: int = 0  # committed inside the measured window
    round_start: float = 0.0
    sent: float = 0.0
    drafted: int = 0
    server: float = 0.0  # the server's marginal token cost, as its last verdict reported it
    sessions: int = 1  # sessions in the step that verified its last draft
    arrived: float = 0.0  # when its draft reached the server
    queue: float = 0.0  # how long that draft waited through earlier steps (the server's Verdict.queue_ms)
    step: float = 0.0  # and that step's time
    ks: list[int] = field(default_factory=list)
    at_once: int = 0  # rounds sent at a verdict's arrival with what was drafted ahead
    prompt: bool = False  # whether the draft out now went out at once when its verdict came (RoundSample.prompt)
    # With confidence: the drafter's tokens past the committed context as (confidence, right), drawn as needed;
    # the same tokens whether drafted now or ahead, until a verdict corrects the text.
    upcoming: list[tuple[float, bool]] = field(default_factory=list)
    sure: tuple[float, ...] | None = None  # the confidence of each token in the draft out now
    last: float | None = None  # when its last verdict came

    @property
    def ctrl(self) -> DraftLength:
        return self.rules.controller


# The devices' first drafts go out within this share of a token's drafting time of one another, as in the system
# benchmark, where every device opens its first request at once. Spread over a whole token (the earlier form), most
# first drafts reached the server during a step, waited, and, under the queue rule, the devices kept finishing their
# drafts at 4 devices on this machine's CPU server (2% of rounds answered at once; 26% since the rule counts only the
# drafts sent at once: each device's own tries cannot undo the others' late drafts), where the benchmark's devices
# answer at once (7-9% of drafts queued).
START_SPREAD = 0.1


def simulate(regime: Regime, devices: int, k: int | None, seconds: float = 30.0, warmup_s: float = 3.0,
             k_max: int = 8, ahead: bool = True, seed: int = 0, confidence_stop: bool = True,
             at_once: bool = False, empty_after_miss: float | None = EMPTY_AFTER_MISS) -> dict:
    """Committed tokens per second of `devices` devices over `seconds` after `warmup_s`, with fixed K = k or the
    adaptive controller (k=None; its confidence stop rule used where the regime has confidence, unless
    confidence_stop is off). With at_once, an adaptive device answers a verdict as a device does by default
    (RoundRules.answer): after a hit whose tokens drafted ahead reach past the bonus, those tokens (K at most) go out at once
    while the drafter finishes its token; after a miss that comes while it drafts ahead, an empty draft (the
    server's token alone) goes out at once where the controller's acceptance is at least `empty_after_miss` (None:
    never); otherwise it finishes that token and drafts the rest of K (a fixed K always does). Neither while the
    server queues the device's drafts (AdaptiveDraftLength.server_queues: most recent drafts sent at once
    waited through an earlier step), where the device finishes its token and drafts K. Needs a regime without
    confidence."""
    if at_once and regime.confidence is not None:
        raise ValueError("at_once is modelled for drafts without confidence only")
    r = regime
    rng = random.Random(seed)
    policy = DraftPolicy(draft_tokens=k_max if k is None else k, adaptive=k is None, max_draft_tokens=k_max,
                         draft_ahead=ahead, confidence_stop=confidence_stop, answer_at_once=at_once,
                         empty_after_miss=empty_after_miss)
    devs = [_Device(RoundRules(policy, policy.controller()), random.Random(rng.random())) for _ in range(devices)]
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def at(t, kind, d=-1):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, d))

    pending: list[tuple[float, int]] = []  # (arrival, device) of the drafts waiting for a step
    busy_until = None  # end of the step in progress
    start_at = None  # a step scheduled to start
    last_steps: list[tuple[float, int]] = []  # (seconds, tokens) of recent steps

    def begin_round(d: int, now: float, prompt: bool = False) -> None:
        dev = devs[d]
        kk = dev.ctrl.k
        if r.confidence is None:
            fresh = max(0, kk - dev.carry)
        else:
            rule = dev.ctrl.stop_rule()
            fresh, taken = 0, 0
            for i in range(kk):
                while len(dev.upcoming) <= i:
                    dev.upcoming.append(r.draw(dev.rng))
                if i >= dev.carry:  # drafted now (its confidence known once it is), if worth drafting
                    if rule is not None and i and not rule.more():
                        break
                    fresh += 1
                if rule is not None and not rule.take(dev.upcoming[i][0]):
                    break
                taken += 1
            kk = taken
            dev.sure = tuple(c for c, _ in dev.upcoming[:kk])
        dev.round_start, dev.drafted = now, kk
        dev.ks.append(kk)
        dev.carry = 0
        dev.prompt = prompt and fresh == 0
        at(now + fresh * r.draft_s, "send", d)

    def schedule(now: float) -> None:
        nonlocal start_at
        if busy_until is not None or not pending:
            return
        t = now if len(pending) == devices else max(now, min(a for a, _ in pending) + r.max_wait_s)
        if start_at is None or t < start_at:
            start_at = t
            at(t, "start")

    def token_cost() -> float:
        # The server's marginal cost of a token, as it reports it: the slope of step time over step tokens.
        tokens = [n for _, n in last_steps]
        if len(set(tokens)) < 2:
            return r.step_token_s
        return max(statistics.linear_regression(tokens, [s for s, _ in last_steps]).slope, 0.0)

    for d in range(devices):
        begin_round(d, START_SPREAD * rng.random() * r.draft_s)
    end = warmup_s + seconds
    batch: list[int] = []
    last_done = 0.0  # when the last step ended
    while events:
        now, _, kind, d = heapq.heappop(events)
        if now > end:
            break
        if kind == "send":
            devs[d].sent = now
            at(now + r.net_s, "arrive", d)
        elif kind == "arrive":
            devs[d].arrived = now
            pending.append((now, d))
            schedule(now)
        elif kind == "start":
            if start_at is None or now < start_at or busy_until is not None:
                continue
            start_at = None
            batch = [dv for _, dv in pending]
            pending.clear()
            tokens = sum(devs[dv].drafted + 1 for dv in batch)
            cost = r.step_fixed_s + r.step_token_s * tokens + r.step_session_s * len(batch)
            for dv in batch:  # the wait that fell on earlier steps (not on the batching window)
                devs[dv].queue, devs[dv].step = max(0.0, last_done - devs[dv].arrived), cost
            last_steps.append((cost, tokens))
            del last_steps[:-16]
            busy_until = now + cost
            at(busy_until, "done")
        elif kind == "done":
            busy_until, last_done = None, now
            c = token_cost()
            for dv in batch:
                at(now + r.net_s, "verdict", dv)
                devs[dv].server = c
                devs[dv].sessions = len(batch)
            batch = []
            schedule(now)
        elif kind == "verdict":
            dev = devs[d]
            kk = dev.drafted
            accepted = 0
            if r.confidence is None:
                while accepted < kk and dev.rng.random() < r.match:
                    accepted += 1
            else:
                while accepted < kk and dev.upcoming[accepted][1]:
                    accepted += 1
            # Drafting ahead from `sent`: tokens made by now, the one in progress finished before going on.
            made = 0
            resume = now
            progress = min((now - dev.sent) / r.draft_s + dev.offset, k_max + 1.0)  # tokens ahead, the last in part
            dev.offset = 0.0
            if progress < 0:  # still finishing the token an empty draft went out beside (below)
                resume, progress = now - progress * r.draft_s, 0.0

            def sample() -> RoundSample:  # what the device's controller learns from this round
                return RoundSample(kk, accepted, dev.sent - dev.round_start, now - dev.sent, dev.server, r.draft_s,
                                   dev.sessions, dev.sure, dev.step, dev.queue, dev.prompt, committed=accepted + 1,
                                   cycle_s=None if dev.last is None else now - dev.last)

            # The device's own rules decide (edge_client.round.RoundRules): whether this verdict is answered at once,
            # from the rounds before it; then, with this round learnt, how.
            dev.rules.verdict_came()
            # Without confidence: whether the verdict's bonus token is the drafter's own next one (a hit).
            guessed = r.confidence is None and accepted == kk and dev.rng.random() < r.match
            dev.ctrl.observe(sample())
            dev.last = now
            if ahead:
                made = int(progress)
                busy = made < k_max + 1  # the drafter is on a token drafted ahead when the verdict comes
                if busy and progress > made:
                    made += 1
                    resume = max(resume, now + (made - progress) * r.draft_s)
                n = dev.rules.answer(dev.ctrl.k, hit=guessed, ahead=max(int(progress) - 1, 0), busy=busy)
                if n is not None:
                    # Answered at once. A hit: the tokens done past the bonus go out now, K at most; the rest, and the
                    # token in progress, are where the drafting ahead of this new draft stands. A miss: an empty draft
                    # (the server's token alone); the drafter finishes its token, drops what the verdict corrected,
                    # and drafts ahead from the new context.
                    if warmup_s <= now:
                        dev.tokens += accepted + 1
                    dev.round_start, dev.drafted = now, n
                    dev.ks.append(n)
                    dev.at_once += 1
                    dev.carry = 0
                    dev.prompt = True
                    dev.offset = progress - 1 - n if n else -(resume - now) / r.draft_s
                    at(now, "send", d)
                    continue
            if r.confidence is None:
                if guessed and made > 1:
                    dev.carry = made - 1
            else:
                # The bonus token is the drafter's next one when that was right: its tokens past it stand, and
                # those drafted ahead go out next. Any other verdict corrects the text: the drafter starts afresh.
                while len(dev.upcoming) <= kk:
                    dev.upcoming.append(r.draw(dev.rng))
                if accepted == kk and dev.upcoming[kk][1]:
                    dev.upcoming = dev.upcoming[kk + 1:]
                    dev.carry = max(made - 1, 0)
                else:
                    dev.upcoming = []
            if warmup_s <= now:
                dev.tokens += accepted + 1
            begin_round(d, resume, prompt=resume == now)  # at once where nothing is left to finish or draft
    total = sum(dv.tokens for dv in devs)
    ks = [x for dv in devs for x in dv.ks]
    return {"devices": devices, "k": "adaptive" if k is None else k, "system_tokens_per_s": total / seconds,
            "mean_k": sum(ks) / len(ks), "answered_at_once": sum(dv.at_once for dv in devs) / len(ks)}


def compare(regime: Regime, devices: int, seconds: float = 30.0, seed: int = 0, at_once: bool = False) -> dict:
    """Adaptive and fixed K = 2, 4, 8 under one regime: tokens/s of each and adaptive / best fixed."""
    rows = {k: simulate(regime, devices, k, seconds, seed=seed, at_once=at_once and k is None)
            for k in (2, 4, 8, None)}
    best = max((k for k in rows if k is not None), key=lambda k: rows[k]["system_tokens_per_s"])
    return {"rows": rows, "best_fixed": best,
            "ratio": rows[None]["system_tokens_per_s"] / rows[best]["system_tokens_per_s"]}


def confidence_arg(text: str) -> tuple[tuple[float, float, float], ...]:
    """--confidence: kinds of drafted token, SHARE:CONF:RIGHT each, the shares adding up to 1."""
    try:
        kinds = tuple(tuple(float(x) for x in kind.split(":")) for kind in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be SHARE:CONF:RIGHT,..., got {text!r}") from None
    if any(len(kind) != 3 or not all(0 <= x <= 1 for x in kind) for kind in kinds):
        raise argparse.ArgumentTypeError("each kind is three numbers in [0, 1], SHARE:CONF:RIGHT")
    if abs(sum(kind[0] for kind in kinds) - 1) > 1e-6:
        raise argparse.ArgumentTypeError("the shares must add up to 1")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=counts_arg, default=counts_arg("1,4,16,32"), help="device counts "
                                                                                      "(default 1,4,16,32)")
    p.add_argument("--step-fixed-ms", type=float, default=50.0, help="a step's cost at zero tokens (default 50)")
    p.add_argument("--step-token-ms", type=float, default=0.05, help="a step's cost per token (default 0.05)")
    p.add_argument("--step-session-ms", type=float, default=0.0, help="a step's cost per session (default 0)")
    p.add_argument("--draft-ms", type=positive(), default=16.8, help="drafting time per token (default 16.8)")
    p.add_argument("--match", type=float, default=0.98, help="probability a drafted token is right (default 0.98)")
    p.add_argument("--seconds", type=positive(), default=30.0, help="simulated seconds per run (default 30)")
    p.add_argument("--at-once", action="store_true",
                   help="adaptive devices answer a verdict at once, as a device does by default (a hit with what was "
                        "drafted ahead, a miss with an empty draft, unless the server queues their drafts); without "
                        "it they finish the token in progress and draft the rest of K first")
    p.add_argument("--confidence", type=confidence_arg, metavar="SHARE:CONF:RIGHT,...",
                   help="drafted tokens as kinds, e.g. 0.75:0.9:0.99,0.25:0.3:0.75 (instead of --match): the stop "
                        "rule then ends drafts on the drafter's confidence")
    return p


def main(args) -> int:
    fail = argparse.ArgumentParser(prog="sled-bench sim-rounds").error
    if min(args.step_fixed_ms, args.step_token_ms, args.step_session_ms) < 0:
        fail("--step-fixed-ms, --step-token-ms and --step-session-ms must not be negative")
    if args.at_once and args.confidence is not None:
        fail("--at-once is modelled for drafts without --confidence only")
    if not 0 <= args.match <= 1:
        fail("--match must be in [0, 1]")
    regime = Regime(args.step_fixed_ms / 1000, args.step_token_ms / 1000, args.draft_ms / 1000, args.match,
                    step_session_s=args.step_session_ms / 1000, confidence=args.confidence)
    print("| devices | K=2 | K=4 | K=8 | adaptive (mean K) | adaptive / best fixed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.devices:
        c = compare(regime, n, args.seconds, at_once=args.at_once)
        rows = c["rows"]
        print(f"| {n} | " + " | ".join(f"{rows[k]['system_tokens_per_s']:.1f}" for k in (2, 4, 8)) +
              f" | {rows[None]['system_tokens_per_s']:.1f} ({rows[None]['mean_k']:.2f}) | {c['ratio']:.2f}x |",
              flush=True)
    return 0
