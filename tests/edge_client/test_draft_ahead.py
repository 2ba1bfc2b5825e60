"""Drafting ahead (drafting on while a draft is verified) must leave the output distribution untouched.

A four-token world: the target's next-token distribution P and the drafter's Q depend on the last token only,
and differ. A fake verifier does textbook rejection sampling (Leviathan et al.) after a short wait, so the
device drafts ahead during it; the drafter is the real KVDrafter logic over a logits table. Over thousands of
runs, consecutive generated tokens must follow P, and every drafted token must go out with the distribution the
drafter sampled it from at the context it is verified in (a q shifted by one, or tokens drafted ahead for a
context that did not happen, fail that check exactly, where the statistics would see them only weakly).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import chisquare

from edge_client import codec
from edge_client.drafters.base import DrafterOptions, Proposal
from edge_client.drafters.kv_drafter import KVDrafter
from edge_client.drafters.stacked import GuessGate, StackedDrafter
from edge_client.generation import generate
from edge_client.request import Callbacks, Request
from edge_client.policy import DraftPolicy, FixedDraftLength
from edge_client.round import RoundHooks
from edge_client.sampling import SamplingParams
from tests.edge_client.test_stacked import Guesser

V, EOS = 4, 99  # EOS outside the vocabulary: generations end by length
P = np.array([[0.05, 0.75, 0.10, 0.10],
              [0.70, 0.05, 0.15, 0.10],
              [0.15, 0.10, 0.65, 0.10],
              [0.05, 0.10, 0.15, 0.70]])
# Close enough to P that many rounds are accepted whole (and drafts made ahead get used), far enough that a q
# sent for the wrong token or position shows.
Q = 0.5 * P + 0.5 * np.array([[0.40, 0.30, 0.20, 0.10],
                              [0.20, 0.30, 0.30, 0.20],
                              [0.70, 0.10, 0.10, 0.10],
                              [0.05, 0.05, 0.10, 0.80]])
# Greedy: P_GREEDY's argmax chain from 3 is 2 0 1 0 1 0 ..., Q_GREEDY's is 2 0 1 2 0 1 ...: some rounds are
# accepted whole with the bonus token the drafter guessed (a hit), others are not.
P_GREEDY = np.array([[0.1, 0.7, 0.1, 0.1],
                     [0.7, 0.1, 0.1, 0.1],
                     [0.7, 0.1, 0.1, 0.1],
                     [0.1, 0.1, 0.7, 0.1]])
Q_GREEDY = np.array([[0.1, 0.7, 0.1, 0.1],
                     [0.1, 0.1, 0.7, 0.1],
                     [0.7, 0.1, 0.1, 0.1],
                     [0.1, 0.1, 0.7, 0.1]])
PROMPT = [0, 3]
N_TOKENS = 12


class TableDrafter(KVDrafter):
    """KVDrafter over a table: the logits after a context are log table[last token]."""

    name = "table"

    def __init__(self, table=Q):
        super().__init__(DrafterOptions(top_k_cap=V), EOS, 4096)
        self.table = table
        self.proposed = 0  # tokens drafted, used or not
        self.fed: list[tuple[int, int]] = []  # (position, token) of every token evaluated into the cache

    def propose(self, context, k, stop=None, **checked):
        proposal = super().propose(context, k, stop, **checked)
        self.proposed += len(proposal.token_ids)
        return proposal

    def _eval(self, tokens):
        self.fed += [(len(self._evaluated) + i, t) for i, t in enumerate(tokens)]
        return np.log(self.table[tokens[-1]]).astype(np.float32)

    def _truncate(self, length):
        pass


MISSENT: list[tuple] = []  # drafted tokens whose q was not the drafter's distribution at their context


class FakeSession:
    """Verifies with rejection sampling against P after `delay` seconds, as a server would. It also checks that
    each drafted token comes with the drafter's distribution at the context it is verified in (Q's row of the
    token before it): the q it was sampled from, whether it was drafted ahead or not."""

    def __init__(self, context, max_tokens, seed, delay, target=P, greedy=False, drafts=None, queue_ms=0.0,
                 server_max=8):
        self.context, self.left, self.delay, self.target = list(context), max_tokens, delay, target
        self.queue_ms = queue_ms  # reported in every verdict: how long the draft waited through an earlier step
        self.drafts = [] if drafts is None else drafts  # each verified draft's length, in order
        # Greedy or not is the session's sampling, as on the server: an empty draft carries no q either way.
        self.greedy = greedy
        self.rng = np.random.default_rng(seed)
        self.opened = codec.Opened("s", server_max, V, 4096, "table")

    async def verify(self, round_, proposal: Proposal) -> codec.Verdict:
        self.drafts.append(len(proposal.token_ids))
        await asyncio.sleep(self.delay)
        if proposal.q_ids is not None:
            for last, x, ids, probs in zip(self.context[-1:] + proposal.token_ids, proposal.token_ids,
                                           proposal.q_ids, proposal.q_probs):
                sent = np.zeros(V)
                sent[ids] = probs
                if not np.allclose(sent, Q[last], atol=1e-5):
                    MISSENT.append((last, x, sent, Q[last]))
        n, out = 0, None
        for i, x in enumerate(proposal.token_ids):
            p = self.target[self.context[-1]]
            if self.greedy:
                if x == int(np.argmax(p)):
                    self.context.append(x)
                    n += 1
                    if n == self.left:
                        break
                    continue
                out = int(np.argmax(p))
                break
            q = dict(zip(proposal.q_ids[i].tolist(), proposal.q_probs[i].tolist()))
            if self.rng.random() < min(1.0, p[x] / q[x]):
                self.context.append(x)
                n += 1
                if n == self.left:
                    break
                continue
            residual = np.maximum(p - np.array([q.get(t, 0.0) for t in range(V)]), 0)
            out = int(self.rng.choice(V, p=residual / residual.sum()))
            break
        if out is None and n < self.left:
            p = self.target[self.context[-1]]
            out = int(np.argmax(p)) if self.greedy else int(self.rng.choice(V, p=p))
        if out is not None:
            self.context.append(out)
        self.left -= n + (out is not None)
        return codec.Verdict(round_, n, out, self.left <= 0, "length" if self.left <= 0 else None, token_ms=1.0,
                             step_ms=4.0, queue_ms=self.queue_ms)

    async def close(self):
        pass

    def cancel(self):
        pass


class FakeClient:
    auth_token = None

    def __init__(self, seed, delay, max_tokens=N_TOKENS, target=P, queue_ms=0.0, server_max=8):
        self.seed, self.delay, self.max_tokens, self.target = seed, delay, max_tokens, target
        self.server_max = server_max  # the Opened's max_draft_tokens
        self.queue_ms = queue_ms  # 0: the drafts find the server idle; more: each waited that long for a step
        self.drafts: list[int] = []  # the length of each draft its sessions verified

    async def open(self, msg, timeout=None, wait_for_ready=True):
        return FakeSession(PROMPT, self.max_tokens, self.seed, self.delay, self.target,
                           greedy=msg.open.sampling.temperature == 0, drafts=self.drafts, queue_ms=self.queue_ms,
                           server_max=self.server_max)


TOKENIZER = SimpleNamespace(eos_token_id=EOS, fingerprint="table",
                            stream_decoder=lambda: SimpleNamespace(feed=lambda ids: "", flush=lambda: ""))


class ChainGuesser(Guesser):
    """A model-free proposer that guesses a table's argmax chain (Q's: often what the drafter draws, often not)."""

    def __init__(self, table=Q):
        self.table = table

    def propose(self, context, k, stop=None):
        return Proposal(greedy_chain(self.table, k, last=context[-1]))


async def _runs(n, draft_ahead, seeded, delay=0.003, drafters=None, stacked=False):
    MISSENT.clear()
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64))

    async def one(i):
        drafter = StackedDrafter(ChainGuesser(), TableDrafter(), GuessGate(window=10**6)) if stacked else TableDrafter()
        if drafters is not None:
            drafters.append(drafter)
        sampling = SamplingParams(temperature=1.0, seed=i if seeded else None)
        policy = DraftPolicy(draft_tokens=2, adaptive=False, draft_ahead=draft_ahead)
        return await generate(FakeClient(10_000 + i, delay), drafter, TOKENIZER,
                              Request(PROMPT, N_TOKENS, sampling, policy))

    results = []
    for start in range(0, n, 200):
        results += await asyncio.gather(*[one(i) for i in range(start, min(n, start + 200))])
    return results


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-draws", "fresh-draws"])
def test_drafting_ahead_keeps_the_target_distribution(seeded):
    """P is a Markov chain, so every generated token, given the one before it, must follow that token's row of P:
    the transition counts over all runs and positions are checked row by row (chi-square)."""
    results = asyncio.run(_runs(3000, True, seeded))
    assert all(len(r.token_ids) == N_TOKENS for r in results)
    assert not MISSENT, MISSENT[:3]
    assert sum(r.ahead_tokens for r in results) > 0.08 * sum(r.draft_tokens for r in results)  # ahead drafts were used
    assert_follows_p(results)


def test_stacked_drafting_ahead_keeps_the_target_distribution():
    """A stacked drafter drafts ahead several tokens a step (its guesses checked in one forward, up to the first
    not kept): every token still goes out with the model's q at its context, and the text follows P."""
    drafters = []
    results = asyncio.run(_runs(3000, True, True, drafters=drafters, stacked=True))
    assert all(len(r.token_ids) == N_TOKENS for r in results)
    assert not MISSENT, MISSENT[:3]
    assert sum(r.ahead_tokens for r in results) > 0.08 * sum(r.draft_tokens for r in results)
    assert sum(d.kept for d in drafters) > 0 and sum(d.guessed for d in drafters) > sum(d.kept for d in drafters)
    assert_follows_p(results)


