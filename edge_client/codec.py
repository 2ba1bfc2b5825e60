"""Device-side conversions between the round loop's objects and sled.v1 messages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sled.constraints import Constraint
from sled.v1 import verify_pb2 as pb

from .drafters.base import Proposal
from .request import Request
from .sampling import SamplingParams

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Opened:
    session_id: str
    max_draft_tokens: int
    vocab_size: int
    context_limit: int
    target_name: str
    server_decodes: bool = False  # the server decodes this session itself, a Verdict per token (Open.server_decodes)
    min_draft_tokens: int = 0  # the shortest draft this session's verification rule makes use of (0: any)


@dataclass(frozen=True)
class Verdict:
    round: int
    n_accepted: int
    next_token: int | None
    finished: bool
    finish_reason: str | None
    step_ms: float = 0.0  # the server's load: its step time and tokens for this verification
    step_tokens: int = 0
    step_sessions: int = 0
    token_ms: float = 0.0  # the server's marginal cost of one more token
    queue_ms: float = 0.0  # how long the draft waited at the server through earlier steps
    n_loose: int = 0  # of n_accepted, accepted by a loose rule


def open_message(request: Request, fingerprint: str, auth_token: str = "", *, context: list[int] | None = None,
                 max_tokens: int | None = None, sampling: SamplingParams | None = None) -> pb.ClientMessage:
    """The request's Open, with the rule it asks for (or the server's default). A reopen gives its `context` so far,
    the `max_tokens` still to generate and its `sampling` (whose seed moves on); a first open takes the request's."""
    context = list(request.prompt_token_ids) if context is None else context
    max_tokens = request.max_tokens if max_tokens is None else max_tokens
    sampling = request.sampling if sampling is None else sampling
    sp = pb.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    if sampling.seed is not None:
        sp.seed = sampling.seed
    rule = request.policy.rule
    return pb.ClientMessage(open=pb.Open(
        tokenizer_fingerprint=fingerprint, context_token_ids=context, sampling=sp, max_tokens=max_tokens,
        stop_token_ids=list(request.stop_token_ids), client_id=request.client_id, auth_token=auth_token or "",
        server_decodes=not request.policy.drafts, verification=rule.wire if rule else pb.VERIFICATION_UNSPECIFIED,
        verification_params=dict(rule.params) if rule else {},
        constraint=constraint_pb(request.constraint, len(context) - len(request.prompt_token_ids))))


def constraint_pb(constraint: Constraint | None, generated: int) -> pb.Constraint | None:
    """The request's constraint on the wire, with the tokens already generated under it (a reopen's)."""
    if constraint is None:
        return None
    c = pb.Constraint(generated_tokens=generated)
    if constraint.kind == "json_object":
        c.json_object = True
    else:
        setattr(c, constraint.kind, constraint.text)
    return c


def draft_message(session_id: str, round_: int, proposal: Proposal) -> pb.ClientMessage:
    draft = pb.Draft(session_id=session_id, round=round_, token_ids=proposal.token_ids)
    if proposal.q_ids is not None and proposal.token_ids:
        counts = [len(ids) for ids in proposal.q_ids]
        draft.draft_probs.offsets.extend(np.concatenate([[0], np.cumsum(counts)]).tolist())
        draft.draft_probs.token_ids.extend(np.concatenate(proposal.q_ids).tolist())
        draft.draft_probs.probs.extend(np.concatenate(proposal.q_probs).tolist())
    return pb.ClientMessage(draft=draft)


def close_message() -> pb.ClientMessage:
    return pb.ClientMessage(close=pb.Close())


def opened_from(msg: pb.ServerMessage) -> Opened:
    if msg.WhichOneof("kind") != "opened":
        raise ValueError(f"expected Opened from the server, got {msg.WhichOneof('kind')}")
    o = msg.opened
    return Opened(o.session_id, o.max_draft_tokens, o.vocab_size, o.context_limit, o.target_name, o.server_decodes,
                  o.min_draft_tokens)


def verdict_from(msg: pb.ServerMessage) -> Verdict:
    if msg.WhichOneof("kind") != "verdict":
        raise ValueError(f"expected Verdict from the server, got {msg.WhichOneof('kind')}")
    v = msg.verdict
    return Verdict(v.round, v.n_accepted, v.next_token if v.HasField("next_token") else None, v.finished,
                   FINISH_REASONS.get(v.finish_reason), v.step_ms, v.step_tokens, v.step_sessions, v.token_ms,
                   v.queue_ms, v.n_loose)
