"""Server metrics with vLLM's definitions, kept in-process and exported for Prometheus."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


@dataclass
class Metrics:
    max_positions: int = 32
    steps: int = 0
    drafts: int = 0  # verifications with at least one draft token
    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    loosely_accepted_tokens: int = 0  # of accepted_tokens, accepted by a loose verification rule
    # sessions under a constraint (structured output): their draft tokens, and those accepted
    constrained_draft_tokens: int = 0
    constrained_accepted_tokens: int = 0
    emitted_tokens: int = 0
    prefill_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt positions shared from published blocks instead of prefilled
    max_step_sessions: int = 0
    sessions_opened: int = 0
    sessions_refused: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    step_seconds_total: float = 0.0
    forward_seconds_total: float = 0.0
    queue_wait_seconds_total: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_positions
        self.registry = CollectorRegistry()
        r = self.registry
        self._p_steps = Counter("sled_steps", "engine steps", registry=r)
        self._p_drafts = Counter("sled_spec_decode_num_drafts", "verifications with draft tokens", registry=r)
        self._p_draft_tokens = Counter("sled_spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self._p_accepted = Counter("sled_spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self._p_loose = Counter("sled_spec_decode_num_loosely_accepted_tokens",
                                "draft tokens accepted by a loose verification rule (of those accepted)", registry=r)
        self._p_emitted = Counter("sled_generation_tokens", "tokens committed to sessions", registry=r)
        self._p_constrained = Counter("sled_constrained_draft_tokens", "draft tokens of sessions under a constraint, "
                                      "by outcome", ["outcome"], registry=r)
        self._p_pos = Counter("sled_spec_decode_num_accepted_tokens_per_pos", "accepted tokens by draft position",
                              ["position"], registry=r)
        self._p_batch = Histogram("sled_step_batch_sessions", "sessions verified per step",
                                  buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self._p_step = Histogram("sled_step_seconds", "engine step time", registry=r)
        self._p_wait = Histogram("sled_queue_wait_seconds", "time a draft waited for its step", registry=r)
        self._p_prefix_hits = Counter("sled_prefix_cache_hit_tokens", "prompt tokens shared from cached prefix blocks",
                                      registry=r)
        self.active_sessions = Gauge("sled_active_sessions", "sessions open", registry=r)
        self.free_slots = Gauge("sled_free_slots", "sessions that may still open (max_sessions less those held)",
                                registry=r)
        self._p_kv_blocks = Gauge("sled_kv_blocks", "blocks of the KV pool: used (held by a session), free, and "
                                  "shared (held by more than one)", ["state"], registry=r)
        # Per device: its name where a credential names it (verify_server.auth.Identity.label), else "anonymous".
        self._p_device_sessions = Counter("sled_device_sessions", "sessions opened, per device", ["device"],
                                          registry=r)
        self._p_device_tokens = Counter("sled_device_generation_tokens", "tokens committed, per device", ["device"],
                                        registry=r)
        self._p_refusals = Counter("sled_sessions_refused", "Opens refused for room, per device and reason",
                                   ["device", "reason"], registry=r)
        self.auth_failures = Counter("sled_auth_failures", "Opens refused for their auth_token", registry=r)

    def record_step(self, sessions: int, prefill_tokens: int, seconds: float, waits: list[float],
                    forward_seconds: float = 0.0) -> None:
        with self._lock:
            self.steps += 1
            self.forward_seconds_total += forward_seconds
            self.max_step_sessions = max(self.max_step_sessions, sessions)
            self.prefill_tokens += prefill_tokens
            self.step_seconds_total += seconds
            self.queue_wait_seconds_total += sum(waits)
        self._p_steps.inc()
        self._p_step.observe(seconds)
        if sessions:
            self._p_batch.observe(sessions)
        for w in waits:
            self._p_wait.observe(w)

    def set_kv_blocks(self, used: int, free: int, shared: int) -> None:
        for state, n in (("used", used), ("free", free), ("shared", shared)):
            self._p_kv_blocks.labels(state=state).set(n)

    def record_prefix_hit(self, tokens: int) -> None:
        with self._lock:
            self.prefix_cache_hit_tokens += tokens
        self._p_prefix_hits.inc(tokens)

    def record_open(self, device: str) -> None:
        with self._lock:
            self.sessions_opened += 1
        self._p_device_sessions.labels(device=device).inc()

    def record_refusal(self, device: str, reason: str) -> None:
        with self._lock:
            self.sessions_refused += 1
        self._p_refusals.labels(device=device, reason=reason).inc()

    def record_verification(self, num_draft: int, num_accepted: int, emitted: int, device: str = "anonymous",
                            num_loose: int = 0, constrained: bool = False) -> None:
        with self._lock:
            self.verifications += 1
            if constrained:
                self.constrained_draft_tokens += num_draft
                self.constrained_accepted_tokens += num_accepted
            self.loosely_accepted_tokens += num_loose
            self.emitted_tokens += emitted
            if num_draft:
                self.drafts += 1
                self.draft_tokens += num_draft
                self.accepted_tokens += num_accepted
                for pos in range(min(num_accepted, self.max_positions)):
                    self.accepted_per_position[pos] += 1
        self._p_emitted.inc(emitted)
        self._p_device_tokens.labels(device=device).inc(emitted)
        if num_loose:
            self._p_loose.inc(num_loose)
        if constrained and num_draft:
            self._p_constrained.labels(outcome="accepted").inc(num_accepted)
            self._p_constrained.labels(outcome="rejected").inc(num_draft - num_accepted)
        if num_draft:
            self._p_drafts.inc()
            self._p_draft_tokens.inc(num_draft)
            self._p_accepted.inc(num_accepted)
            for pos in range(num_accepted):
                self._p_pos.labels(position=str(pos)).inc()

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