def test_a_stacked_ahead_step_is_the_kept_guesses_and_the_token_after_them():
    model = TableDrafter(Q_GREEDY)
    stacked = StackedDrafter(ChainGuesser(Q_GREEDY), model, GuessGate(window=10**6))
    stacked.begin(PROMPT, SamplingParams())
    chain = greedy_chain(Q_GREEDY, 6)
    # guesses all right: the three checked in one forward and the token after them
    assert stacked.step_ahead(PROMPT, 4).token_ids == chain[:4]
    assert model.guesses_kept == 3 and stacked.checks == 1
    # the second guess wrong: the step ends at the model's own token there, nothing drafted past it
    context = PROMPT + chain[:4]
    stacked.proposer = Guesser([chain[4], (chain[5] + 1) % V, 0])
    assert stacked.step_ahead(context, 4).token_ids == chain[4:6]
    assert model.guesses_kept == 1 and model._evaluated == context + chain[4:5]
    # a limit of one token leaves nothing to guess: one model step
    assert stacked.step_ahead(PROMPT + chain[:6], 1).token_ids == greedy_chain(Q_GREEDY, 1, last=chain[5])
    assert stacked.checks == 2


def assert_follows_p(results):
    """Every generated token, given the one before it, follows that token's row of P (chi-square per row)."""
    counts = np.zeros((V, V))
    for r in results:
        seq = PROMPT[-1:] + r.token_ids
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    for a in range(V):
        assert chisquare(counts[a], P[a] * counts[a].sum()).pvalue > 1e-4, (a, counts[a] / counts[a].sum(), P[a])


