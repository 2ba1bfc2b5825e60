"""The device-side round loop: draft, send, commit the verdict, roll the drafter back, repeat.

Drafting ahead (on by default, as SpecEdge's proactive drafting): while a draft is being verified, the
drafter goes on as if the server will accept all of it and emit the drafter's own next token as the bonus.
When that is what happens, the next round's draft is already (partly) made and goes out at once, so
drafting overlaps verification instead of following it; tokens past that draft's K are where its own drafting
ahead starts. When it is not, the extra tokens are dropped
with the drafter's rollback. Losslessness is untouched: every token, drafted ahead or not, is verified
with exactly the distribution it was sampled from, given the context it continues.

A verdict that comes while the drafter is on a token is answered without waiting for that token: the drafter
finishes it meanwhile and rolls back only then, if the verdict says so. With the adaptive controller, the
answer to a hit is what was drafted ahead, at most K, so most devices' next drafts meet the batching window that the
verdicts' step opens (`_Generation.draft`); a fixed K drafts the rest first. The answer to a miss is an empty draft
(the server's token alone, in that same step, while the drafter drafts on) where the device's acceptance is at least
EMPTY_AFTER_MISS, and K drafted afresh below it, which joins a later step: a weak drafter rarely guesses the
server's token, and answered with empty drafts it would leave the server decoding alone.
All this only while the server does not queue the drafts (`AdaptiveDraftLength.server_queues`: most recent drafts
sent at once waited through an earlier step, Verdict.queue_ms): there a draft sent at once only waits longer,
and the device finishes its token and drafts the rest of K first, which the wait covers. On a GPU-like server
(steps nearly flat in their tokens, following each other) answering at once was 0.97x finishing first.

With nothing to draft (draft_tokens 0, or the `none` drafter: the server-only way of serving) the device asks the
server to decode every token itself (Open.server_decodes) and reads a Verdict per token as the server sends it: no
round trip comes between tokens, as with any streaming server. A server older than that field answers without
Opened.server_decodes, and the device then sends an empty draft a token.

The device keeps the whole token history, so nothing is lost when the link drops or the server
restarts: the loop reconnects with backoff and reopens with the full context. While the server
stays unreachable the fallback policy decides: `wait` (bounded by a deadline), `local` (the
drafter alone; its tokens are marked unverified) or `fail`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import codec
from .adaptive import AdaptiveDraftLength, RoundSample
from .drafters.base import Drafter, NoDrafter, Proposal
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .transport import RemoteSession, VerifierClient, VerifyError

# Refusals worth reconnecting for; anything else (bad input, mismatch, auth) fails at once.
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "ABORTED", "NOT_FOUND",
                       "RESOURCE_EXHAUSTED"})
FALLBACKS = ("wait", "local", "fail")
# The acceptance (the adaptive controller's estimate) from which a miss answered at once gets an empty draft. Measured
# side by side on the 2-core CPU host (docs/benchmarks.md, the main section and the sections with 'an empty draft after
# a miss'; the real pair, acceptance 0.92-0.95): 1.01-1.05x the tok/s of drafting K afresh at 4 devices, 0.98-1.05x at
# 32. Always empty
# (commit d1c17cb) left the 6-layer ONNX drafter, accepted almost never, sending nothing.
EMPTY_AFTER_MISS = 0.8
# The shortest wait an Open gets under the wait policy, near its deadline: long enough to reach a server that is up.
MIN_OPEN_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Resilience:
    fallback: str = "wait"  # wait | local | fail, while the server is unreachable
    wait_deadline_s: float = 120.0  # `wait` gives up after this long without the server
    round_timeout_s: float = 30.0  # deadline of one round (Draft -> Verdict) and of an Open
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 4.0

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        for name in ("wait_deadline_s", "round_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_verified: list[bool] = field(default_factory=list)
    text: str = ""
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    reconnects: int = 0
    round_times: list[float] = field(default_factory=list)  # seconds per round (draft + verify)
    round_tokens: list[int] = field(default_factory=list)  # tokens committed per round
    # per verified round, the server's step that verified it as its verdict says: (tokens, ms, sessions)
    round_steps: list[tuple[int, float, int]] = field(default_factory=list)
    # per verified round, how fast the device answered the verdict before it: (ms from that verdict's arrival to this
    # round's draft going out, ms of it spent finishing the token being drafted ahead when it came); nan for a
    # session's first round, which answers no verdict
    round_replies: list[tuple[float, float]] = field(default_factory=list)
    # per verified round, how long its draft waited at the server through earlier steps (Verdict.queue_ms): more than
    # 0 where it arrived while another step ran
    round_queue_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    finish_reason: str | None = None
    drafter: str = ""
    ahead_rounds: int = 0  # rounds whose draft was (partly) made while the previous round was verified
    ahead_tokens: int = 0  # tokens of those drafts made ahead
    # rounds whose draft went out of tokens drafted ahead at once, while the drafter was still on its next token
    answered_at_once: int = 0

    @property
    def unverified_tokens(self) -> int:
        return self.token_verified.count(False)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        # vLLM: 1 + accepted / drafts, one draft per round.
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "drafter": self.drafter,
            "finish_reason": self.finish_reason,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "elapsed_s": self.elapsed_s,
            "tokens_per_second": self.tokens_per_second,
            "reconnects": self.reconnects,
            "mean_draft_tokens": self.draft_tokens / self.rounds if self.rounds else 0.0,
            "ahead_rounds": self.ahead_rounds,
            "ahead_tokens": self.ahead_tokens,
            "answered_at_once": self.answered_at_once,
            "unverified_tokens": self.unverified_tokens,
            "unverified_token_indices": [i for i, ok in enumerate(self.token_verified) if not ok],
        }


def _q(p: Proposal, i: int) -> tuple:
    """The sparse q of token i; a proposal without q chose each token with certainty."""
    if p.q_ids is None:
        return np.array([p.token_ids[i]], dtype=np.int64), np.ones(1, dtype=np.float32)
    return p.q_ids[i], p.q_probs[i]


def _join(a: Proposal, b: Proposal) -> Proposal:
    """The tokens of a then b, each with its own q and confidence."""
    if not a.token_ids or not b.token_ids:
        return b if not a.token_ids else a
    tokens = a.token_ids + b.token_ids
    confidence = a.confidence + b.confidence if a.confidence is not None and b.confidence is not None else None
    if a.q_ids is None and b.q_ids is None:
        return Proposal(tokens, confidence=confidence)
    qs = [_q(a, i) for i in range(len(a.token_ids))] + [_q(b, i) for i in range(len(b.token_ids))]
    return Proposal(tokens, [q[0] for q in qs], [q[1] for q in qs], confidence=confidence)


def _cut(p: Proposal, start: int, end: int | None = None) -> Proposal:
    return Proposal(p.token_ids[start:end], None if p.q_ids is None else p.q_ids[start:end],
                    None if p.q_probs is None else p.q_probs[start:end],
                    confidence=None if p.confidence is None else p.confidence[start:end])


class _Generation:
    """One generation's state; `generate()` below is its entry point."""

    def __init__(self, client, drafter, tokenizer, prompt, max_tokens, sampling, draft_tokens, stop_ids, on_text,
                 client_id, resilience, should_stop, adaptive: AdaptiveDraftLength | None = None,
                 draft_ahead: bool = True, answer_at_once: bool = True,
                 empty_after_miss: float | None = EMPTY_AFTER_MISS, on_status: Callable[[str], None] | None = None):
        self.client, self.drafter, self.tokenizer = client, drafter, tokenizer
        self.empty_after_miss = empty_after_miss
        self.max_tokens, self.sampling, self.k = max_tokens, sampling, draft_tokens
        self.stop_ids = frozenset(stop_ids) | {tokenizer.eos_token_id}
        self.request_stops = list(stop_ids)
        self.on_text, self.client_id, self.policy, self.should_stop = on_text, client_id, resilience, should_stop
        self.result = GenerationResult(prompt_token_ids=list(prompt), drafter=getattr(drafter, "name", ""))
        self.context = list(prompt)
        self.decoder = tokenizer.stream_decoder()
        self.pieces: list[str] = []
        self.session: RemoteSession | None = None
        self.opens = 0
        # time.monotonic() at the start of the attempt that found the server gone; None while it answers
        self.outage_since: float | None = None
        self.next_attempt = 0.0
        self.on_status = on_status
        self.backoff = resilience.backoff_initial_s
        self.adaptive = adaptive if draft_tokens > 0 else None
        # Nothing drafted: the server decodes every token and streams it (Open.server_decodes), no round trip a token.
        self.server_decodes = draft_tokens == 0
        self.draft_ahead = draft_ahead and draft_tokens > 0
        self.answer_at_once = answer_at_once
        self.at_once = answer_at_once  # this round's choice: answer_at_once, unless the server queues the drafts
        self.carry: Proposal | None = None  # drafted ahead, continuing the committed context
        self.drafting = [0.0, 0]  # this round's drafter time and tokens, ahead included
        self.verdict_at = 0.0  # when this round's verdict came
        # the last verdict's arrival and the ms then spent finishing the token being drafted ahead (None: no verdict
        # in this session yet)
        self.answering: tuple[float, float] | None = None
        # This round's drafting thread's tokens drafted ahead so far, in a box of its own that it updates (None: no
        # thread), and, after a verdict answered at once from them, that thread still finishing its token
        # (`_answer_now`); a thread left finishing writes only to its own box.
        self.live: list[Proposal] | None = None
        self.finishing: asyncio.Future | None = None
        self.finishing_hit = False  # whether the tokens that thread drafts continue the committed context
        # Whether the last verdict waited for the token being drafted ahead before it was answered, and whether the
        # draft out now went out at once when its verdict came (RoundSample.prompt; set by `draft`).
        self.waited = False
        self.prompt = False

    async def _propose(self, context: list[int], k: int, stop=None) -> Proposal:
        t0 = time.perf_counter()
        if stop is None:  # drafters written before the stop rule take no third argument
            proposal = await asyncio.to_thread(self.drafter.propose, context, k)
        else:
            proposal = await asyncio.to_thread(self.drafter.propose, context, k, stop)
        self.drafting[0] += time.perf_counter() - t0
        self.drafting[1] += len(proposal.token_ids)
        return proposal

    def commit(self, tokens: list[int], verified: bool, ahead: Sequence[int] = ()) -> None:
        self.context.extend(tokens)
        if self.finishing is None:  # else the drafter is busy: `settle` tells it once its thread is done
            self.drafter.accept(self.context, ahead)
        self.result.token_ids.extend(tokens)
        self.result.token_verified.extend([verified] * len(tokens))
        piece = self.decoder.feed(tokens)
        self.pieces.append(piece)
        if self.on_text is not None and piece:
            self.on_text(piece, verified)

    async def open(self) -> None:
        sampling = self.sampling
        if sampling.seed is not None and self.opens:
            # A reopened server session must not replay the random draws it already used.
            sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p,
                                      (sampling.seed + 1_000_003 * self.opens) % 2**63)
        msg = codec.open_message(self.context, sampling, self.max_tokens - len(self.result.token_ids),
                                 self.tokenizer.fingerprint, self.request_stops, self.client_id,
                                 self.client.auth_token or "", self.server_decodes)
        # The first attempt fails at once where the server is down, so the outage is told at once; the attempts
        # after it, under the wait policy, wait for the server to come up (bounded by _open_timeout).
        self.session = await self.client.open(msg, timeout=self._open_timeout(), wait_for_ready=(
            self.policy.fallback == "wait" and self.outage_since is not None))
        if self.opens:
            self.result.reconnects += 1
        if self.outage_since is not None:
            after = f"after {time.monotonic() - self.outage_since:.1f}s"
            self._status(f"verify server {self._address()} reopened the session {after} with its whole context "
                         f"({len(self.context)} tokens)" if self.opens
                         else f"verify server {self._address()} opened the session {after}")
        self.opens += 1
        self.k = min(self.k, self.session.opened.max_draft_tokens)
        if self.adaptive is not None:
            self.adaptive.k_max = min(self.adaptive.k_max, self.session.opened.max_draft_tokens)
            self.adaptive.k = min(self.adaptive.k, self.adaptive.k_max)
        self.outage_since, self.backoff = None, self.policy.backoff_initial_s

    def _address(self) -> str:
        return getattr(self.client, "address", "") or "(no address)"

    def _status(self, message: str) -> None:
        if self.on_status is not None:
            self.on_status(message)

    def _open_timeout(self) -> float:
        """How long an Open may take. Under the wait policy it waits for the server to come up, for the round timeout
        at most and never past the wait deadline, which counts from the start of the first attempt that failed."""
        if self.policy.fallback != "wait":
            return self.policy.round_timeout_s
        waited = 0.0 if self.outage_since is None else time.monotonic() - self.outage_since
        return max(MIN_OPEN_TIMEOUT_S, min(self.policy.round_timeout_s, self.policy.wait_deadline_s - waited))

    def outage(self, err: VerifyError, began: float) -> None:
        """The server is unreachable since `began` (the start of the attempt that failed, unless an outage is already
        under way): decide whether to go on, and when to try again."""
        if err.code not in TRANSIENT:
            raise err
        now = time.monotonic()
        # a server that cannot be reached, or one that turns sessions away for now (full, shutting down)
        state = "unreachable" if err.unreachable else "unavailable"
        if self.policy.fallback == "fail":
            raise VerifyError(err.code, f"verify server {self._address()} {state} ({err.message}); "
                                        "fallback policy is fail")
        if self.outage_since is None:
            self.outage_since = began
            then = (f"waiting up to {self.policy.wait_deadline_s:g}s for it" if self.policy.fallback == "wait"
                    else "going on with the drafter alone, its tokens marked unverified, until it is back")
            self._status(f"verify server {self._address()} {state} ({err.code}: {err.message}); {then}")
        waited = now - self.outage_since
        left = self.policy.wait_deadline_s - waited
        if self.policy.fallback == "wait" and left <= 0:
            raise VerifyError("DEADLINE_EXCEEDED", f"verify server {self._address()} {state} for {waited:.1f}s, "
                                                   f"past the wait deadline of {self.policy.wait_deadline_s:g}s: "
                                                   f"{err.message}")
        self.next_attempt = now + (min(self.backoff, left) if self.policy.fallback == "wait" else self.backoff)
        self.backoff = min(self.backoff * 2, self.policy.backoff_max_s)

    def local_round(self) -> str | None:
        """Continue with the drafter alone; returns a finish reason when the generation ends."""
        proposal = self.drafter.propose(self.context, max(self.k, 1))
        tokens, reason = list(proposal.token_ids), None
        if not tokens:
            return None
        for i, tok in enumerate(tokens):
            if tok in self.stop_ids:
                tokens, reason = tokens[: i + 1], "stop"
                break
        room = self.max_tokens - len(self.result.token_ids)
        if len(tokens) > room:
            tokens, reason = tokens[:room], "length"
        elif len(tokens) == room and reason is None:
            reason = "length"
        self.commit(tokens, verified=False)
        return reason

    async def run(self) -> GenerationResult:
        start = time.perf_counter()
        await asyncio.to_thread(self.drafter.begin, self.context, self.sampling)
        try:
            try:
                await self._loop()
            finally:
                await self.settle()  # a drafter thread still finishing its token: done before the drafter is reused
            if self.session is not None:
                await self.session.close()
        except BaseException:
            if self.session is not None:
                self.session.cancel()
            raise
        tail = self.decoder.flush()
        if tail and self.on_text is not None:
            self.on_text(tail, True)
        self.result.text = "".join(self.pieces) + tail
        self.result.elapsed_s = time.perf_counter() - start
        return self.result

    async def _loop(self) -> None:
        r = self.result
        while True:
            if self.should_stop is not None and self.should_stop():
                r.finish_reason = "stop"
                return
            if self.session is None:
                wait = self.next_attempt - time.monotonic()
                if wait > 0:
                    if self.policy.fallback == "local":
                        before = len(r.token_ids)
                        reason = await asyncio.to_thread(self.local_round)
                        if reason:
                            r.finish_reason = reason
                            return
                        if len(r.token_ids) > before:
                            continue
                    await asyncio.sleep(wait)
                    continue
                began = time.monotonic()
                try:
                    await self.open_drafting()
                except VerifyError as err:
                    self.outage(err, began)
                    continue
            k = self.round_k()
            t_round = time.perf_counter()
            self.drafting = [0.0, 0]
            proposal, spare = await self.draft(k)
            prompt = self.prompt
            t_sent, sent_at = time.perf_counter(), time.monotonic()
            verify = asyncio.ensure_future(self._verify(r.rounds, proposal))
            reply = ((float("nan"), float("nan")) if self.answering is None
                     else ((t_sent - self.answering[0]) * 1000.0, self.answering[1]))
            self.live = None
            drafting = asyncio.ensure_future(self.draft_while(verify, proposal, spare))
            try:
                await asyncio.wait([verify])
                busy = not drafting.done()
                self.at_once = self.answer_at_once and not (self.adaptive is not None and self.adaptive.server_queues())
                ahead = self._answer_now(verify, proposal, drafting) if self.at_once else None
                self.waited = busy and ahead is None
                if ahead is None:
                    ahead = await drafting
            except BaseException:
                verify.cancel()
                drafting.cancel()
                raise
            t_ahead = time.perf_counter() if busy and self.finishing is None else self.verdict_at
            try:
                verdict = await verify
            except (VerifyError, asyncio.TimeoutError) as err:
                if isinstance(err, asyncio.TimeoutError):
                    err = VerifyError("DEADLINE_EXCEEDED", f"no verdict within {self.policy.round_timeout_s:g}s")
                self.session.cancel()
                self.session, self.carry, self.answering = None, None, None
                self.outage(err, sent_at)
                self.next_attempt = time.monotonic()  # first try again at once: the server may be back already
                continue
            committed = proposal.token_ids[: verdict.n_accepted]
            if verdict.next_token is not None:
                committed = committed + [verdict.next_token]
            now = time.perf_counter()
            if self.adaptive is not None:
                per_token = verdict.token_ms / 1000.0  # marginal server cost of one more token, at its load
                spent, drafted = self.drafting
                # The round trip ends when the verdict came, not when the token being drafted ahead was done.
                self.adaptive.observe(RoundSample(len(proposal.token_ids), verdict.n_accepted, t_sent - t_round,
                                                  self.verdict_at - t_sent, per_token,
                                                  spent / drafted if drafted else None,
                                                  verdict.step_sessions,
                                                  None if proposal.confidence is None else tuple(proposal.confidence),
                                                  verdict.step_ms / 1000.0, verdict.queue_ms / 1000.0, prompt))
            r.rounds += 1
            r.draft_tokens += len(proposal.token_ids)
            r.accepted_tokens += verdict.n_accepted
            r.round_times.append(now - t_round)
            r.round_tokens.append(len(committed))
            r.round_steps.append((verdict.step_tokens, verdict.step_ms, verdict.step_sessions))
            r.round_replies.append(reply)
            r.round_queue_ms.append(verdict.queue_ms)
            self.answering = (self.verdict_at, max(0.0, t_ahead - self.verdict_at) * 1000.0)
            # Drafted ahead on the guess that the server accepts everything and its bonus token is the
            # drafter's own next one: when it is, the rest continues the new context exactly.
            if (ahead.token_ids and verdict.n_accepted == len(proposal.token_ids)
                    and verdict.next_token == ahead.token_ids[0] and not verdict.finished):
                self.carry = _cut(ahead, 1)
            self.commit(committed, verified=True, ahead=self.carry.token_ids if self.carry else [])
            if verdict.finished:
                r.finish_reason = verdict.finish_reason
                return

    def _answer_now(self, verify: asyncio.Future, proposal: Proposal, drafting: asyncio.Future) -> Proposal | None:
        """A verdict that comes while the drafter is on a token drafted ahead is answered without waiting for it; this
        returns the tokens drafted ahead that continue the new context: all drafted so far where the verdict accepted
        the whole draft with the drafter's own next token as its bonus (a hit: the drafter's cache, and the token it
        is on, continue the new context as they are), none otherwise (the drafter rolls back once done: `settle`).
        None when the drafter is not busy (or the verdict failed): nothing to wait for. A device answering a
        verdict at once joins the step that verdict's batching window opens; finishing the token first (up to one
        drafting step) left it for the step after."""
        if drafting.done() or verify.cancelled() or verify.exception() is not None or self.live is None:
            return None
        verdict, live = verify.result(), self.live[0]
        hit = (not verdict.finished and verdict.n_accepted == len(proposal.token_ids) and live.token_ids
               and verdict.next_token == live.token_ids[0])
        self.finishing, self.finishing_hit = drafting, bool(hit)
        return live if hit else Proposal([])

    async def settle(self) -> Proposal | None:
        """Wait for the drafting thread that a verdict was answered without (`_answer_now`) and let the drafter drop
        what the committed context no longer holds. After a hit, return all the thread drafted ahead, the bonus token
        first (they continue the context: nothing is dropped); None after a miss, or with no thread left finishing."""
        if self.finishing is None:
            return None
        finishing, self.finishing = self.finishing, None
        ahead = await finishing
        if self.finishing_hit:
            self.drafter.accept(self.context, ahead.token_ids[1:])
            return ahead
        self.drafter.accept(self.context)
        return None

    def round_k(self) -> int:
        """This round's draft length: the controller's (or the fixed) K, and never past the request's end: the
        verdict adds a token of its own (the correction or the bonus), so a draft past max_tokens - 1 more would
        be clipped by the server, its drafting wasted and its tokens counted as rejected."""
        k = self.adaptive.k if self.adaptive is not None else self.k
        return max(0, min(k, self.max_tokens - len(self.result.token_ids) - 1))

    async def open_drafting(self) -> None:
        """Open the session. On a generation's first open the device drafts its first round meanwhile, while the
        server prefills the prompt, instead of after it: the draft waits as drafted ahead (`carry`) and the first
        round sends it at once. A failed open drops it (the outage path may commit tokens of its own first)."""
        k = self.round_k()
        if self.opens or not k or self.carry is not None:
            await self.open()
            return
        opening = asyncio.ensure_future(self.open())
        try:
            stop = self._stop_rule()
            early = await self._propose(self.context, k, stop)
        except BaseException:
            opening.cancel()
            raise
        await opening  # a failed open raises here, and the draft is dropped
        self.carry = early

    def _stop_rule(self):
        """The adaptive controller's confidence stop rule for this draft, or None (no controller, or no rule)."""
        return self.adaptive.stop_rule() if self.adaptive is not None else None

    async def _verify(self, round_: int, proposal: Proposal):
        if self.session.opened.server_decodes:  # the server sends each token unasked
            asked = self.session.next_verdict()
        else:
            asked = self.session.verify(round_, proposal)
        verdict = await asyncio.wait_for(asked, self.policy.round_timeout_s)
        self.verdict_at = time.perf_counter()
        return verdict

    async def draft(self, k: int) -> tuple[Proposal, Proposal]:
        """This round's k tokens: those drafted ahead during the last round first, the rest drafted now; fewer where
        the adaptive controller's stop rule ends the draft at a token the drafter is too unsure of. With them, the
        spare: the tokens drafted ahead past them (a carry longer than this draft), which continue it, so the
        drafting ahead during its verification starts from them instead of drafting them again.

        With the adaptive controller and drafting ahead, a draft answering a hit is what was drafted ahead, at most
        k, and goes out at once. A miss answered at once gets an empty draft, which goes out at once too, where the
        controller's acceptance is at least empty_after_miss; below it the device drafts k afresh (an empty draft at
        any acceptance left a weak drafter, whose guess of the bonus is rarely right, sending almost nothing: the
        server decoded alone). Drafting the rest first sent it after the server's batching window, into the step
        after the one that window opened, and a device answering in time alternated with one that did not: the
        server's steps held about half the devices (2.1 of 4 on this repository's CPU host, 15.3 of 32 on an
        H100). A fixed K drafts it whole."""
        # Out at once when its verdict came, unless that waited for a token drafted ahead or this drafts or waits below
        self.prompt = self.answering is not None and not self.waited
        if (self.at_once and self.adaptive is not None and self.draft_ahead and self.answering is not None
                and self.carry is not None and self.carry.token_ids):
            k = min(k, len(self.carry.token_ids))
        elif (self.empty_after_miss is not None and self.finishing is not None and not self.finishing_hit
              and self.adaptive is not None and self.adaptive.acceptance() >= self.empty_after_miss):
            k = 0
        if self.finishing is not None and k and (self.carry is None or len(self.carry.token_ids) < k):
            t0 = time.perf_counter()
            self.prompt = False
            ahead = await self.settle()  # the drafter is needed now: its token first
            self.carry = None if ahead is None else _cut(ahead, 1)
            if self.answering is not None:  # which is part of answering the verdict
                self.answering = (self.answering[0], self.answering[1] + (time.perf_counter() - t0) * 1000.0)
        if self.finishing is not None:
            self.result.answered_at_once += 1
        carry, self.carry = self.carry, None
        if not k:
            return Proposal([]), Proposal([])
        stop = self._stop_rule()
        if carry is None or not carry.token_ids:
            self.prompt = False
            return await self._propose(self.context, k, stop), Proposal([])
        proposal = _cut(carry, 0, k)
        if stop is not None and proposal.confidence is not None:
            for i, sure in enumerate(proposal.confidence):
                if not stop.take(sure):
                    proposal = _cut(proposal, 0, i)
                    k = i  # the draft ends here: nothing more to draft
                    break
        self.result.ahead_rounds += 1
        self.result.ahead_tokens += len(proposal.token_ids)
        spare = _cut(carry, len(proposal.token_ids))
        if (len(proposal.token_ids) < k and proposal.token_ids[-1] not in self.stop_ids
                and (stop is None or stop.more())):
            self.prompt = False
            rest = await self._propose(self.context + proposal.token_ids, k - len(proposal.token_ids), stop)
            proposal = _join(proposal, rest)
        return proposal, spare

    async def draft_while(self, verify: asyncio.Future, proposal: Proposal, spare: Proposal) -> Proposal:
        """Draft on past `proposal`, one token at a time, until its verdict is in or the next round is covered.
        It starts from `spare` (what the last round drafted ahead past this draft), which continues it exactly.
        The loop runs in one worker thread, not one hop per token: on a small device (and in the benchmark, which
        runs every device in one process) the hops would cost CPU that drafting and serving need."""
        if self.finishing is not None:  # this draft went out before the last round's drafting thread was done
            ahead = await self.settle()
            spare = Proposal([]) if ahead is None else _cut(ahead, 1 + len(proposal.token_ids))
        # Tokens left once this draft and its verdict's token are in: the next draft's, and its bonus guess first.
        room = self.max_tokens - len(self.result.token_ids) - len(proposal.token_ids) - 1
        limit = min((self.adaptive.k_max if self.adaptive is not None else self.k) + 1, room)
        if (not self.draft_ahead or (proposal.token_ids and proposal.token_ids[-1] in self.stop_ids)
                or room <= 0):
            return Proposal([])
        spare = _cut(spare, 0, limit)
        if verify.done() or len(spare.token_ids) >= limit or (spare.token_ids and spare.token_ids[-1] in self.stop_ids):
            return spare
        arrived = threading.Event()
        verify.add_done_callback(lambda _: arrived.set())
        self.live = [spare]
        return await asyncio.to_thread(self._draft_until, self.context + proposal.token_ids, limit, arrived, spare,
                                       self.live)

    def _draft_until(self, base: list[int], limit: int, arrived: threading.Event, ahead: Proposal,
                     live: list[Proposal]) -> Proposal:
        """Draft past `base` + `ahead` (tokens already drafted there) until `arrived` is set or `limit` tokens
        are ahead, each new one shown in `live`; the drafting time and tokens count this round's new tokens only."""
        new = 0
        t0 = time.perf_counter()
        while not arrived.is_set() and len(ahead.token_ids) < limit:
            step = self.drafter.propose(base + ahead.token_ids, 1)
            if not step.token_ids:
                break
            ahead = _join(ahead, step)
            live[0] = ahead
            new += len(step.token_ids)
            if step.token_ids[-1] in self.stop_ids:
                break
        self.drafting[0] += time.perf_counter() - t0
        self.drafting[1] += new
        return ahead


