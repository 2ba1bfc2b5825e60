"""Drafting while a draft is verified (SpecEdge's proactive drafting), and answering its verdict with what was
drafted ahead. Why each rule is so: docs/device.md, "Drafting ahead".

The drafter goes on as if the server will accept the whole draft and emit the drafter's own next token as the
bonus. When the verdict says exactly that (a hit), the tokens drafted after that bonus begin the next draft; else
they are dropped with the drafter's rollback. Every token is verified with the distribution it was sampled from,
given the context it continues, so the output is unchanged."""

from __future__ import annotations

import asyncio
import threading
import time

from .drafters.base import Proposal


def step_ahead(drafter, context: list[int], limit: int) -> Proposal:
    """One step of drafting ahead: a token, or a stacked drafter's checked guesses (several from one forward)."""
    stacked = getattr(drafter, "step_ahead", None)
    return stacked(context, limit) if stacked else drafter.propose(context, 1)


class DraftAhead:
    """The drafting-ahead state of one generation (`gen`: its context, drafter, controller and policy)."""

    def __init__(self, gen):
        self.gen = gen
        self.carry: Proposal | None = None  # drafted ahead, continuing the committed context
        # This round's drafting thread's tokens drafted ahead so far, in a box of its own that it updates (None: no
        # thread), and, after a verdict answered at once from them, that thread still finishing its token; a thread
        # left finishing writes only to its own box.
        self.live: list[Proposal] | None = None
        self.finishing: asyncio.Future | None = None
        self.finishing_hit = False  # whether the tokens that thread drafts continue the committed context
        # the last verdict's arrival and the ms then spent finishing the token being drafted ahead (None: no verdict
        # in this session yet)
        self.answering: tuple[float, float] | None = None
        # Whether the last verdict waited for the token being drafted ahead before it was answered, and whether the
        # draft out now went out at once when its verdict came (RoundSample.prompt; set by `draft`).
        self.waited = False
        self.prompt = False
        self.at_once = gen.policy.answer_at_once  # this round's choice: unless the server queues the drafts

    def reset(self) -> None:
        """The session is gone: nothing drafted ahead continues a verdict."""
        self.carry, self.answering = None, None

    def answer_now(self, verify: asyncio.Future, proposal: Proposal, drafting: asyncio.Future) -> Proposal | None:
        """A verdict that comes while the drafter is on a token drafted ahead is answered without waiting for it; this
        returns the tokens drafted ahead that continue the new context: all drafted so far where the verdict accepted
        the whole draft with the drafter's own next token as its bonus (a hit: the drafter's cache, and the token it
        is on, continue the new context as they are), none otherwise (the drafter rolls back once done: `settle`).
        None when the drafter is not busy (or the verdict failed): nothing to wait for."""
        if drafting.done() or verify.cancelled() or verify.exception() is not None or self.live is None:
            return None
        verdict, live = verify.result(), self.live[0]
        hit = (not verdict.finished and verdict.n_accepted == len(proposal.token_ids) and live.token_ids
               and verdict.next_token == live.token_ids[0])
        self.finishing, self.finishing_hit = drafting, bool(hit)
        return live if hit else Proposal([])

    async def settle(self) -> Proposal | None:
        """Wait for the drafting thread that a verdict was answered without (`answer_now`) and let the drafter drop
        what the committed context no longer holds. After a hit, return all the thread drafted ahead, the bonus token
        first (they continue the context: nothing is dropped); None after a miss, or with no thread left finishing."""
        if self.finishing is None:
            return None
        finishing, self.finishing = self.finishing, None
        ahead = await finishing
        if self.finishing_hit:
            self.gen.drafter.accept(self.gen.context, ahead.token_ids[1:])
            return ahead
        self.gen.drafter.accept(self.gen.context)
        return None

    def after_verdict(self, verdict, proposal: Proposal, ahead: Proposal) -> None:
        """Keep what was drafted ahead where the verdict accepted the whole draft with the drafter's guessed bonus:
        the rest continues the new context exactly."""
        if (ahead.token_ids and verdict.n_accepted == len(proposal.token_ids)
                and verdict.next_token == ahead.token_ids[0] and not verdict.finished):
            self.carry = ahead.cut(1)

    async def draft(self, k: int) -> tuple[Proposal, Proposal]:
        """This round's k tokens: those drafted ahead during the last round first, the rest drafted now; fewer where
        the controller's stop rule ends the draft at a token the drafter is too unsure of. With them, the spare: the
        tokens drafted ahead past them, which continue it, so drafting ahead during its verification starts there.

        A controller that answers hits at once (the adaptive one) sends what was drafted ahead, at most k, at once;
        a miss answered at once gets an empty draft where the controller says so, which goes out at once too. A
        fixed K drafts the rest of its draft first."""
        gen = self.gen
        controller = gen.controller
        # Out at once when its verdict came, unless that waited for a token drafted ahead or this drafts or waits below
        self.prompt = self.answering is not None and not self.waited
        if (self.at_once and controller.answers_hits_at_once and gen.policy.ahead and self.answering is not None
                and self.carry is not None and self.carry.token_ids):
            k = min(k, len(self.carry.token_ids))
        elif (gen.policy.empty_after_miss is not None and self.finishing is not None and not self.finishing_hit
              and controller.empty_after_miss(gen.policy.empty_after_miss)):
            k = 0
        if self.finishing is not None and k and (self.carry is None or len(self.carry.token_ids) < k):
            t0 = time.perf_counter()
            self.prompt = False
            ahead = await self.settle()  # the drafter is needed now: its token first
            self.carry = None if ahead is None else ahead.cut(1)
            if self.answering is not None:  # which is part of answering the verdict
                self.answering = (self.answering[0], self.answering[1] + (time.perf_counter() - t0) * 1000.0)
        if self.finishing is not None:
            gen.result.answered_at_once += 1
        carry, self.carry = self.carry, None
        if not k:
            return Proposal([]), Proposal([])
        stop = controller.stop_rule()
        if carry is None or not carry.token_ids:
            self.prompt = False
            return await gen.propose(gen.context, k, stop), Proposal([])
        proposal = carry.cut(0, k)
        if stop is not None and proposal.confidence is not None:
            for i, sure in enumerate(proposal.confidence):
                if not stop.take(sure):
                    proposal = proposal.cut(0, i)
                    k = i  # the draft ends here: nothing more to draft
                    break
        gen.result.ahead_rounds += 1
        gen.result.ahead_tokens += len(proposal.token_ids)
        spare = carry.cut(len(proposal.token_ids))
        if (len(proposal.token_ids) < k and proposal.token_ids[-1] not in gen.stop_ids
                and (stop is None or stop.more())):
            self.prompt = False
            rest = await gen.propose(gen.context + proposal.token_ids, k - len(proposal.token_ids), stop)
            proposal = proposal.then(rest)
        return proposal, spare

    async def draft_while(self, verify: asyncio.Future, proposal: Proposal, spare: Proposal) -> Proposal:
        """Draft on past `proposal`, one token at a time, until its verdict is in or the next round is covered.
        It starts from `spare` (what the last round drafted ahead past this draft), which continues it exactly.
        The loop runs in one worker thread, not one hop per token: on a small device (and in the benchmark, which
        runs every device in one process) the hops would cost CPU that drafting and serving need."""
        gen = self.gen
        if self.finishing is not None:  # this draft went out before the last round's drafting thread was done
            ahead = await self.settle()
            spare = Proposal([]) if ahead is None else ahead.cut(1 + len(proposal.token_ids))
        # Tokens left once this draft and its verdict's token are in: the next draft's, and its bonus guess first.
        room = gen.max_tokens - len(gen.result.token_ids) - len(proposal.token_ids) - 1
        limit = min(gen.controller.k_max + 1, room)
        if (not gen.policy.ahead or (proposal.token_ids and proposal.token_ids[-1] in gen.stop_ids)
                or room <= 0):
            return Proposal([])
        spare = spare.cut(0, limit)
        if verify.done() or len(spare.token_ids) >= limit or (spare.token_ids and spare.token_ids[-1] in gen.stop_ids):
            return spare
        arrived = threading.Event()
        verify.add_done_callback(lambda _: arrived.set())
        self.live = [spare]
        return await asyncio.to_thread(self._draft_until, gen.context + proposal.token_ids, limit, arrived, spare,
                                       self.live)

    def _draft_until(self, base: list[int], limit: int, arrived: threading.Event, ahead: Proposal,
                     live: list[Proposal]) -> Proposal:
        """Draft past `base` + `ahead` (tokens already drafted there) until `arrived` is set or `limit` tokens
        are ahead, each new one shown in `live`; the drafting time and tokens count this round's new tokens only."""
        gen = self.gen
        new = 0
        t0 = time.perf_counter()
        while not arrived.is_set() and len(ahead.token_ids) < limit:
            # the first token alone: it is the bonus guess a verdict answered at once needs shown soonest
            room = limit - len(ahead.token_ids) if ahead.token_ids else 1
            step = step_ahead(gen.drafter, base + ahead.token_ids, room)
            if not step.token_ids:
                break
            ends = [i for i, t in enumerate(step.token_ids) if t in gen.stop_ids]
            step = step.cut(0, ends[0] + 1) if ends else step
            ahead = ahead.then(step)
            live[0] = ahead
            new += len(step.token_ids)
            if step.token_ids[-1] in gen.stop_ids:
                break
        gen.drafting[0] += time.perf_counter() - t0
        gen.drafting[1] += new
        return ahead