def test_greedy_hits_continue_and_misses_are_dropped():
    async def main():
        drafter = TableDrafter(Q_GREEDY)
        result = await generate(
            FakeClient(0, 0.003, max_tokens=30, target=P_GREEDY),
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=30, policy=DraftPolicy(draft_tokens=2, adaptive=False)),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert result.token_ids == greedy_chain(P_GREEDY, 30)
    assert 0 < result.ahead_rounds < result.rounds - 1  # hits and misses both happened
    context = PROMPT + result.token_ids
    assert drafter._evaluated == context[:len(drafter._evaluated)]  # nothing drafted ahead stayed in its cache


def test_seeded_runs_repeat_exactly_however_much_was_drafted_ahead():
    """How many tokens a device drafts ahead depends on timing; with a seed, the text must not."""
    counts = {}
    texts = {}
    for name, ahead, delay in (("plain", False, 0.002), ("ahead-short", True, 0.0005), ("ahead-long", True, 0.004)):
        drafters = []
        texts[name] = [r.token_ids for r in asyncio.run(_runs(200, ahead, True, delay, drafters))]
        counts[name] = sum(d.proposed for d in drafters)
    assert texts["plain"] == texts["ahead-short"] == texts["ahead-long"]
    assert counts["ahead-long"] > counts["plain"]  # drafting ahead drew tokens that were never sent


def greedy_chain(table, n, last=PROMPT[-1]):
    """The greedy text after `last` (PROMPT's end): n tokens, each its table row's argmax after the one before."""
    out = []
    for _ in range(n):
        last = int(np.argmax(table[last]))
        out.append(last)
    return out


def cycle(*succ):
    """A greedy table whose argmax after token t is succ[t]."""
    table = np.full((V, V), 0.1)
    table[np.arange(V), succ] = 0.7
    return table


@pytest.mark.parametrize("target,k,hits_only", [(cycle(1, 2, 3, 1), 3, True), (cycle(1, 2, 3, 0), 2, False)],
                         ids=["all-hits", "hits-and-misses"])
def test_tokens_drafted_ahead_are_not_evaluated_again_when_they_go_out(target, k, hits_only):
    """A round accepted whole with the guessed bonus sends the tokens drafted ahead; the drafter's cache keeps
    them (their keys and values are already there), so each position is evaluated once as long as no verdict
    contradicts it. Evaluating them again costs a real drafter a batch of work every such round."""
    async def main():
        drafter = TableDrafter(cycle(1, 2, 3, 1))
        result = await generate(
            FakeClient(0, 0.004, max_tokens=40, target=target),
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=40, policy=DraftPolicy(draft_tokens=k, adaptive=False)),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert result.ahead_rounds > 2
    assert result.token_ids == greedy_chain(target, 40)
    positions = [pos for pos, _ in drafter.fed]
    if hits_only:
        assert result.accepted_tokens == result.draft_tokens
        assert len(positions) == len(set(positions))
    else:
        # After a miss a position is evaluated again, with the target's token: never the same token twice.
        assert len(drafter.fed) == len(set(drafter.fed))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_no_token_is_drafted_past_the_request_end(adaptive):
    """A round drafts at most max_tokens - committed - 1 tokens (the verdict adds one), and drafting ahead stops
    where the request would end: tokens past it would be clipped by the server, their drafting wasted and
    counted as rejected (the adaptive controller then sees a worse drafter than it has). A drafter that is always
    right must see every drafted token accepted, and draft no more than the request's tokens in all."""
    table = cycle(1, 2, 3, 1)

    async def main():
        drafter = TableDrafter(table)
        result = await generate(
            FakeClient(0, 0.01, max_tokens=10, target=table),
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=10, policy=DraftPolicy(draft_tokens=8, adaptive=adaptive)),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert len(result.token_ids) == 10
    assert result.draft_tokens >= 8
    assert result.accepted_tokens == result.draft_tokens
    assert drafter.proposed <= 10