async def generate(
    client: VerifierClient,
    drafter: Drafter,
    tokenizer: Tokenizer,
    prompt_token_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: int = 4,
    stop_token_ids: list[int] = (),
    on_text: Callable[[str, bool], None] | None = None,
    client_id: str = "",
    resilience: Resilience = Resilience(),
    should_stop: Callable[[], bool] | None = None,
    adaptive: bool = True,
    max_draft_tokens: int = 8,
    draft_ahead: bool = True,
    controller: AdaptiveDraftLength | None = None,
    confidence_stop: bool = False,
    answer_at_once: bool = True,
    empty_after_miss: float | None = EMPTY_AFTER_MISS,
    on_status: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate up to max_tokens after the prompt; on_text(piece, verified) sees the text as it is committed.

    With adaptive=True, K starts at max_draft_tokens, or where a kept `controller` left it (optimistic: a
    poor drafter is cut back after two rounds), and each round chooses K in 1..max_draft_tokens; draft_tokens
    is then only the on/off switch for drafting (0 = none). With adaptive=False, K is draft_tokens.
    confidence_stop=True lets the adaptive controller end a draft before K at a token the drafter is too unsure of
    (edge_client.adaptive); it needs a drafter that reports its confidence.
    draft_ahead=True drafts on while a draft is verified (see the module docstring). `controller` is the
    device's adaptive draft-length controller, kept across its requests so that each starts from what the
    earlier ones measured; None makes a fresh one.
    answer_at_once=False makes a device finish the token it is drafting ahead before it answers a verdict, and draft
    the rest of K after it where the tokens drafted ahead fall short (the behaviour before commit d1c17cb), for
    scripts/bench_system.py to compare; with answer_at_once=True the device does so too while the server queues its
    drafts (module docstring). empty_after_miss is the acceptance from which a miss answered at once gets an
    empty draft (module docstring); None drafts K afresh after every miss. on_status(message) hears when the server
    is found unreachable and when it is back (the CLI prints it, the agent logs it).
    """
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: nothing to continue")
    if max_tokens <= 0:
        raise ValueError("max_tokens must be at least 1")
    if draft_tokens < 0:
        raise ValueError("draft_tokens must be >= 0")
    if getattr(drafter, "name", "") == NoDrafter.name:
        draft_tokens = 0  # nothing to draft: the server decodes every token
    if not adaptive:
        controller = None
    elif controller is None:
        controller = AdaptiveDraftLength.for_device(max_draft_tokens, draft_ahead, confidence_stop)
    else:
        controller.configure(max(max_draft_tokens, controller.k_min), draft_ahead)
        controller.confidence_stop = confidence_stop
    run = _Generation(client, drafter, tokenizer, prompt_token_ids, max_tokens, sampling, draft_tokens,
                      stop_token_ids, on_text, client_id, resilience, should_stop, controller, draft_ahead,
                      answer_at_once, empty_after_miss, on_status)
    return await run.run()
