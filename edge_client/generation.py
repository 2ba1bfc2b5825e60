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
import time
from collections.abc import Callable, Sequence

from . import codec
from .adaptive import AdaptiveDraftLength
from .drafters.base import Drafter, NoDrafter, Proposal
from .policy import DraftLength, DraftPolicy
from .resilience import Outage, Resilience
from .result import GenerationResult
from .round import Round, RoundHooks, RoundRules
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .transport import RemoteSession, VerifierClient, VerifyError


class _Generation:
    """One generation's state; `generate()` below is its entry point."""

    def __init__(self, client, drafter, tokenizer, prompt, max_tokens: int, sampling: SamplingParams,
                 policy: DraftPolicy, controller: DraftLength, resilience: Resilience, stop_ids: Sequence[int],
                 on_text, on_status, should_stop, client_id: str, hooks: RoundHooks | None = None):
        self.client, self.drafter, self.tokenizer = client, drafter, tokenizer
        self.max_tokens, self.sampling, self.policy, self.controller = max_tokens, sampling, policy, controller
        self.resilience, self.on_text, self.should_stop, self.client_id = resilience, on_text, should_stop, client_id
        self.on_status = on_status
        self.request_stops = list(stop_ids)
        self.result = GenerationResult(prompt_token_ids=list(prompt), drafter=getattr(drafter, "name", ""))
        self.round = Round(drafter, RoundRules(policy, controller), prompt, self.result, max_tokens=max_tokens,
                           stop_ids=frozenset(stop_ids) | {tokenizer.eos_token_id}, hooks=hooks)
        self.decoder = tokenizer.stream_decoder()
        self.pieces: list[str] = []
        self.session: RemoteSession | None = None
        self.opens = 0
        self.sent_at = 0.0  # when the last draft went out
        self.outage = Outage(resilience, getattr(client, "address", ""), on_status)
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
        p = self.policy
        msg = codec.open_message(self.context, sampling, self.max_tokens - len(self.result.token_ids),
                                 self.tokenizer.fingerprint, self.request_stops, self.client_id,
                                 self.client.auth_token or "", not p.drafts, p.rule)
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
    hooks: RoundHooks | None = None,
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
    policy.check(sampling)
    run = _Generation(client, drafter, tokenizer, prompt_token_ids, max_tokens, sampling, policy,
                      policy.controller(controller), resilience, stop_token_ids, on_text, on_status, should_stop,
                      client_id, hooks)
    return await run.run()