def test_the_first_draft_is_made_while_the_session_opens():
    """The server prefills the prompt while the device drafts its first round: the fake open waits for the drafter
    to have proposed; a device drafting only after the open returned would leave it waiting out its 60 s and find
    nothing proposed."""
    import threading

    table = cycle(1, 2, 3, 1)
    proposed = threading.Event()
    seen = []  # whether the open saw a proposal while it was open

    class Drafter(TableDrafter):
        def propose(self, context, k, stop=None):
            proposal = super().propose(context, k, stop)
            proposed.set()
            return proposal

    class SlowOpen(FakeClient):
        async def open(self, msg, timeout=None, wait_for_ready=True):
            seen.append(await asyncio.to_thread(proposed.wait, 60.0))
            return await super().open(msg, timeout, wait_for_ready)

    async def main():
        drafter = Drafter(table)
        result = await generate(
            SlowOpen(0, 0.001, max_tokens=20, target=table),
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=20, policy=DraftPolicy(draft_tokens=4, adaptive=False, draft_ahead=False)),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert seen == [True]
    assert result.token_ids == greedy_chain(table, 20)
    assert result.accepted_tokens == result.draft_tokens  # the early draft went out as drafted, nothing lost
    assert drafter.proposed == result.draft_tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_device_asking_longer_drafts_than_the_server_takes_is_told_and_drafts_the_servers_limit(adaptive):
    """A K above the server's max_draft_tokens is capped to it: the device says so once, not silently (a benchmark
    once reported K 31 while its device drafted 16), and no draft goes out longer."""
    table = cycle(1, 2, 3, 1)
    for server_max, told in ((3, ["the server takes drafts of at most 3 tokens: drafting up to 3 a round, not 6"]),
                             (8, [])):
        statuses: list[str] = []
        client = FakeClient(0, 0.001, max_tokens=30, target=table, server_max=server_max)
        result = asyncio.run(
            generate(
                client,
                TableDrafter(table),
                TOKENIZER,
                Request(
                    PROMPT, max_tokens=30, policy=DraftPolicy(draft_tokens=6, adaptive=adaptive, max_draft_tokens=6)
                ),
                callbacks=Callbacks(on_status=statuses.append),
            )
        )
        assert result.token_ids == greedy_chain(table, 30)
        assert statuses == told
        assert max(client.drafts) == min(server_max, 6)


def test_a_device_keeping_its_controller_is_told_of_a_servers_limit_once():
    """The daemon keeps one adaptive controller across its requests: a server's bound on K is told at the first
    request, not at every one; a server with another bound is told again."""
    from edge_client.adaptive import AdaptiveDraftLength

    table = cycle(1, 2, 3, 1)
    controller = AdaptiveDraftLength.for_device(6, ahead=True)
    told = []
    for server_max in (3, 3, 4, 8, 4):
        statuses: list[str] = []
        client = FakeClient(0, 0.001, max_tokens=12, target=table, server_max=server_max)
        result = asyncio.run(
            generate(
                client,
                TableDrafter(table),
                TOKENIZER,
                Request(PROMPT, max_tokens=12, policy=DraftPolicy(draft_tokens=6, max_draft_tokens=6)),
                controller=controller,
                callbacks=Callbacks(on_status=statuses.append),
            )
        )
        assert result.token_ids == greedy_chain(table, 12)
        assert max(client.drafts) <= min(server_max, 6)  # the controller picks its K under the bound
        told.append(statuses)
    limit = "the server takes drafts of at most {0} tokens: drafting up to {0} a round, not 6"
    assert told == [[limit.format(3)], [], [limit.format(4)], [], [limit.format(4)]]


def held_at_two():
    """The adaptive controller held at K = 2 under a bound of 8 (the real one, its choice fixed and played: no finished
    drafts tried)."""
    from edge_client.adaptive import AdaptiveDraftLength

    class Held(AdaptiveDraftLength):
        TRY_FINISHED = False

        def choose(self):
            return 2

    return Held(k_max=8, k_initial=2, ahead=True)


