"""Protobuf in, domain objects out (and back): the only server module that knows the wire types, and the one place
where a message's content is checked."""

from __future__ import annotations

import math

import numpy as np

from sled.v1 import verify_pb2 as pb
from sled.v1.limits import MAX_STOP_TOKENS, greedy_temperature
from sled.constraints import Constraint
from sled.verification import RULES

from .auth import Identity
from .errors import invalid
from .sessions import LENGTH, STOP, DraftRequest, OpenRequest, SamplingParams, Session, SparseQ, Verdict
from .verification import Exact, rule_for

PROB_SUM_TOLERANCE = 1e-3


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    t, p = msg.temperature, msg.top_p
    if not math.isfinite(t) or t < 0:
        raise invalid(f"temperature must be a finite number >= 0, got {t}")
    if not math.isfinite(p) or not 0 <= p <= 1:
        raise invalid(f"top_p must be in [0, 1], got {p}")
    return SamplingParams(temperature=0.0 if greedy_temperature(t) else t, top_k=msg.top_k,
                          top_p=p if p > 0 else 1.0, seed=msg.seed if msg.HasField("seed") else None)


def _check_ids(ids, vocab_size: int, what: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise invalid(f"{what} id {bad[0]} out of range: the target vocabulary has {vocab_size} tokens")


def open_from_pb(msg: pb.Open, vocab_size: int, config, device: Identity = Identity("", False),
                 grammars=None) -> OpenRequest:
    """An Open, checked against the server's settings (`config`: its context limit, its verification rules);
    `grammars` (verify_server.constraint.Grammars) compiles its constraint, if it has one."""
    max_seq_len = config.max_seq_len
    ids = tuple(msg.context_token_ids)
    if not ids:
        raise invalid("context_token_ids is empty: send at least one prompt token")
    if len(ids) >= max_seq_len:
        raise invalid(f"prompt of {len(ids)} tokens is over the context limit: at most {max_seq_len - 1} tokens")
    _check_ids(ids, vocab_size, "prompt token")
    if len(msg.stop_token_ids) > MAX_STOP_TOKENS:
        raise invalid(f"{len(msg.stop_token_ids)} stop token ids: at most {MAX_STOP_TOKENS}")
    stops = frozenset(msg.stop_token_ids)
    _check_ids(stops, vocab_size, "stop token")
    if msg.max_tokens <= 0:
        raise invalid("max_tokens must be at least 1")
    sampling = sampling_from_pb(msg.sampling)
    rule = rule_for(msg.verification, msg.verification_params, sampling.greedy, config)
    matcher = None
    if msg.HasField("constraint"):
        rule, matcher = constrained(msg, rule, grammars)
    return OpenRequest(context_token_ids=ids, sampling=sampling, max_tokens=msg.max_tokens, stop_token_ids=stops,
                       client_id=msg.client_id[:128], server_decodes=msg.server_decodes, device=device, rule=rule,
                       matcher=matcher)


def constrained(msg: pb.Open, rule, grammars):
    """An Open's constraint compiled, and its rule: a loose rule could accept a token the constraint forbids, so a
    constrained session is verified exactly (one that asked for a loose rule is refused)."""
    c = msg.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise invalid("constraint has no kind: set json_schema, json_object, regex or lark")
    try:
        constraint = Constraint(kind, "" if kind == "json_object" else getattr(c, kind))
    except ValueError as err:
        raise invalid(f"constraint: {err}") from None
    if c.generated_tokens > len(msg.context_token_ids) - 1:
        raise invalid(f"constraint.generated_tokens {c.generated_tokens}: the context has "
                      f"{len(msg.context_token_ids)} tokens, the prompt at least one of them")
    if rule.loose is not None:
        if msg.verification:
            raise invalid(f"{rule.name} verification cannot take a constraint: its loose acceptance could take a "
                          "token the constraint forbids; open with exact verification")
        rule = Exact({})  # the server's loose default applies to free text only
    if grammars is None:
        raise invalid("this server takes no constraints")
    generated = list(msg.context_token_ids)[len(msg.context_token_ids) - c.generated_tokens:]
    return rule, grammars.matcher(constraint, generated)


def draft_from_pb(msg: pb.Draft, vocab_size: int, max_draft_tokens: int, max_top_k: int) -> DraftRequest:
    tokens = tuple(msg.token_ids)
    n = len(tokens)
    if n > max_draft_tokens:
        raise invalid(f"draft of {n} tokens is longer than the server's max_draft_tokens={max_draft_tokens}")
    _check_ids(tokens, vocab_size, "draft token")
    if not msg.HasField("draft_probs") or n == 0:
        return DraftRequest(msg.round, tokens)
    sd = msg.draft_probs
    offsets = np.asarray(sd.offsets, dtype=np.int64)
    ids = np.asarray(sd.token_ids, dtype=np.int64)
    probs = np.asarray(sd.probs, dtype=np.float32)
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(ids) or len(ids) != len(probs):
        raise invalid(
            f"draft_probs malformed: need {n + 1} offsets from 0 to len(token_ids) = len(probs); "
            f"got {len(offsets)} offsets, {len(ids)} ids, {len(probs)} probs"
        )
    counts = np.diff(offsets)
    if (counts < 1).any() or (counts > max_top_k).any():
        raise invalid(f"each draft token needs 1 to {max_top_k} (max_draft_top_k) probabilities, got {counts.tolist()}")
    if not np.isfinite(probs).all():
        raise invalid("draft probabilities must be finite: got NaN or inf")
    if (probs < 0).any() or (probs > 1 + PROB_SUM_TOLERANCE).any():
        raise invalid("draft probabilities must lie in [0, 1]")
    if (ids >= vocab_size).any():
        raise invalid(f"draft distribution token id {int(ids.max())} out of range: vocabulary has {vocab_size} tokens")
    sums = np.add.reduceat(probs, offsets[:-1]) if len(probs) else np.zeros(n)
    if (np.abs(sums - 1.0) > PROB_SUM_TOLERANCE).any():
        raise invalid(f"each draft distribution must sum to 1, got sums {np.round(sums, 4).tolist()}")
    return DraftRequest(msg.round, tokens, SparseQ(counts, ids, probs))


def opened_to_pb(session: Session, max_draft_tokens: int, vocab_size: int, context_limit: int,
                 target_name: str, server_decodes: bool = False) -> pb.ServerMessage:
    rule = session.rule
    spec = RULES[rule.name]
    return pb.ServerMessage(opened=pb.Opened(
        session_id=session.id, max_draft_tokens=max_draft_tokens, vocab_size=vocab_size,
        context_limit=context_limit, target_name=target_name, server_decodes=server_decodes,
        verification=spec.wire, verification_params=rule.params, min_draft_tokens=spec.min_draft_tokens(rule.params)))


_REASONS = {STOP: pb.FINISH_REASON_STOP, LENGTH: pb.FINISH_REASON_LENGTH, None: pb.FINISH_REASON_UNSPECIFIED}


def verdict_to_pb(v: Verdict) -> pb.ServerMessage:
    msg = pb.Verdict(round=v.round, n_accepted=v.n_accepted, finished=v.finished,
                     finish_reason=_REASONS[v.finish_reason], step_ms=v.step_ms, step_tokens=v.step_tokens,
                     step_sessions=v.step_sessions, token_ms=v.token_ms, queue_ms=v.queue_ms, n_loose=v.n_loose)
    if v.next_token is not None:
        msg.next_token = v.next_token
    return pb.ServerMessage(verdict=msg)


def closed_to_pb(generated: int) -> pb.ServerMessage:
    return pb.ServerMessage(closed=pb.Closed(generated_tokens=generated))


def info_to_pb(engine, config) -> pb.ServerInfo:
    """GetInfo's answer: the engine's target, limits, counters and kernels under `config`."""
    return pb.ServerInfo(target_name=engine.target.name, tokenizer_fingerprint=engine.target.fingerprint,
                         vocab_size=engine.vocab_size, context_limit=config.max_seq_len,
                         max_draft_tokens=config.max_draft_tokens, max_sessions=config.max_sessions,
                         eos_token_ids=sorted(engine.eos_ids), stats=pb.ServerStats(**engine.stats()),
                         **engine.kernels())
