"""The device's round loop: draft, send, commit the verdict, roll the drafter back, repeat.

What varies is held by objects, not flags: the draft length by the policy's controller (edge_client.policy),
drafting while a draft is verified by DraftAhead (edge_client.draft_ahead), the server's absence by Outage
(edge_client.resilience). With nothing to draft (the `none` drafter, or draft_tokens 0) the server decodes every
token itself (Open.server_decodes) and the device reads a Verdict a token, with no round trip between tokens.

The device keeps the whole token history, so a lost link or a restarted server costs nothing: it reopens the
session with its full context (docs/device.md, "Nothing lost").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from . import codec
from .adaptive import AdaptiveDraftLength, RoundSample
from .draft_ahead import DraftAhead
from .drafters.base import Drafter, NoDrafter, Proposal
from .policy import DraftLength, DraftPolicy
from .resilience import Outage, Resilience
from .result import GenerationResult
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .transport import RemoteSession, VerifierClient, VerifyError


class _Generation:
    """One generation's state; `generate()` below is its entry point."""

    def __init__(self, client, drafter, tokenizer, prompt, max_tokens: int, sampling: SamplingParams,
                 policy: DraftPolicy, controller: DraftLength, resilience: Resilience, stop_ids: Sequence[int],
                 on_text, on_status, should_stop, client_id: str):
        self.client, self.drafter, self.tokenizer = client, drafter, tokenizer
        self.max_tokens, self.sampling, self.policy, self.controller = max_tokens, sampling, policy, controller
        self.resilience, self.on_text, self.should_stop, self.client_id = resilience, on_text, should_stop, client_id
        self.on_status = on_status
        self.stop_ids = frozenset(stop_ids) | {tokenizer.eos_token_id}
        self.request_stops = list(stop_ids)
        self.result = GenerationResult(prompt_token_ids=list(prompt), drafter=getattr(drafter, "name", ""))
        self.context = list(prompt)
        self.decoder = tokenizer.stream_decoder()
        self.pieces: list[str] = []
        self.session: RemoteSession | None = None
        self.opens = 0
        self.outage = Outage(resilience, getattr(client, "address", ""), on_status)
        self.ahead = DraftAhead(self)
        self.drafting = [0.0, 0]  # this round's drafter time and tokens, drafting ahead included
        self.verdict_at = 0.0  # when this round's verdict came
        self.done = False

    async def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        """The drafter's next k tokens, timed into this round's drafting."""
        t0 = time.perf_counter()
        proposal = await asyncio.to_thread(self.drafter.propose, context, k, stop)
        self.drafting[0] += time.perf_counter() - t0
        self.drafting[1] += len(proposal.token_ids)
        return proposal

    def commit(self, tokens: list[int], verified: bool, ahead: Sequence[int] = ()) -> None:
        self.context.extend(tokens)
        if self.ahead.finishing is None:  # else the drafter is busy: DraftAhead.settle tells it once it is done
            self.drafter.accept(self.context, ahead)
        self.result.token_ids.extend(tokens)
        self.result.token_verified.extend([verified] * len(tokens))
        piece = self.decoder.feed(tokens)
        self.pieces.append(piece)
        if self.on_text is not None and piece:
            self.on_text(piece, verified)

    def round_k(self) -> int:
        """This round's draft length, never past the request's end: the verdict adds a token of its own, so a draft
        past max_tokens - 1 more would be clipped by the server, its drafting wasted."""
        return max(0, min(self.controller.k, self.max_tokens - len(self.result.token_ids) - 1))

    async def open(self) -> None:
        sampling = self.sampling
        if sampling.seed is not None and self.opens:
            # A reopened server session must not replay the random draws it already used.
            sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p,
                                      (sampling.seed + 1_000_003 * self.opens) % 2**63)
        p = self.policy
        msg = codec.open_message(self.context, sampling, self.max_tokens - len(self.result.token_ids),
                                 self.tokenizer.fingerprint, self.request_stops, self.client_id,
                                 self.client.auth_token or "", not p.drafts, p.verification, p.fly_window,
                                 p.fly_entropy_threshold)
        self.session = await self.client.open(msg, timeout=self.outage.open_timeout(),
                                              wait_for_ready=self.outage.waits_for_ready)
        if self.opens:
            self.result.reconnects += 1
        self.outage.opened(reopened=self.opens > 0, context_tokens=len(self.context),
                           server=getattr(self.session, "server", None))
        self.opens += 1
        asked, server_max = self.controller.k_max, self.session.opened.max_draft_tokens
        if self.controller.cap(server_max) and self.on_status:
            self.on_status(f"the server takes drafts of at most {server_max} tokens: drafting up to {server_max} a "
                           f"round, not {asked}")
        if self.session.opened.fly_window:  # FLy keeps a mismatch only before a draft's last W tokens
            self.controller.at_least(self.session.opened.fly_window + 1)

    async def open_drafting(self) -> None:
        """Open the session. On a generation's first open the device drafts its first round meanwhile, while the
        server prefills the prompt: the draft waits as drafted ahead and the first round sends it at once. A failed
        open drops it (the outage path may commit tokens of its own first)."""
        k = self.round_k()
        if self.opens or not k or self.ahead.carry is not None:
            await self.open()
            return
        opening = asyncio.ensure_future(self.open())
        try:
            early = await self.propose(self.context, k, self.controller.stop_rule())
        except BaseException:
            opening.cancel()
            raise
        await opening  # a failed open raises here, and the draft is dropped
        self.ahead.carry = early

    def local_round(self) -> str | None:
        """Continue with the drafter alone (the local fallback); returns a finish reason when the generation ends."""
        tokens, reason = list(self.drafter.propose(self.context, max(self.controller.k, 1)).token_ids), None
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
                await self.ahead.settle()  # a drafting thread still on its token: done before the drafter is reused
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

    def finish(self, reason: str | None) -> None:
        self.result.finish_reason, self.done = reason, True

    async def _loop(self) -> None:
        while not self.done:
            if self.should_stop is not None and self.should_stop():
                self.finish("stop")
            elif self.session is None:
                await self._reach_server()
            else:
                await self._round()

    async def _reach_server(self) -> None:
        """Open a session, or wait (drafting alone under the local policy) until it is time to try again."""
        wait = self.outage.until_next_attempt()
        if wait > 0:
            if self.resilience.local:
                before = len(self.result.token_ids)
                reason = await asyncio.to_thread(self.local_round)
                if reason:
                    self.finish(reason)
                if reason or len(self.result.token_ids) > before:
                    return
            await asyncio.sleep(wait)
            return
        began = time.monotonic()
        try:
            await self.open_drafting()
        except VerifyError as err:
            self.outage.failed(err, began)

    async def _verify(self, round_: int, proposal: Proposal):
        if self.session.opened.server_decodes:  # the server sends each token unasked
            asked = self.session.next_verdict()
        else:
            asked = self.session.verify(round_, proposal)
        verdict = await asyncio.wait_for(asked, self.resilience.round_timeout_s)
        self.verdict_at = time.perf_counter()
        return verdict

    async def _round(self) -> None:
        """One round: draft, send, draft ahead while it is verified, commit the verdict."""
        r, ahead = self.result, self.ahead
        t_round = time.perf_counter()
        self.drafting = [0.0, 0]
        proposal, spare = await ahead.draft(self.round_k())
        prompt = ahead.prompt
        t_sent, sent_at = time.perf_counter(), time.monotonic()
        verify = asyncio.ensure_future(self._verify(r.rounds, proposal))
        reply = ((float("nan"), float("nan")) if ahead.answering is None
                 else ((t_sent - ahead.answering[0]) * 1000.0, ahead.answering[1]))
        ahead.live = None
        drafting = asyncio.ensure_future(ahead.draft_while(verify, proposal, spare))
        try:
            await asyncio.wait([verify])
            busy = not drafting.done()
            ahead.at_once = self.policy.answer_at_once and not self.controller.server_queues()
            drafted = ahead.answer_now(verify, proposal, drafting) if ahead.at_once else None
            ahead.waited = busy and drafted is None
            if drafted is None:
                drafted = await drafting
        except BaseException:
            verify.cancel()
            drafting.cancel()
            raise
        t_ahead = time.perf_counter() if busy and ahead.finishing is None else self.verdict_at
        try:
            verdict = await verify
        except (VerifyError, asyncio.TimeoutError) as err:
            if isinstance(err, asyncio.TimeoutError):
                err = VerifyError("DEADLINE_EXCEEDED", f"no verdict within {self.resilience.round_timeout_s:g}s")
            self.session.cancel()
            self.session = None
            ahead.reset()
            self.outage.failed(err, sent_at)
            self.outage.next_attempt = time.monotonic()  # first try again at once: the server may be back already
            return
        committed = proposal.token_ids[: verdict.n_accepted]
        if verdict.next_token is not None:
            committed = committed + [verdict.next_token]
        spent, tokens = self.drafting
        # The round trip ends when the verdict came, not when the token being drafted ahead was done.
        self.controller.observe(RoundSample(
            len(proposal.token_ids), verdict.n_accepted, t_sent - t_round, self.verdict_at - t_sent,
            verdict.token_ms / 1000.0, spent / tokens if tokens else None, verdict.step_sessions,
            None if proposal.confidence is None else tuple(proposal.confidence), verdict.step_ms / 1000.0,
            verdict.queue_ms / 1000.0, prompt))
        r.rounds += 1
        r.draft_tokens += len(proposal.token_ids)
        r.accepted_tokens += verdict.n_accepted
        r.loosely_accepted_tokens += verdict.n_loose
        r.round_times.append(time.perf_counter() - t_round)
        r.round_tokens.append(len(committed))
        r.round_steps.append((verdict.step_tokens, verdict.step_ms, verdict.step_sessions))
        r.round_replies.append(reply)
        r.round_queue_ms.append(verdict.queue_ms)
        ahead.answering = (self.verdict_at, max(0.0, t_ahead - self.verdict_at) * 1000.0)
        ahead.after_verdict(verdict, proposal, drafted)
        self.commit(committed, verified=True, ahead=ahead.carry.token_ids if ahead.carry else [])
        if verdict.finished:
            self.finish(verdict.finish_reason)