def test_a_carry_longer_than_the_next_draft_is_not_drafted_again():
    """With the adaptive K under its bound, a device drafts ahead up to the bound while its draft is verified, and the
    next draft takes only K of those tokens. The rest continue that draft exactly: drafting ahead during its
    verification starts from them. Thrown away and drafted again (as before), every position past K was drafted
    two or three times: real drafting time on the device. An always-right drafter must draft each position once."""
    table = cycle(1, 2, 3, 1)

    async def main():
        drafter = TableDrafter(table)
        result = await generate(
            FakeClient(0, 0.004, max_tokens=40, target=table),
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=40, policy=DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8)),
            controller=held_at_two(),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert result.token_ids == greedy_chain(table, 40)
    assert result.accepted_tokens == result.draft_tokens
    assert result.rounds >= 10 and result.ahead_rounds == result.rounds - 1  # drafts of 2 from longer carries
    positions = [pos for pos, _ in drafter.fed]
    assert len(positions) == len(set(positions)) and drafter.proposed <= 40


def test_a_generations_first_draft_is_the_controllers_first_k_and_goes_out_whole():
    """The first draft, drafted while the session opens, is first_k long (the adaptive model's way prices it with
    nothing drafted ahead to hide it): it goes out whole, not cut to the K the later rounds play, and none of it is
    drafted again."""
    table = cycle(1, 2, 3, 1)

    class FirstSix(type(held_at_two())):
        first_k = 6

    async def main():
        drafter = TableDrafter(table)
        client = FakeClient(0, 0.004, max_tokens=30, target=table)
        result = await generate(
            client, drafter, TOKENIZER,
            Request(PROMPT, max_tokens=30, policy=DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8)),
            controller=FirstSix(k_max=8, k_initial=2, ahead=True),
        )
        return drafter, client, result

    drafter, client, result = asyncio.run(main())
    assert result.token_ids == greedy_chain(table, 30)
    assert client.drafts[0] == 6 and set(client.drafts[1:-1]) == {2}
    positions = [pos for pos, _ in drafter.fed]
    assert len(positions) == len(set(positions))


def test_a_carried_spare_keeps_each_tokens_q():
    """Sampling, the same: the tokens kept past a draft go out later with the q they were drawn from at the context
    they are verified in. (A seeded text is not compared with a device that waits: with the adaptive controller a
    draft answering a verdict is what was drafted ahead by then, so how the server's draws fall follows timing, as
    the adaptive K's choice does; README: a seeded run repeats exactly with --no-adaptive. The distribution is
    checked in test_drafts_answered_at_once_keep_the_target_distribution.)"""
    async def main():
        MISSENT.clear()
        results = []
        for i in range(40):
            asked = Request(PROMPT, 24, SamplingParams(temperature=1.0, seed=i),
                            DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8))
            results.append(
                await generate(FakeClient(500 + i, 0.004, max_tokens=24), TableDrafter(), TOKENIZER, asked,
                               controller=held_at_two())
            )
        return results, list(MISSENT)

    results, missent = asyncio.run(main())
    assert not missent, missent[:3]
    assert all(len(r.token_ids) == 24 for r in results)
    assert sum(r.ahead_tokens for r in results) > 100  # drafts went out from carries


def test_each_round_times_the_reply_to_the_verdict_before_it(mid_token, monkeypatch):
    """round_replies: per verified round, the ms from the previous verdict's arrival to this draft going out, and the
    part of it spent finishing the token being drafted ahead when that verdict came (nan for a session's first
    round). A drafter taking 20 ms a token, each verdict held until it is on its first token drafted ahead and that
    token until the verdict is in (MidToken): the device finishes it first, about 20 ms; waiting instead of drafting
    ahead, it finishes nothing."""
    class Slow(TableDrafter):
        def _eval(self, tokens):
            time.sleep(0.02 * len(tokens))
            return super()._eval(tokens)

    async def main(ahead):
        client, drafter = mid_token(Linked(0, 0.0, max_tokens=16, target=P_GREEDY, queue_ms=6.0), Slow(Q_GREEDY),
                                    held=lambda round_: 1)
        samples = []
        monkeypatch.setattr(FixedDraftLength, "observe", lambda self, sample: samples.append(sample))
        result = await generate(
            client,
            drafter,
            TOKENIZER,
            Request(PROMPT, max_tokens=16, policy=DraftPolicy(draft_tokens=2, adaptive=False, draft_ahead=ahead)),
            callbacks=Callbacks(hooks=client.link),
        )
        return result, samples

    for ahead in (True, False):
        result, samples = asyncio.run(main(ahead))
        replies = result.round_replies
        assert len(replies) == result.rounds >= 4
        # the device's own share of each reply (RoundSample.device_s): neither the finishing nor the drafting in it
        assert samples[0].device_s is None and len(samples) == result.rounds
        own, timed = np.array([s.device_s for s in samples[1:]]) * 1000.0, np.array(replies[1:])
        assert (own >= 0).all() and (own <= timed[:, 0] - timed[:, 1] + 1e-6).all()
        if not ahead:  # the next draft's tokens, 20 ms each (one at the request's end), are drafting
            assert (own < timed[:, 0] - 15.0).all()
        assert result.round_queue_ms == [6.0] * result.rounds  # each verdict's queue_ms, as the server sent it
        assert np.isnan(replies[0][0]) and np.isnan(replies[0][1])
        timed = np.array(replies[1:])
        assert (timed[:, 1] >= 0).all() and (timed[:, 1] < timed[:, 0]).all()  # the finishing is part of the reply
        if ahead:
            assert np.median(timed[:, 1]) > 8.0
        else:
            assert (timed[:, 1] == 0).all()
            assert (timed[:, 0] > 15.0).all()  # it drafts the whole next draft after the verdict, 2 x 20 ms


