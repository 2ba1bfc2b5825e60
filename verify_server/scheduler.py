"""What runs in the next step: verifications and prefill chunks under the batch limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .config import ServerConfig
from .sessions import DraftRequest, Session


@dataclass
class VerifyWork:
    session: Session
    draft: DraftRequest
    reply: object  # callable(result or exception), resolves the waiting handler
    enqueued: float = field(default_factory=time.monotonic)  # taken in by the worker: its batching window starts
    arrived: float | None = None  # handed to the engine (time.monotonic()), perhaps during a step; None: enqueued

    def __post_init__(self) -> None:
        if self.arrived is None:
            self.arrived = self.enqueued


@dataclass
class PrefillWork:
    session: Session
    length: int  # context tokens to write into the KV this step


@dataclass
class Plan:
    verifies: list[VerifyWork]
    prefills: list[PrefillWork]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.draft.token_ids) + 1 for w in self.verifies) + sum(p.length for p in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.verifies or self.prefills)


class Scheduler:
    def __init__(self, config: ServerConfig):
        self.config = config

    def ready(self, pending: list[VerifyWork], prefilling: list[Session], open_sessions: int,
              oldest: float | None, now: float) -> bool:
        """Run a step when the batch is full, nobody else can join, or the oldest has waited enough."""
        runnable = [w for w in pending if w.session.prefilled]
        if not runnable and not prefilling:
            return False
        if len(runnable) >= self.config.max_batch_sessions:
            return True
        if sum(len(w.draft.token_ids) + 1 for w in runnable) >= self.config.max_batch_tokens:
            return True
        waiting_sessions = {w.session.id for w in pending} | {s.id for s in prefilling}
        if len(waiting_sessions) >= open_sessions:
            return True
        return oldest is not None and (now - oldest) * 1000.0 >= self.config.max_wait_ms

    def plan(self, pending: list[VerifyWork], prefilling: list[Session], chunk: int | None = None) -> Plan:
        """Verifications first (FIFO, one per session), then prompt chunks, the shortest remaining prompt first,
        `chunk` tokens of prompt at most (None: the rest of the token budget)."""
        cfg = self.config
        budget = cfg.max_batch_tokens
        verifies: list[VerifyWork] = []
        seen: set[str] = set()
        for work in pending:
            need = len(work.draft.token_ids) + 1
            if not work.session.prefilled or work.session.id in seen:
                continue
            if len(verifies) >= cfg.max_batch_sessions or need > budget:
                break
            verifies.append(work)
            seen.add(work.session.id)
            budget -= need
        if chunk is not None:
            budget = min(budget, chunk)
        prefills: list[PrefillWork] = []
        for session in sorted(prefilling, key=lambda s: len(s.tokens) - s.kv_len):
            if budget <= 0:
                break
            chunk = min(len(session.tokens) - 1 - session.kv_len, budget)
            if chunk > 0:
                prefills.append(PrefillWork(session, chunk))
                budget -= chunk
        return Plan(verifies, prefills)
