"""The device's round: what to draft and how far ahead, what to send, what each verdict leaves, and when a verdict is
answered at once. Why each rule is so: docs/device.md, "Drafting ahead".

`RoundRules` makes the decisions in counts, so that `sled-bench sim-rounds` asks the same object with simulated
clocks; `Round` plays them with a drafter and a verifier. The drafter goes on as if the server will accept the whole
draft and emit the drafter's own next token as the bonus (SpecEdge's proactive drafting). When the verdict says
exactly that (a hit), the tokens drafted after that bonus begin the next draft; else they are dropped with the
drafter's rollback. Every token is verified with the distribution it was sampled from, given the context it
continues, so the output is unchanged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from .adaptive import RoundSample
from .drafters.base import Drafter, Proposal
from .policy import DraftLength, DraftPolicy
from .result import GenerationResult

if TYPE_CHECKING:
    from .codec import Verdict


class RoundRules:
    """A round's decisions, in counts: a device's draft policy and its draft-length controller."""

    def __init__(self, policy: DraftPolicy, controller: DraftLength):
        self.policy, self.controller = policy, controller
        self.at_once = policy.answer_at_once  # whether the last verdict was answered at once

    def draft_length(self, room: int) -> int:
        """This round's K, never past the request's end (`room` tokens left): the verdict adds a token of its own,
        so a draft past room - 1 would be clipped by the server, its drafting wasted."""
        return self.within(self.controller.k, room)

    def first_length(self, room: int) -> int:
        """A generation's first K (the controller's first_k), within room as draft_length."""
        return self.within(self.controller.first_k, room)

    @staticmethod
    def within(k: int, room: int) -> int:
        return max(0, min(k, room - 1))

    def ahead_limit(self, room: int) -> int:
        """How many tokens to draft ahead past a draft (the bonus guess first), `room` tokens left once the draft and
        its verdict's token are in: the next draft and its bonus, or none without drafting ahead."""
        return max(0, min(self.controller.ahead_k + 1, room)) if self.policy.ahead else 0

    def verdict_came(self) -> bool:
        """At a verdict, whether it is answered at once, without waiting for the token being drafted ahead: not where
        the server queues this device's drafts (a draft sent sooner would only wait longer)."""
        self.at_once = self.policy.answer_at_once and not self.controller.server_queues()
        return self.at_once

    def answer(self, k: int, *, hit: bool, ahead: int, busy: bool) -> int | None:
        """The length of a draft that answers the last verdict at once, or None: the drafter finishes its token and
        drafts the rest of K first. A hit (the whole draft accepted with the drafter's guessed bonus) goes out with
        the `ahead` tokens drafted past that bonus, K at most; a miss that came while the drafter was `busy` on a
        token goes out empty (the server's token alone) where the controller's acceptance is high enough. Either
        only where the controller finds that answering at once pays for the round it adds."""
        if not self.at_once:
            return None
        if hit and ahead > 0 and self.policy.ahead and self.controller.answers_at_once(k, ahead, busy):
            return min(k, ahead)
        threshold = self.policy.empty_after_miss
        if (busy and not hit and threshold is not None and self.controller.empty_after_miss(threshold)
                and self.controller.answers_at_once(k, 0, busy)):
            return 0
        return None


class RoundHooks:
    """Where a round can be watched (tests, tracing). Each does nothing by default; `clock` times the round."""

    def clock(self) -> float:
        return time.perf_counter()

    def sending(self, at_once: bool) -> None:
        """A draft is about to go out; `at_once`: it answers its verdict at once (RoundSample.prompt)."""

    def ahead_begins(self) -> None:
        """Drafting ahead past the draft just sent is about to begin, the last round's being done (or to be skipped:
        then ahead_ends follows)."""

    def ahead_token(self, n: int, arrived: threading.Event) -> None:
        """In the drafting thread: its n-th step is about to begin; `arrived` is set once the verdict is in."""

    def ahead_ends(self) -> None:
        """The drafting ahead past the draft sent is done (its thread has returned), or there was none."""


def step_ahead(drafter: Drafter, context: list[int], limit: int) -> Proposal:
    """One step of drafting ahead: a token, or several from one forward where the drafter has its own step (a
    stacked drafter's checked guesses, a parallel drafter's slots)."""
    own = getattr(drafter, "step_ahead", None)
    return own(context, limit) if own else drafter.propose(context, 1)