class SlowTable(TableDrafter):
    """A table drafter taking `seconds` per evaluated token, so that verdicts come while it drafts ahead."""

    def __init__(self, table=Q, seconds=0.01):
        super().__init__(table)
        self.seconds = seconds

    def _eval(self, tokens):
        time.sleep(self.seconds * len(tokens))
        return super()._eval(tokens)


def _slow_cycle_run(hold, queue_ms=0.0, **options):
    """40 greedy tokens from a 10 ms-a-token drafter that misses every fourth token, the adaptive controller held at
    K = 2, each verdict held until the drafter is on its third token drafted ahead (the bonus guess and one token to
    answer a hit with) and that token until the verdict is in (`hold`: the mid_token fixture's); checks the text and
    the drafter's cache (no position evaluated twice with the same token, nothing held off the committed text) and
    returns (drafter, result, each draft's length as the server saw it)."""
    client = Linked(0, 0.0, max_tokens=40, target=cycle(1, 2, 3, 0), queue_ms=queue_ms)

    async def main():
        drafter = SlowTable(cycle(1, 2, 3, 1), 0.01)
        hold(client, drafter, held=lambda round_: 3)
        result = await generate(
            client,
            drafter,
            TOKENIZER,
            Request(
                PROMPT, max_tokens=40, policy=DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8, **options)
            ),
            controller=held_at_two(),
            callbacks=Callbacks(hooks=client.link),
        )
        return drafter, result

    drafter, result = asyncio.run(main())
    assert result.token_ids == greedy_chain(cycle(1, 2, 3, 0), 40)
    assert len(drafter.fed) == len(set(drafter.fed))
    assert drafter._evaluated == (PROMPT + result.token_ids)[:len(drafter._evaluated)]
    assert len(client.drafts) == result.rounds and sum(client.drafts) == result.draft_tokens
    return drafter, result, client.drafts


def test_a_verdict_is_answered_at_once_with_what_was_drafted_ahead(mid_token):
    """With the adaptive controller (held at K = 2, under a bound of 8) and drafting ahead, a verdict that comes while
    the drafter is on a token drafted ahead (10 ms a token; held there: MidToken) is answered at once,
    while the drafter finishes that token: after a hit (the whole draft accepted, the guessed bonus right) with the
    tokens drafted ahead, at most K; after a miss, with empty drafts off (empty_after_miss=None, next test), the
    device drafts K afresh. Finishing the token first sent the draft after the server's batching window, into the
    step after the next. The drafter's cache must stay right meanwhile: the target's text,
    no position evaluated twice with the same token (the drafter's table misses every fourth token; after a miss a
    position is evaluated again, with the target's token), and nothing it holds off the committed text."""
    drafter, result, drafts = _slow_cycle_run(mid_token, empty_after_miss=None)
    assert result.answered_at_once >= 5
    assert 0 not in drafts  # no empty draft: after a miss, 2 drafted afresh
    replies = np.array(result.round_replies[1:])
    # those went out at once: no time spent finishing the token being drafted ahead
    assert (replies[:, 1] == 0).sum() >= result.answered_at_once
    assert (replies[:, 0] > 15.0).sum() >= 5  # after a miss: a draft of 2 drafted afresh, 2 x 10 ms


def test_a_device_whose_drafts_queue_at_the_server_finishes_its_draft_instead_of_answering_at_once(mid_token):
    """The same run with every verdict reporting that its draft waited 6 ms through an earlier step (a server whose
    steps follow each other): a shorter draft sent at once would only wait longer, so once the controller has seen
    that of its most recent drafts sent at once (QUEUED_MIN) the device answers as with answer_at_once=False,
    finishing its token and drafting the rest of K."""
    from edge_client.adaptive import AdaptiveDraftLength

    drafter, result, drafts = _slow_cycle_run(mid_token, queue_ms=6.0, empty_after_miss=None)
    # Only before the controller knew: it learns from the drafts sent at once, here the hits (QUEUED_MIN of them),
    # every other round from the second (a miss is drafted afresh, late, with empty_after_miss=None).
    learnt = 2 * AdaptiveDraftLength.QUEUED_MIN + 1
    assert result.answered_at_once <= AdaptiveDraftLength.QUEUED_MIN
    after = drafts[learnt:-1]
    assert len(after) >= 6 and all(n == 2 for n in after)  # K drafts
    replies = np.array(result.round_replies[learnt:])
    # each waited for the token being drafted ahead (10 ms), but the last: at the request's end none is held
    assert (replies[:-1, 1] > 1.0).all()


