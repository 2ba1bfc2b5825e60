"""What runs in the next step: verifications and prefill chunks under the batch limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .config import ServerConfig
from .cost_model import StepCostModel
from .sessions import DraftRequest, Session

# A session whose draft is overdue by more than this, and by more than twice its usual gap, is idle: no step is
# shortened or held for it.
IDLE_AFTER_S = 0.5
# A step's target time while drafts wait or are due, where step_target_ms is unset: this many of its fixed cost.
STEP_TARGET_FIXED_COSTS = 2.0
# Prompts are prefilled shortest first (the least mean TTFT), but one that has waited this long since its Open goes
# before every newer one: under load new prompts keep coming, and shortest first alone starves a long one.
PREFILL_PATIENCE_S = 1.0


def draft_expected(session: Session, now: float) -> float | None:
    """When `session`'s next draft should arrive (its last answer plus its usual gap); None where none is expected:
    never answered yet, still prefilling, finished, decoded by the server itself, or idle."""
    s = session
    if s.finished or s.decoded_here or s.answered_at is None or not s.prefilled:
        return None
    gap = s.draft_gap_s or 0.0
    due = s.answered_at + gap
    return None if now - due > max(IDLE_AFTER_S, 2 * gap) else due


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

    def next_draft(self, pending: list[VerifyWork], sessions: list[Session], now: float) -> float | None:
        """The earliest time a draft is expected from a session in a round (none of its drafts waiting)."""
        waiting = {w.session.id for w in pending}
        due = [t for s in sessions if s.id not in waiting and (t := draft_expected(s, now)) is not None]
        return min(due, default=None)

    def hold(self, pending: list[VerifyWork], sessions: list[Session], now: float) -> float:
        """Seconds a prefill step with no draft waiting holds for a round due within the batching window (0: run
        now), so a device whose draft is a moment away does not wait a whole step behind a prompt."""
        if pending:
            return 0.0
        due = self.next_draft(pending, sessions, now)
        window = self.config.max_wait_ms / 1000.0
        if due is None or due - now > window:
            return 0.0
        return max(0.0, due + window - now)

    def prefill_chunk(self, pending: list[VerifyWork], sessions: list[Session], now: float,
                      costs: StepCostModel) -> int | None:
        """Prompt tokens the next step may prefill: None (the rest of the step budget) where no draft is waiting
        and none is due before such a step would end. Else as many as keep the step within step_target_ms (or
        within the time left before the next due draft, where that is longer), less the waiting drafts' tokens,
        and never fewer than prefill_min_tokens; prefill_chunk_tokens where it is set."""
        cfg = self.config
        runnable = [w for w in pending if w.session.prefilled]
        due = self.next_draft(pending, sessions, now)
        if not runnable and (due is None or due - now > costs.ms(cfg.max_batch_tokens) / 1000.0):
            return None
        if cfg.prefill_chunk_tokens is not None:
            return cfg.prefill_chunk_tokens
        target_ms = cfg.step_target_ms if cfg.step_target_ms is not None else STEP_TARGET_FIXED_COSTS * costs.fixed_ms
        if not runnable:
            target_ms = max(target_ms, (due - now) * 1000.0)
        verify_tokens = sum(len(w.draft.token_ids) + 1 for w in runnable)
        fits = costs.tokens_costing(target_ms - costs.fixed_ms, cfg.max_batch_tokens) - verify_tokens
        return max(cfg.prefill_min_tokens, fits)

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

    def plan(self, pending: list[VerifyWork], prefilling: list[Session], chunk: int | None = None,
             now: float | None = None) -> Plan:
        """Verifications first (FIFO, one per session), then prompt chunks, `chunk` tokens of prompt at most (None:
        the rest of the token budget): the prompts that have waited PREFILL_PATIENCE_S oldest first, then the
        shortest remaining prompt first."""
        cfg = self.config
        now = time.monotonic() if now is None else now
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

        def order(s: Session) -> tuple[int, float]:
            overdue = now - s.opened_at >= PREFILL_PATIENCE_S
            return (0, s.opened_at) if overdue else (1, len(s.tokens) - s.kv_len)

        prefills: list[PrefillWork] = []
        for session in sorted(prefilling, key=order):
            if budget <= 0:
                break
            chunk = min(len(session.tokens) - 1 - session.kv_len, budget)
            if chunk > 0:
                prefills.append(PrefillWork(session, chunk))
                budget -= chunk
        return Plan(verifies, prefills)