class Round:
    """The rounds of one generation: its committed context, its drafter and what it has drafted ahead.

    `play(send)` is one round: draft, send, draft ahead while it is verified, answer the verdict. `commit` adds
    committed tokens (the verdict's, or the drafter's alone while the server is away) and tells the drafter."""

    def __init__(self, drafter: Drafter, rules: RoundRules, prompt: Sequence[int], result: GenerationResult, *,
                 max_tokens: int, stop_ids: frozenset[int], hooks: RoundHooks | None = None):
        self.drafter, self.rules, self.result = drafter, rules, result
        self.context = list(prompt)
        self.max_tokens, self.stop_ids = max_tokens, stop_ids
        self.hooks = hooks or RoundHooks()
        self.carry: Proposal | None = None  # drafted ahead, continuing the committed context
        # This round's drafting thread's tokens drafted ahead so far, in a box of its own that it updates (None: no
        # thread), and, after a verdict answered at once from them, that thread still finishing its token (a thread
        # left finishing writes only to its own box) and whether what it drafts continues the committed context.
        self._live: list[Proposal] | None = None
        self._finishing: asyncio.Future | None = None
        self._finishing_hit = False
        # the last verdict's arrival and the ms then spent finishing the token being drafted ahead (None: no verdict
        # in this session yet), and whether it waited for that token before it was answered
        self._answering: tuple[float, float] | None = None
        self._waited = False
        self._prompt = False
        self._drafting = [0.0, 0]  # this round's drafter time and tokens, drafting ahead included
        self._alone = [0.0, 0]  # of those, drafted before the draft went out

    @property
    def room(self) -> int:
        """Tokens the request may still commit."""
        return self.max_tokens - len(self.result.token_ids)

    @property
    def busy(self) -> bool:
        """Whether a drafting thread is still on a token past a verdict answered at once."""
        return self._finishing is not None

    def commit(self, tokens: list[int]) -> None:
        """Tokens committed: the context grows, and the drafter keeps what was drafted ahead past them (`carry`),
        unless it is busy (then `settle` tells it once it is done)."""
        self.context.extend(tokens)
        if self._finishing is None:
            self.drafter.accept(self.context, self.carry.token_ids if self.carry else [])

    def reset(self) -> None:
        """The session is gone: nothing drafted ahead continues a verdict."""
        self.carry, self._answering = None, None

    async def draft_while_opening(self, opening: Awaitable) -> None:
        """A generation's first draft, made while the server prefills the prompt (`opening`): it waits as drafted
        ahead and the first round sends it at once. A failed open drops it."""
        opening = asyncio.ensure_future(opening)
        k = self.rules.first_length(self.room)
        if not k or self.carry is not None:
            await opening
            return
        try:
            early = await self._propose(self.context, k, self.rules.controller.stop_rule())
        except BaseException:
            opening.cancel()
            raise
        await opening  # a failed open raises here, and the draft is dropped
        self.carry = early

    async def play(self, send: Callable[[Proposal], Awaitable[Verdict]]) -> tuple[Verdict, list[int]]:
        """One round: draft, `send` the draft (it returns the verdict), draft ahead while it is verified, answer the
        verdict. Returns the verdict and the tokens it commits (not committed yet: `commit`). What `send` raises is
        raised, with nothing drafted ahead kept."""
        clock, r = self.hooks.clock, self.result
        t_round = clock()
        self._drafting, self._alone = [0.0, 0], [0.0, 0]
        # a generation's first draft (drafted while its session opened, draft_while_opening) is first_k long
        k = self.rules.draft_length(self.room) if r.rounds else self.rules.first_length(self.room)
        proposal, spare = await self._draft(k)
        prompt = self._prompt  # whether it goes out at once when its verdict came (RoundSample.prompt)
        self.hooks.sending(prompt)
        t_sent, came = clock(), []

        async def verdict():
            out = await send(proposal)
            came.append(clock())  # the round trip ends when the verdict comes, not when a token drafted ahead is done
            return out

        verify = asyncio.ensure_future(verdict())
        reply = ((float("nan"), float("nan")) if self._answering is None
                 else ((t_sent - self._answering[0]) * 1000.0, self._answering[1]))
        # what the device spent between the verdict and this draft on neither drafting nor the drafter's token
        device_s = (None if self._answering is None
                    else max(0.0, t_sent - self._answering[0] - self._answering[1] / 1000.0 - self._alone[0]))
        self._live = None
        drafting = asyncio.ensure_future(self._draft_while(verify, proposal, spare))
        try:
            await asyncio.wait([verify])
            busy = not drafting.done()
            drafted = self._answer_now(verify, proposal, drafting) if self.rules.verdict_came() else None
            self._waited = busy and drafted is None
            if drafted is None:
                drafted = await drafting
        except BaseException:
            verify.cancel()
            drafting.cancel()
            raise
        t_ahead = clock() if busy and self._finishing is None else None
        try:
            verdict = await verify
        except BaseException:
            self.reset()
            raise
        verdict_at = came[0]
        committed = proposal.token_ids[: verdict.n_accepted]
        if verdict.next_token is not None:
            committed = committed + [verdict.next_token]
        spent, tokens = self._drafting
        alone_s, alone = self._alone
        ahead_s, ahead = spent - alone_s, tokens - alone
        self.rules.controller.observe(RoundSample(
            len(proposal.token_ids), verdict.n_accepted, t_sent - t_round, verdict_at - t_sent,
            verdict.token_ms / 1000.0, spent / tokens if tokens else None, verdict.step_sessions,
            None if proposal.confidence is None else tuple(proposal.confidence), verdict.step_ms / 1000.0,
            verdict.queue_ms / 1000.0, prompt, device_s, len(committed),
            None if self._answering is None else verdict_at - self._answering[0],
            ahead_s / ahead if ahead else None, alone_s / alone if alone else None))
        r.rounds += 1
        r.draft_tokens += len(proposal.token_ids)
        r.accepted_tokens += verdict.n_accepted
        r.loosely_accepted_tokens += verdict.n_loose
        r.round_times.append(clock() - t_round)
        r.round_tokens.append(len(committed))
        r.round_steps.append((verdict.step_tokens, verdict.step_ms, verdict.step_sessions))
        r.round_replies.append(reply)
        r.round_queue_ms.append(verdict.queue_ms)
        finishing_ms = 0.0 if t_ahead is None else max(0.0, t_ahead - verdict_at) * 1000.0
        self._answering = (verdict_at, finishing_ms)
        if (drafted.token_ids and verdict.n_accepted == len(proposal.token_ids)
                and verdict.next_token == drafted.token_ids[0] and not verdict.finished):
            self.carry = drafted.cut(1)  # a hit: the rest continues the new context exactly
        return verdict, committed

    async def settle(self) -> Proposal | None:
        """Wait for the drafting thread that a verdict was answered without and let the drafter drop what the
        committed context no longer holds. After a hit, return all the thread drafted ahead, the bonus token first
        (they continue the context: nothing is dropped); None after a miss, or with no thread left finishing."""
        if self._finishing is None:
            return None
        finishing, self._finishing = self._finishing, None
        ahead = await finishing
        if self._finishing_hit:
            self.drafter.accept(self.context, ahead.token_ids[1:])
            return ahead
        self.drafter.accept(self.context)
        return None

    async def _propose(self, context: list[int], k: int, stop=None) -> Proposal:
        """The drafter's next k tokens, timed into this round's drafting."""
        t0 = self.hooks.clock()
        proposal = await asyncio.to_thread(self.drafter.propose, context, k, stop)
        spent = self.hooks.clock() - t0
        self._drafting[0] += spent
        self._alone[0] += spent
        self._drafting[1] += len(proposal.token_ids)
        self._alone[1] += len(proposal.token_ids)
        return proposal

    def _answer_now(self, verify: asyncio.Future, proposal: Proposal, drafting: asyncio.Future) -> Proposal | None:
        """A verdict that comes while the drafter is on a token drafted ahead is answered without waiting for it; this
        returns the tokens drafted ahead that continue the new context: all drafted so far on a hit (the drafter's
        cache, and the token it is on, continue the new context as they are), none otherwise (the drafter rolls back
        once done: `settle`). None when the drafter is not busy (or the verdict failed): nothing to wait for."""
        if drafting.done() or verify.cancelled() or verify.exception() is not None or self._live is None:
            return None
        verdict, live = verify.result(), self._live[0]
        hit = (not verdict.finished and verdict.n_accepted == len(proposal.token_ids) and live.token_ids
               and verdict.next_token == live.token_ids[0])
        self._finishing, self._finishing_hit = drafting, bool(hit)
        return live if hit else Proposal([])

    async def _draft(self, k: int) -> tuple[Proposal, Proposal]:
        """This round's k tokens: those drafted ahead during the last round first, the rest drafted now; fewer where
        the controller's stop rule ends the draft at a token the drafter is too unsure of, or where the rules answer
        the verdict at once (RoundRules.answer). With them, the spare: the tokens drafted ahead past them, which
        continue it, so drafting ahead during its verification starts there."""
        # Out at once when its verdict came, unless that waited for a token drafted ahead or this drafts or waits below
        self._prompt = self._answering is not None and not self._waited
        if self._answering is not None:
            ahead = len(self.carry.token_ids) if self.carry is not None else 0
            hit = self._finishing_hit if self.busy else ahead > 0
            now = self.rules.answer(k, hit=hit, ahead=ahead, busy=self.busy)
            k = k if now is None else now
        if self._finishing is not None and k and (self.carry is None or len(self.carry.token_ids) < k):
            t0 = self.hooks.clock()
            self._prompt = False
            ahead = await self.settle()  # the drafter is needed now: its token first
            self.carry = None if ahead is None else ahead.cut(1)
            if self._answering is not None:  # which is part of answering the verdict
                spent = (self.hooks.clock() - t0) * 1000.0
                self._answering = (self._answering[0], self._answering[1] + spent)
        if self._finishing is not None:
            self.result.answered_at_once += 1
        carry, self.carry = self.carry, None
        if not k:
            return Proposal([]), Proposal([])
        stop = self.rules.controller.stop_rule()
        if carry is None or not carry.token_ids:
            self._prompt = False
            return await self._propose(self.context, k, stop), Proposal([])
        proposal = carry.cut(0, k)
        if stop is not None and proposal.confidence is not None:
            for i, sure in enumerate(proposal.confidence):
                if not stop.take(sure):
                    proposal = proposal.cut(0, i)
                    k = i  # the draft ends here: nothing more to draft
                    break
        self.result.ahead_rounds += 1
        self.result.ahead_tokens += len(proposal.token_ids)
        spare = carry.cut(len(proposal.token_ids))
        if (len(proposal.token_ids) < k and proposal.token_ids[-1] not in self.stop_ids
                and (stop is None or stop.more())):
            self._prompt = False
            rest = await self._propose(self.context + proposal.token_ids, k - len(proposal.token_ids), stop)
            proposal = proposal.then(rest)
        return proposal, spare

    async def _draft_while(self, verify: asyncio.Future, proposal: Proposal, spare: Proposal) -> Proposal:
        """Draft on past `proposal`, one token at a time, until its verdict is in or the next round is covered.
        It starts from `spare` (what the last round drafted ahead past this draft), which continues it exactly.
        The loop runs in one worker thread, not one hop per token: on a small device (and in the benchmark, which
        runs every device in one process) the hops would cost CPU that drafting and serving need."""
        if self._finishing is not None:  # this draft went out before the last round's drafting thread was done
            ahead = await self.settle()
            spare = Proposal([]) if ahead is None else ahead.cut(1 + len(proposal.token_ids))
        self.hooks.ahead_begins()
        try:
            return await self._ahead(proposal, spare, verify)
        finally:
            self.hooks.ahead_ends()

    async def _ahead(self, proposal: Proposal, spare: Proposal, verify: asyncio.Future) -> Proposal:
        # Tokens left once this draft and its verdict's token are in: the next draft's, and its bonus guess first.
        limit = self.rules.ahead_limit(self.room - len(proposal.token_ids) - 1)
        if not limit or (proposal.token_ids and proposal.token_ids[-1] in self.stop_ids):
            return Proposal([])
        spare = spare.cut(0, limit)
        if verify.done() or len(spare.token_ids) >= limit or (spare.token_ids and spare.token_ids[-1] in self.stop_ids):
            return spare
        arrived = threading.Event()
        verify.add_done_callback(lambda _: arrived.set())
        self._live = [spare]
        return await asyncio.to_thread(self._draft_until, self.context + proposal.token_ids, limit, arrived, spare,
                                       self._live)

    def _draft_until(self, base: list[int], limit: int, arrived: threading.Event, ahead: Proposal,
                     live: list[Proposal]) -> Proposal:
        """Draft past `base` + `ahead` (tokens already drafted there) until `arrived` is set or `limit` tokens
        are ahead, each new one shown in `live`; the drafting time and tokens count this round's new tokens only."""
        new, n = 0, 0
        t0 = self.hooks.clock()
        while not arrived.is_set() and len(ahead.token_ids) < limit:
            # the first token alone: it is the bonus guess a verdict answered at once needs shown soonest
            room = limit - len(ahead.token_ids) if ahead.token_ids else 1
            n += 1
            self.hooks.ahead_token(n, arrived)
            step = step_ahead(self.drafter, base + ahead.token_ids, room)
            if not step.token_ids:
                break
            ends = [i for i, t in enumerate(step.token_ids) if t in self.stop_ids]
            step = step.cut(0, ends[0] + 1) if ends else step
            ahead = ahead.then(step)
            live[0] = ahead
            new += len(step.token_ids)
            if step.token_ids[-1] in self.stop_ids:
                break
        self._drafting[0] += self.hooks.clock() - t0
        self._drafting[1] += new
        return ahead
