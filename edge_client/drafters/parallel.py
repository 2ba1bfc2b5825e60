"""Parallel drafter: a model of `sled-train parallel`, whose one forward gives K slots' distributions (SpecFormer's
draft block; with a blank, the CTC drafter's). Each token is drawn from its slot alone, and that slot's distribution is
its q, so verification stays lossless: q need not depend on the tokens drafted before it, only be what it was drawn
from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..sampling import sample, sparse_distribution
from .base import DrafterOptions, Proposal
from .onnx import OnnxDrafter


class ParallelDrafter(OnnxDrafter):
    name = "parallel"

    def __init__(self, options: DrafterOptions):
        super().__init__(options)
        self.slots = int(self.meta["slots"])
        self.blank = self.meta.get("blank_id")  # CTC: the extra last logit of every slot
        self.eos_ids = set(self.meta.get("eos_token_ids", [self.eos]))

    def _eval_rows(self, tokens: list[int]) -> np.ndarray:
        """The slots' logits after the last token [S, vocab (+1)]; the cache gains the tokens."""
        logits, self._keys, self._values = self.session.run(
            ["slot_logits", "present_keys", "present_values"],
            {"input_ids": np.asarray([tokens], dtype=np.int64), "past_keys": self._keys, "past_values": self._values},
        )
        return logits[0]

    def _eval(self, tokens: list[int]) -> np.ndarray:
        return self._eval_rows(tokens)

    def _draw(self, row: np.ndarray, position: int, mask) -> tuple[int, float, np.ndarray | None, np.ndarray | None]:
        """A slot's token, its confidence, and (sampling) the sparse distribution it was drawn from."""
        if mask is not None:
            vocab = mask.apply(row if self.blank is None else row[:self.blank])
            row = vocab if self.blank is None else np.append(vocab, row[self.blank])
        s = self.sampling
        if s.greedy:
            x = int(np.argmax(row))
            return x, float(1.0 / np.exp(row - row[x]).sum()), None, None
        top_k = min(s.top_k, self.top_k_cap) if s.top_k else self.top_k_cap
        ids, probs = sparse_distribution(row, s.temperature, top_k, s.top_p)
        return sample(ids, probs, self._draw_rng(position)), float(probs.max()), ids, probs

    def propose(self, context: list[int], k: int, stop=None, guesses: Sequence[int] = (),
                upto_miss: bool = False) -> Proposal:
        """Up to k tokens from one forward: slot j's token for position j, or with a blank, the slots' tokens with
        repeats merged and blanks dropped (each kept token's q is its slot's distribution without the blank and the
        slot before's token, which it could not be)."""
        k = min(k, self.n_ctx - len(context) - 1, self.slots)
        if k <= 0:
            return Proposal([])
        fresh = self._unsynced(context)
        if fresh:
            self._feed(fresh)
        rows = self._logits
        mask = self.mask if self.mask is not None and self.mask.sync(context) else None
        tokens, confidence, q_ids, q_probs = [], [], [], []
        prev = None
        for j in range(self.slots):
            if len(tokens) >= k:
                break
            x, sure, ids, probs = self._draw(rows[j], len(context) + j, mask)
            if self.blank is not None:
                before, prev = prev, x
                if x == self.blank or x == before:
                    continue
                if ids is not None:
                    keep = (ids != self.blank) & (ids != (-1 if before is None else before))
                    ids, probs = ids[keep], probs[keep] / probs[keep].sum(dtype=np.float32)
                    sure = float(probs.max())
            if stop is not None and not stop.take(sure):
                break
            tokens.append(x)
            confidence.append(sure)
            if ids is not None:
                q_ids.append(ids)
                q_probs.append(probs)
            if x in self.eos_ids:
                break
            if mask is not None and not mask.advance(x):
                mask = None
            if stop is not None and not stop.more():
                break
        if self.sampling.greedy:
            return Proposal(tokens, confidence=confidence)
        return Proposal(tokens, q_ids, q_probs, confidence=confidence)

    def step_ahead(self, context: list[int], limit: int) -> Proposal:
        """One step of drafting ahead (edge_client.round): every slot's token from one forward, not one token a
        forward as a plain drafter's, so the drafter is done, not mid-forward, when the verdict comes."""
        return self.propose(context, limit)