async def generate(
    client: VerifierClient,
    drafter: Drafter,
    tokenizer: Tokenizer,
    prompt_token_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    policy: DraftPolicy = DraftPolicy(),
    resilience: Resilience = Resilience(),
    controller: AdaptiveDraftLength | None = None,
    stop_token_ids: Sequence[int] = (),
    on_text: Callable[[str, bool], None] | None = None,
    on_status: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    client_id: str = "",
) -> GenerationResult:
    """Generate up to max_tokens after the prompt. on_text(piece, verified) sees the text as it is committed;
    on_status(message) hears when the server is found unreachable and when it is back, and when it caps K;
    should_stop() is asked each round. `controller` is the device's adaptive controller, kept across its requests so
    that each starts from what the earlier ones measured (None: a fresh one); the `none` drafter drafts nothing
    whatever the policy."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: nothing to continue")
    if max_tokens <= 0:
        raise ValueError("max_tokens must be at least 1")
    if getattr(drafter, "name", "") == NoDrafter.name:
        policy = DraftPolicy(draft_tokens=0, adaptive=False)
    if policy.verification == "fly" and not sampling.greedy:
        raise ValueError("FLy verification applies to greedy generation (temperature 0) only")
    run = _Generation(client, drafter, tokenizer, prompt_token_ids, max_tokens, sampling, policy,
                      policy.controller(controller), resilience, stop_token_ids, on_text, on_status, should_stop,
                      client_id)
    return await run.run()
