"""Structured output at the verifier, with llguidance: a session's constraint compiled once for the target's
tokenizer, its matcher advanced by the tokens the session commits, and the target's logits masked at every
position of a draft with what the constraint allows after the draft's tokens before it.

A draft token the constraint forbids has probability 0 under the masked target, so the rejection sampler rejects
it and draws the next token from the masked distribution: the output is the masked target's, as lossless as
without a constraint."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch

from sled.constraints import Constraint

from .errors import invalid

BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Compiles constraints for one target's tokenizer (a transformers fast tokenizer), keeping the most recent
    `keep` compiled by their grammar's hash: sessions that share a schema compile it once."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...], keep: int = 256):
        self._hf, self.vocab_size, self.eos_ids, self.keep = tokenizer, vocab_size, eos_ids, keep
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it, built at the first constraint (about a second)."""
        if self._ll is None:
            if self._hf is None:
                raise invalid("this server cannot take constraints: its target has no tokenizer to compile them for")
            from llguidance.hf import from_tokenizer

            self._ll = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=list(self.eos_ids) or None)
        return self._ll

    def matcher(self, constraint: Constraint, generated: list[int] = ()) -> llguidance.LLMatcher:
        """A matcher of the constraint at the start of the text, or past `generated` (a reopen's tokens so far); an
        INVALID_ARGUMENT error where the constraint does not compile or the tokens do not fit it."""
        try:
            grammar = constraint.grammar()
        except ValueError as err:
            raise invalid(f"constraint {err}") from None
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            template = self._compiled.get(key)
            if template is None:
                template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
                if template.is_error():
                    raise invalid(f"constraint {constraint.kind}: {template.get_error()}")
                self._compiled[key] = template
                while len(self._compiled) > self.keep:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            matcher = template.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise invalid(f"constraint {constraint.kind}: the {len(generated)} tokens generated under it so far do "
                          f"not fit it ({matcher.get_error()})")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[tuple[llguidance.LLMatcher, int, list[int]]]) -> None:
        """Mask `logits` in place: for each constrained verification (its matcher, its first logit row, its draft),
        the row of each draft position keeps only what the constraint allows after the draft's tokens before it (the
        others get the lowest finite logit, probability 0). Past a draft token the constraint forbids, the rows are
        left as they are: verification stops at that token."""
        if not rows:
            return
        width = (self.vocab_size + 31) // 32
        starts = np.cumsum([0] + [len(d) + 1 for _, _, d in rows])
        bitmask = np.full((int(starts[-1]), width), -1, dtype=np.int32)
        at = [(m, int(s), list(d)) for (m, _, d), s in zip(rows, starts[:-1])]
        if any(d for _, _, d in at):  # the library takes drafts of one token at least, and the rest apart
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self.executor, [x for x in at if x[2]], bitmask)
        if not all(d for _, _, d in at):
            llnp.fill_next_token_bitmask_par(self.executor, [(m, s) for m, s, d in at if not d], bitmask)
        with torch.inference_mode():  # the forward's logits are inference tensors
            index = torch.cat([torch.arange(first, first + len(d) + 1) for _, first, d in rows]).to(logits.device)
            bits = torch.from_numpy(bitmask).to(logits.device)  # one copy to the device a step
            allowed = ((bits.unsqueeze(-1) >> BITS.to(logits.device)) & 1).bool().reshape(len(bitmask), -1)
            vocab = logits.shape[-1]
            if allowed.shape[1] < vocab:  # ids past the tokenizer's (padding rows of the embedding): never allowed
                allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
            # the lowest finite value, not -inf: the sampler reads an infinite logit as a broken forward
            logits[index] = logits[index].masked_fill(~allowed[:, :vocab], torch.finfo(logits.dtype).min)


def commit(matcher: llguidance.LLMatcher, tokens: list[int]) -> None:
    """Advance a session's matcher by the tokens it committed (each allowed by the mask it was drawn under)."""
    for token in tokens:  # one at a time: consume_tokens refuses the EOS that ends a finished grammar
        if not matcher.consume_token(token):
            raise RuntimeError(f"committed token {token} does not fit the session's constraint: "
                               f"{matcher.get_error()[:300]}")
