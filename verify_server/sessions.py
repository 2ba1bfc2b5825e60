"""Generation sessions on the server and what one verification commits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .auth import Identity
from .verification import Exact

STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass(frozen=True)
class OpenRequest:
    context_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    client_id: str = ""
    server_decodes: bool = False  # no drafts: the server decodes every token and streams it
    device: Identity = Identity("", False)  # who opened it (verify_server.auth)
    rule: object = field(default_factory=lambda: Exact({}))  # its verification rule (verify_server.verification)
    matcher: object = None  # its constraint's state (verify_server.constraint), None: free text


@dataclass(frozen=True)
class SparseQ:
    """The distributions a draft's tokens were sampled from, sparse and flat: token i's are the next counts[i]
    entries of ids and probs. Padded to one width only with the step's other drafts (verify_server.batch)."""

    counts: np.ndarray  # [num_draft] int64
    ids: np.ndarray  # [sum(counts)] int64
    probs: np.ndarray  # [sum(counts)] float32


@dataclass(frozen=True)
class DraftRequest:
    round: int
    token_ids: tuple[int, ...]
    q: SparseQ | None = None  # None: each token chosen deterministically (q = 1 on it)

    @staticmethod
    def empty(round_: int) -> "DraftRequest":
        """No draft tokens: the verification emits the target's next token alone (a session the server decodes)."""
        return DraftRequest(round_, ())


@dataclass(frozen=True)
class Verdict:
    round: int
    n_accepted: int
    next_token: int | None
    finished: bool
    finish_reason: str | None
    step_ms: float = 0.0
    step_tokens: int = 0
    step_sessions: int = 0
    token_ms: float = 0.0
    queue_ms: float = 0.0  # the draft's wait through earlier steps before its own
    n_loose: int = 0  # of n_accepted, accepted by a loose rule


@dataclass
class Session:
    id: str
    blocks: list[int]  # its block table in the KV pool
    tokens: list[int]  # the whole committed context; KV holds all but the last
    sampling: SamplingParams
    remaining: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    client_id: str = ""
    device: Identity = Identity("", False)
    decoded_here: bool = False  # the server decodes it (Open.server_decodes): the engine asks each next token itself
    rule: object = field(default_factory=lambda: Exact({}))
    matcher: object = None  # its constraint's state, advanced by the tokens it commits
    kv_len: int = 0
    holds: bool = True  # it holds a session's place and its blocks (until it finishes or closes)
    published: int = 0  # its first blocks published under their prefix hashes (KVCache), `chain` the last hash
    chain: bytes = b""
    generated: int = 0
    finished: bool = False
    finish_reason: str | None = None
    last_active: float = field(default_factory=time.monotonic)
    opened_at: float = field(default_factory=time.monotonic)  # when it was opened (prefill's patience)
    # Its rhythm, for the scheduler (when its next draft is due): when it was last answered (a verdict, or the end
    # of its prefill), and the usual gap from an answer to its next draft (None until it has sent one).
    answered_at: float | None = None
    draft_gap_s: float | None = None

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= len(self.tokens) - 1

    def draft_arrived(self, at: float) -> None:
        """A draft arrived at `at`: the gap since the last answer joins the session's usual gap."""
        if self.answered_at is not None:
            gap = max(0.0, at - self.answered_at)
            self.draft_gap_s = gap if self.draft_gap_s is None else 0.75 * self.draft_gap_s + 0.25 * gap


def commit_tokens(
    draft: list[int], n_accepted: int, next_token: int, stop_ids: frozenset[int], remaining: int
) -> tuple[int, int | None, str | None]:
    """Cut an accepted block at the first stop token or at `remaining` tokens.

    Returns (n_accepted, next_token or None, finish reason or None).
    """
    block = draft[:n_accepted] + [next_token]
    reason = None
    for i, tok in enumerate(block):
        if tok in stop_ids:
            block, reason = block[: i + 1], STOP
            break
    if len(block) > remaining:
        block, reason = block[:remaining], LENGTH
    elif len(block) == remaining and reason is None:
        reason = LENGTH
    kept_draft = min(n_accepted, len(block))
    nxt = block[-1] if len(block) == n_accepted + 1 else None
    return kept_draft, nxt, reason
