"""Shared logic of model drafters that keep a KV cache: sync to the committed context, propose, roll back."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..sampling import SamplingParams, sample, sparse_distribution
from .base import DrafterOptions, Proposal


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class KVDrafter:
    """Subclasses implement `_eval(tokens) -> next-token logits` and `_truncate(length)` on their own cache."""

    clock = time.perf_counter  # what times its steps and checks (a stacked drafter's gate reads them)

    name = "kv"

    def __init__(self, options: DrafterOptions, eos_token_id: int, context_size: int):
        self.top_k_cap = options.top_k_cap
        self.n_ctx = context_size
        self.eos = eos_token_id
        self._evaluated: list[int] = []  # tokens whose KV the cache holds, in order
        self._logits: np.ndarray | None = None  # next-token logits after the last evaluated token
        self.sampling = SamplingParams()
        self.rng = np.random.default_rng()
        self.guesses_kept = 0  # of the last propose's guesses, those kept
        # seconds: a one-token step (an exponential mean, None until one is timed) and the last guesses' check,
        # whose forward also did the round's first step when the context had new tokens (check_replaced 1)
        self.step_s: float | None = None
        self.check_s = 0.0
        self.check_replaced = 0
        # the request's constraint (edge_client.constrained.DraftMask): each token drawn only from what it allows
        self.mask = None

    def _eval(self, tokens: list[int]) -> np.ndarray:  # [vocab] logits after the last token
        raise NotImplementedError

    def _truncate(self, length: int) -> None:
        raise NotImplementedError

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.accept(context)

    def _draw_rng(self, position: int) -> np.random.Generator:
        """With a seed, the draw for a position is keyed by the seed and the position, not by how many draws came
        before, so a run repeats exactly however many tokens were drafted ahead (a timing matter). A position is
        verified with the first draft whose context reaches the verifier, so its draw is still used once."""
        if self.sampling.seed is None:
            return self.rng
        return np.random.default_rng((self.sampling.seed, position))

    def rollback(self, length: int) -> None:
        """Forget every evaluated token from position `length` on."""
        if length < len(self._evaluated):
            self._truncate(length)
            del self._evaluated[length:]
            self._logits = None

    def _feed(self, tokens: list[int]) -> None:
        start = self.clock()
        self._logits = self._eval(tokens)
        self._evaluated.extend(tokens)
        if len(tokens) == 1:  # what a kept guess saves, for a stacked drafter's gate
            took = self.clock() - start
            self.step_s = took if self.step_s is None else 0.9 * self.step_s + 0.1 * took

    def _unsynced(self, context: list[int]) -> list[int]:
        """The context's tokens the cache lacks, after rolling back what differs; the last token is always among
        them unless the cache ends exactly there with its logits, so the next-token logits are fresh."""
        keep = common_prefix(self._evaluated, context)
        if keep == len(context) == len(self._evaluated) and self._logits is not None:
            return []
        keep = min(keep, len(context) - 1)
        self.rollback(keep)
        return context[keep:]

    def _eval_rows(self, tokens: list[int]) -> np.ndarray:  # [len(tokens), vocab] logits after each token
        """A model that computes every position's logits in one forward overrides this; here, one at a time."""
        return np.stack([self._eval([t]) for t in tokens])

    def propose(self, context: list[int], k: int, stop=None, guesses: Sequence[int] = (),
                upto_miss: bool = False) -> Proposal:
        """Up to k tokens drawn from this model. `guesses` (a model-free proposer's, taken as certain) are checked
        in one forward and each kept by the standard rejection rule against this model's distribution there, so
        the tokens and the q sent are exactly this model's, guessed or not (hierarchical drafting). `upto_miss`
        ends the draft at the token drawn where a guess was not kept (drafting ahead wants no step beyond it)."""
        k = min(k, self.n_ctx - len(context) - 1)
        if k <= 0:
            return Proposal([])
        fresh, guesses = self._unsynced(context), list(guesses[:k - 1])
        if not guesses:
            if fresh:
                self._feed(fresh)
            rows = [self._logits]
        else:  # one forward: the context's new tokens, then the guesses, each row the distribution after its token
            if len(fresh) > 2:  # a prompt, not a verdict's last draft and bonus: fed apart, not timed as the check
                self._feed(fresh[:-1])
                fresh = fresh[-1:]
            start = self.clock()
            rows = list(self._eval_rows(fresh + guesses))[max(len(fresh) - 1, 0):]
            self.check_s = self.clock() - start
            self.check_replaced = 1 if fresh else 0
            if not fresh:
                rows.insert(0, self._logits)
            self._evaluated.extend(fresh + guesses)
            self._logits = rows[-1]
        self.guesses_kept = 0
        s = self.sampling
        mask = self.mask if self.mask is not None and self.mask.sync(context) else None
        tokens: list[int] = []
        confidence: list[float] = []
        q_ids: list[np.ndarray] = []
        q_probs: list[np.ndarray] = []
        while len(tokens) < k:
            i = len(tokens)
            logits = rows[i] if i <= len(guesses) else self._logits  # rows past a dropped guess are stale
            if mask is not None:
                logits = mask.apply(logits)
            if s.greedy:
                x = int(np.argmax(logits))
                # top-1 probability of the drafter's own distribution: 1 / sum(exp(l - l_max))
                sure = float(1.0 / np.exp(logits - logits[x]).sum())
            else:
                top_k = min(s.top_k, self.top_k_cap) if s.top_k else self.top_k_cap
                ids, probs = sparse_distribution(logits, s.temperature, top_k, s.top_p)
                sure = float(probs.max())  # the top-1 probability of q, what the token is sampled from
            if stop is not None and not stop.take(sure):
                break
            guessed = i < len(guesses)
            if not s.greedy:
                rng = self._draw_rng(len(context) + i)
                # A guess (q = 1) is kept where this draw from p is the guess: with probability p(guess), and
                # otherwise the token is p without the guess, as the standard rejection rule has it; the draw is
                # the one an unguessed draft makes, so a seeded run does not depend on what was guessed.
                x = sample(ids, probs, rng)
                q_ids.append(ids)
                q_probs.append(probs)
            tokens.append(x)
            confidence.append(sure)
            if mask is not None and not mask.advance(x):
                mask = None
            if guessed and x == guesses[i]:
                self.guesses_kept += 1  # its row, the next position's logits, is already in `rows`
            elif guessed:
                guesses = guesses[:i]  # the rest were guessed after a token not drafted: drop their cache entries
                self.rollback(len(context) + i)
                if upto_miss:
                    break
            if x == self.eos:
                break
            drawn = i >= len(guesses)  # x is not yet in the cache
            # tokens the constraint forces next: taken without drafting (q = 1 on each; the server verifies them)
            forced = mask.jump(k - len(tokens)) if mask is not None and drawn else []
            tokens += forced
            confidence += [1.0] * len(forced)
            if not s.greedy:
                q_ids += [np.array([t], dtype=np.int64) for t in forced]
                q_probs += [np.ones(1, dtype=np.float32) for _ in forced]
            if stop is not None and not stop.more():
                break
            if len(tokens) < k and drawn:
                self._feed([x] + forced)
        if s.greedy:
            return Proposal(tokens, confidence=confidence)
        return Proposal(tokens, q_ids, q_probs, confidence=confidence)

    def constrain(self, mask) -> None:
        """Draw only what `mask` (a DraftMask) allows from now on; None: free again."""
        self.mask = mask

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        # Drafted-ahead tokens that continue the committed context keep their cache entries: they are proposed
        # next, and evaluating them again would cost a batch of drafter time every round accepted whole.
        self.rollback(common_prefix(self._evaluated, list(context) + list(ahead)))

    def close(self) -> None:
        pass