class LateQueues(FakeClient):
    """A server whose first `busy` drafts each waited 6 ms through an earlier step, and after them only the late drafts:
    those that did not go out at once when the verdict before them came (the device finished a token and drafted the
    rest of K first), which miss the batching window that verdict's step opened, as at an unloaded server. Whether a
    draft went out at once is the device's own account (RoundHooks.sending, read through `went_out_at_once`), not a
    clock: on a loaded host a draft sent at once can take a few ms to go out."""

    def __init__(self, *args, busy=5, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = busy
        self.went_out_at_once = False  # of the draft being sent: set by the round's hook

    async def open(self, msg, timeout=None, wait_for_ready=True):
        session = await super().open(msg, timeout, wait_for_ready)
        inner, busy = session.verify, [self.busy]

        async def verify(round_, proposal):
            session.queue_ms = 6.0 if busy[0] > 0 or not self.went_out_at_once else 0.0
            busy[0] -= 1
            return await inner(round_, proposal)

        session.verify = verify
        return session


def test_a_device_answers_at_once_again_once_drafts_sent_at_once_stop_queueing():
    """After a busy spell (the first 5 drafts queued) the device finishes its drafts (server_queues), and those,
    late, keep queueing at this server though drafts answering verdicts at once no longer would. Judged on every
    draft, that held the device at finishing first for the rest of the request (2 of 60 verdicts answered at once,
    in the busy spell; every draft queued); judged on the drafts that went out at once, which leave the recent rounds
    while it finishes first, it answers each hit at once again (a miss, every other round here, is drafted afresh
    with empty_after_miss=None, late, and queues) and those drafts do not queue."""
    client = LateQueues(0, 0.025, max_tokens=120, target=cycle(1, 2, 3, 0))

    class Sending(RoundHooks):
        def sending(self, at_once):
            client.went_out_at_once = at_once

    async def main():
        return await generate(
            client,
            SlowTable(cycle(1, 2, 3, 1), 0.01),
            TOKENIZER,
            Request(
                PROMPT,
                max_tokens=120,
                policy=DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8, empty_after_miss=None),
            ),
            controller=held_at_two(),
            callbacks=Callbacks(hooks=Sending()),
        )

    result = asyncio.run(main())
    assert result.token_ids == greedy_chain(cycle(1, 2, 3, 0), 120)
    assert result.rounds >= 30
    assert result.answered_at_once >= result.rounds // 4, (result.answered_at_once, result.rounds)
    assert result.round_queue_ms[-10:].count(0.0) >= 3  # at the end the hits' drafts go out at once, not queued


def test_answer_at_once_off_finishes_the_token_first(mid_token):
    """answer_at_once=False, the device before this change (kept as a policy setting): the same drafter and target
    answer no verdict at once; a verdict that comes mid-token (held until the drafter is on its third token drafted
    ahead, past the bonus guess and one token to answer a hit with, and that token until the verdict is in: MidToken)
    waits for that token, and the drafts are K long."""
    drafter, result, drafts = _slow_cycle_run(mid_token, answer_at_once=False)
    assert result.answered_at_once == 0
    assert result.draft_tokens >= 2 * result.rounds - 2  # K = 2 but near the end of the request
    replies = np.array(result.round_replies[1:])
    # each waited for the token being drafted ahead (10 ms), but the last: at the request's end none is held
    assert (replies[:-1, 1] > 1.0).all() and len(replies) >= 10


@pytest.mark.parametrize("threshold,empty", [(0.5, True), (0.99, False)], ids=["strong", "weak"])
def test_a_miss_is_answered_with_an_empty_draft_only_above_the_acceptance_threshold(threshold, empty, mid_token):
    """empty_after_miss: a miss answered at once goes out with no draft (the server's token alone, in the step that
    verdict's window opens) where the controller's acceptance is at least the threshold, and with K drafted afresh
    below it, so that a weak drafter keeps speculating. Here the drafter misses every fourth token (acceptance
    about 0.7): above 0.5, under 0.99. The text and the drafter's cache must stay right either way."""
    drafter, result, drafts = _slow_cycle_run(mid_token, empty_after_miss=threshold)
    replies = np.array(result.round_replies[1:])
    empties = [i for i, n in enumerate(drafts[1:]) if n == 0]
    if empty:
        # About one miss in three rounds; the controller needs two rounds before it has an acceptance to compare.
        assert len(empties) >= 3
        assert (replies[empties, 1] == 0).all()  # each went out at once: no time spent finishing the drafter's token
    else:
        assert empties == []  # every miss answered with a draft of K = 2, drafted afresh
        assert result.answered_at_once >= 3  # the hits still went out at once


