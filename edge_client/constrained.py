"""A constraint on the device: its model drafter draws only what the constraint allows (llguidance, torch-free), so
a draft stays valid and is not cut where the server's mask would reject it. The server enforces the constraint
whatever the device drafts; this only keeps acceptance high."""

from __future__ import annotations

import numpy as np

from sled.constraints import Constraint

from .drafters.base import Proposal
from .drafters.kv_drafter import common_prefix

class DraftMask:
    """A request's constraint, followed along the text after its prompt: `sync(context)` puts it where a draft
    starts (rolling back drafted tokens the verdict did not keep), `allowed()` is what may come next, `advance`
    takes a drafted token. A text that leaves the constraint (tokens drafted alone while the server was away) stops
    the masking: the server still enforces it."""

    def __init__(self, constraint: Constraint, tokenizer, prompt_len: int):
        import llguidance
        import llguidance.numpy as llnp

        self._llnp = llnp
        self.matcher = llguidance.LLMatcher(tokenizer.grammar_tokenizer, constraint.grammar(), log_level=0)
        self.prompt_len, self.vocab = prompt_len, tokenizer.vocab_size
        self.consumed: list[int] = []
        self.broken = self.matcher.is_error()
        self.jumps = False  # whether a drafter under it takes the tokens it forces after each token (jump)
        self.forced_tokens = 0  # drafted by the constraint alone
        self._bits = llnp.allocate_token_bitmask(1, self.vocab)

    def sync(self, context) -> bool:
        """Follow the constraint to the end of `context`; False where the text left it."""
        if self.broken:
            return False
        text = list(context[self.prompt_len:])
        keep = common_prefix(self.consumed, text)
        if keep < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - keep)
            del self.consumed[keep:]
        return all(self.advance(t) for t in text[keep:])

    def advance(self, token: int) -> bool:
        if self.broken or not self.matcher.consume_token(token):
            self.broken = True
            return False
        self.consumed.append(token)
        return True

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the constraint takes next."""
        self._llnp.fill_next_token_bitmask(self.matcher, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits with what the constraint forbids next at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def forced(self, context) -> list[int]:
        """The tokens the constraint forces after `context` (keys, braces, an enum's tail), none where it allows a
        choice or the text left it."""
        return list(self.matcher.compute_ff_tokens()) if self.sync(context) else []

    def jump(self, room: int) -> list[int]:
        """Mid-draft, where jumps are on: up to `room` tokens the constraint forces after the tokens advanced so far,
        advanced past and counted."""
        if not self.jumps or self.broken or room <= 0:
            return []
        forced = list(self.matcher.compute_ff_tokens())[:room]
        forced = forced[:next((i for i, t in enumerate(forced) if not self.advance(t)), len(forced))]
        self.forced_tokens += len(forced)
        return forced


class Constrained:
    """A drafter under a request's constraint. With `forced`, the tokens the constraint forces come first at no
    drafting cost (SGLang's jump-forward; the server still verifies them) and the drafter drafts the rest; with
    `masked`, a model drafter draws only what the constraint allows, and with both it also takes the tokens forced
    after each token it draws without drafting them. Everything else is the drafter's."""

    def __init__(self, drafter, mask: DraftMask, masked: bool, forced: bool):
        self.drafter, self.mask, self.use_forced = drafter, mask, forced
        self._constrain = getattr(drafter, "constrain", None) if masked else None  # model drafters have it
        mask.jumps = forced and self._constrain is not None

    @property
    def forced_tokens(self) -> int:
        """Tokens drafted by the constraint alone."""
        return self.mask.forced_tokens

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def begin(self, context, sampling) -> None:
        self.drafter.begin(context, sampling)
        if self._constrain is not None:
            self._constrain(self.mask)

    def release(self) -> None:
        """The request is done: the drafter, which serves other requests next, drafts freely again."""
        if self._constrain is not None:
            self._constrain(None)

    def propose(self, context, k, stop=None) -> Proposal:
        forced = self.mask.forced(context)[:k] if self.use_forced else []
        if not forced:
            return self.drafter.propose(context, k, stop)
        self.mask.forced_tokens += len(forced)
        head = Proposal(forced, confidence=[1.0] * len(forced))
        return head if len(forced) == k else head.then(self.drafter.propose(list(context) + forced,
                                                                           k - len(forced), stop))
