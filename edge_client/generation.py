"""The device's round loop: draft, send, commit the verdict, roll the drafter back, repeat.

What varies is held by objects, not flags: the draft length by the policy's controller (edge_client.policy),
each round's decisions and drafting ahead by Round (edge_client.round), the server's absence by Outage
(edge_client.resilience). With nothing to draft (the `none` drafter, or draft_tokens 0) the server decodes every
token itself (Open.server_decodes) and the device reads a Verdict a token, with no round trip between tokens.

The device keeps the whole token history, so a lost link or a restarted server costs nothing: it reopens the
session with its full context (docs/device.md, "Nothing lost").
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from . import codec
from .adaptive import AdaptiveDraftLength
from .constrained import Constrained, DraftMask
from .drafters.base import Drafter, NoDrafter, Proposal
from .policy import DraftLength, DraftPolicy
from .resilience import Outage, Resilience
from .request import Callbacks, Request
from .result import GenerationResult
from .round import Round, RoundRules
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .transport import RemoteSession, VerifierClient, VerifyError


class _Generation:
    """One generation's state; `generate()` below is its entry point."""

    def __init__(self, client, drafter: Drafter, tokenizer: Tokenizer, request: Request, resilience: Resilience,
                 controller: DraftLength, callbacks: Callbacks):
        self.client, self.drafter, self.tokenizer, self.request = client, drafter, tokenizer, request
        self.max_tokens, self.sampling, self.policy = request.max_tokens, request.sampling, request.policy
        self.resilience, self.controller = resilience, controller
        self.on_text, self.on_status, self.should_stop = callbacks.on_text, callbacks.on_status, callbacks.should_stop
        prompt = request.prompt_token_ids
        self.result = GenerationResult(prompt_token_ids=list(prompt), drafter=getattr(drafter, "name", ""))
        self.round = Round(drafter, RoundRules(request.policy, controller), prompt, self.result,
                           max_tokens=request.max_tokens,
                           stop_ids=frozenset(request.stop_token_ids) | {tokenizer.eos_token_id}, hooks=callbacks.hooks)
        self.decoder = tokenizer.stream_decoder()
        self.pieces: list[str] = []
        self.session: RemoteSession | None = None
        self.opens = 0
        self.sent_at = 0.0  # when the last draft went out
        self.outage = Outage(resilience, getattr(client, "address", ""), self.on_status)
        self.done = False

    @property
    def context(self) -> list[int]:
        return self.round.context

    def commit(self, tokens: list[int], verified: bool) -> None:
        self.round.commit(tokens)
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
        msg = codec.open_message(self.request, self.tokenizer.fingerprint, self.client.auth_token or "",
                                 context=self.context, max_tokens=self.max_tokens - len(self.result.token_ids),
                                 sampling=sampling)
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
        if self.session.opened.min_draft_tokens:  # a loose rule that judges a token by the ones after it
            self.controller.at_least(self.session.opened.min_draft_tokens)

    def local_round(self) -> str | None:
        """Continue with the drafter alone (the local fallback); returns a finish reason when the generation ends."""
        tokens, reason = list(self.drafter.propose(self.context, max(self.controller.k, 1)).token_ids), None
        if not tokens:
            return None
        for i, tok in enumerate(tokens):
            if tok in self.round.stop_ids:
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
                await self.round.settle()  # a drafting thread still on its token: done before the drafter is reused
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
        """Open a session, or wait (drafting alone under the local policy) until it is time to try again. On a
        generation's first open the device drafts its first round meanwhile, while the server prefills the prompt."""
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
            if self.opens:
                await self.open()
            else:
                await self.round.draft_while_opening(self.open())
        except VerifyError as err:
            self.outage.failed(err, began)

    async def _verify(self, proposal: Proposal):
        self.sent_at = time.monotonic()
        if self.session.opened.server_decodes:  # the server sends each token unasked
            asked = self.session.next_verdict()
        else:
            asked = self.session.verify(self.result.rounds, proposal)
        return await asyncio.wait_for(asked, self.resilience.round_timeout_s)

    async def _round(self) -> None:
        """One round (Round.play), and its verdict committed; a failed one drops the session."""
        try:
            verdict, committed = await self.round.play(self._verify)
        except (VerifyError, asyncio.TimeoutError) as err:
            if isinstance(err, asyncio.TimeoutError):
                err = VerifyError("DEADLINE_EXCEEDED", f"no verdict within {self.resilience.round_timeout_s:g}s")
            self.session.cancel()
            self.session = None
            self.outage.failed(err, self.sent_at)
            self.outage.next_attempt = time.monotonic()  # first try again at once: the server may be back already
            return
        self.commit(committed, verified=True)
        if verdict.finished:
            self.finish(verdict.finish_reason)


async def generate(client: VerifierClient, drafter: Drafter, tokenizer: Tokenizer, request: Request, *,
                   resilience: Resilience = Resilience(), controller: AdaptiveDraftLength | None = None,
                   callbacks: Callbacks = Callbacks()) -> GenerationResult:
    """Generate the request's tokens after its prompt, telling `callbacks` as it goes. `controller` is the device's
    adaptive controller, kept across its requests so that each starts from what the earlier ones measured (None: a
    fresh one); the `none` drafter drafts nothing whatever the policy."""
    if getattr(drafter, "name", "") == NoDrafter.name:
        request = dataclasses.replace(request, policy=DraftPolicy(draft_tokens=0, adaptive=False))
    policy = request.policy
    constrained = None
    if request.constraint is not None and policy.drafts and (policy.mask_drafts or policy.forced_tokens):
        mask = await asyncio.to_thread(DraftMask, request.constraint, tokenizer, len(request.prompt_token_ids))
        drafter = constrained = Constrained(drafter, mask, policy.mask_drafts, policy.forced_tokens)
    run = _Generation(client, drafter, tokenizer, request, resilience, policy.controller(controller), callbacks)
    try:
        result = await run.run()
    finally:
        if constrained is not None:
            constrained.release()
    result.forced_tokens = constrained.forced_tokens if constrained is not None else 0
    return result