class MidToken(RoundHooks):
    """Holds each verdict of a session until its device's drafting thread is on a token drafted ahead, and that token
    until the verdict has gone out, so that every verdict the device drafts ahead for comes mid-token, whatever the
    host's load: on the first token drafted ahead in even rounds (nothing drafted ahead yet to answer with), on the
    second in odd ones (one), or on the token `held(round_)` names. A round the device drafts nothing ahead for (the
    request's end, or a carry that covers the next draft) is not held."""

    def __init__(self, held=lambda round_: 1 + round_ % 2):
        self.held = held
        self.loop, self.changed = asyncio.get_running_loop(), asyncio.Event()
        self.cv = threading.Condition()
        self.out = 0  # verdicts sent
        self.round = 0  # the round whose drafting ahead is under way
        self.ready = 0  # rounds whose drafting thread is on the token its verdict waits for, or that draft no more

    def ahead_begins(self) -> None:
        self.round = self.out  # its verdict is held until this round is ready, so this is its number

    def ahead_token(self, n: int, arrived: threading.Event) -> None:
        self.on_token(self.round, n, arrived)

    def ahead_ends(self) -> None:
        self._ready(self.round)  # it drafted nothing ahead, or its thread is done

    def _ready(self, round_: int) -> None:
        with self.cv:
            self.ready = max(self.ready, round_ + 1)
        self.loop.call_soon_threadsafe(self.changed.set)

    def on_token(self, round_: int, n: int, arrived: threading.Event) -> None:
        """The drafting thread of the round after `round_` verdicts starts its n-th token drafted ahead; held, it
        drafts that token once the device has the verdict (`arrived`), and no more."""
        if n == self.held(round_):
            self._ready(round_)
            with self.cv:
                self.cv.wait_for(lambda: self.out > round_, timeout=30)
            arrived.wait(30)

    async def verdict(self, send):
        while True:
            self.changed.clear()
            if self.ready > self.out:
                break
            await self.changed.wait()
        verdict = await send()
        with self.cv:
            self.out += 1
            self.cv.notify_all()
        return verdict


class Linked(FakeClient):
    """A FakeClient whose sessions are held by the MidToken `link` (the mid_token fixture)."""

    async def open(self, msg, timeout=None, wait_for_ready=True):
        session = await super().open(msg, timeout, wait_for_ready)
        session.link = self.link
        return session


@pytest.fixture
def mid_token(monkeypatch):
    """Every FakeSession held by its client's MidToken `link`; it gives `hold(client, drafter, held=...)`, which
    links a Linked client to a new MidToken and returns it with the drafter, the MidToken being the round's hooks
    (generate(..., hooks=client.link))."""
    verify = FakeSession.verify

    async def held_verify(self, round_, proposal):
        return await self.link.verdict(lambda: verify(self, round_, proposal))

    monkeypatch.setattr(FakeSession, "verify", held_verify)

    def hold(client, drafter, **held):
        """A Linked client and its drafter, held by one MidToken (made in the running loop: `held` as there)."""
        client.link = MidToken(**held)
        return client, drafter

    return hold


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-draws", "fresh-draws"])
def test_drafts_answered_at_once_keep_the_target_distribution(seeded, mid_token):
    """The distribution check above, with verdicts answered at once from the tokens drafted ahead (every verdict held
    until the drafter is on a token drafted ahead: MidToken): each drafted token must still go out with the q it was
    drawn from at the context it is verified in (a token taken from a drafting thread that belongs to an earlier
    round, or a spare cut at the wrong place, fails that), and the text must follow P."""
    async def main():
        MISSENT.clear()
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=128))

        async def one(i):
            sampling = SamplingParams(temperature=1.0, seed=i if seeded else None)
            client, drafter = mid_token(Linked(20_000 + i, 0.0), SlowTable(Q, 0.0005))
            asked = Request(PROMPT, N_TOKENS, sampling, DraftPolicy(draft_tokens=2, adaptive=True, max_draft_tokens=8))
            return await generate(client, drafter, TOKENIZER, asked, controller=held_at_two(),
                                  callbacks=Callbacks(hooks=client.link))

        results = []
        for start in range(0, 2000, 50):  # a drafting thread held and one finishing at most each: under the workers
            results += await asyncio.gather(*[one(i) for i in range(start, start + 50)])
        return results

    results = asyncio.run(main())
    assert all(len(r.token_ids) == N_TOKENS for r in results)
    assert not MISSENT, MISSENT[:3]
    # about half the rounds: those after a verdict that came mid-token (the request's last rounds and a carry that
    # covers the next draft draft nothing ahead)
    assert sum(r.answered_at_once for r in results) > 0.4 * sum(r.rounds for r in results)
    assert_follows_p(results)
