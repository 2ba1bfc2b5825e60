"""One step's tensors, built once from its plan: the model's input and the verification's drafts (vLLM's
SpecDecodeMetadata is the model)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import Segment
from kernels.rejection_sampler import DraftBatch, SamplingBatch

from .model_runner import ModelInput
from .scheduler import Plan, VerifyWork
from .sessions import Session
from .verification import rule_batch


@dataclass(frozen=True)
class StepBatch:
    """Prompt chunks first, then each verification's last committed token and draft, flat. Verification i's draft
    tokens are draft_token_ids[cu[i]:cu[i+1]] and its logits are rows [cu[i] + i, cu[i+1] + i] of the forward's
    output."""

    plan: Plan
    model_input: ModelInput
    drafts: list[list[int]]  # the draft tokens worth verifying, per verification
    spec: DraftBatch  # those drafts flat, their sparse distributions padded once to the widest
    sampling: SamplingBatch

    @property
    def verifies(self) -> list[VerifyWork]:
        return self.plan.verifies

    @classmethod
    def build(cls, plan: Plan, max_seq_len: int, default_gen: torch.Generator | None,
              block_size: int) -> StepBatch:
        """Each session's block table must already hold the positions this step writes (Engine._grow)."""
        drafts = [clip(w, max_seq_len) for w in plan.verifies]
        return cls(plan, model_input(plan, drafts, block_size), drafts, draft_batch(plan.verifies, drafts),
                   sampling_batch(plan.verifies, default_gen))

    def subset(self, keep: list[int]) -> StepBatch:
        """The verifications at `keep` alone, for sampling again without the ones whose logits were not finite."""
        plan = Plan([self.plan.verifies[i] for i in keep], [])
        drafts = [self.drafts[i] for i in keep]
        return StepBatch(plan, self.model_input, drafts, draft_batch(plan.verifies, drafts),
                         sampling_batch(plan.verifies, self.sampling.default))

    def constrained(self) -> list[tuple[object, int, list[int]]]:
        """The verifications under a constraint: (the session's matcher, its first logit row, its draft)."""
        out, row = [], 0
        for work, draft in zip(self.verifies, self.drafts):
            if work.session.matcher is not None:
                out.append((work.session.matcher, row, draft))
            row += len(draft) + 1
        return out

    def logit_rows(self, keep: list[int]) -> torch.Tensor:
        """The forward's output rows of the verifications at `keep`."""
        cu = [0]
        for d in self.drafts:
            cu.append(cu[-1] + len(d) + 1)
        return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in keep])


def clip(work: VerifyWork, max_seq_len: int) -> list[int]:
    """The draft tokens worth verifying: what fits in the context and in the session's max_tokens."""
    s = work.session
    room = min(max_seq_len - s.kv_len - 1, s.remaining - 1)
    return list(work.draft.token_ids[: max(room, 0)])


def step_lengths(plan: Plan, max_seq_len: int) -> list[tuple[Session, int]]:
    """Each session of the plan and the positions it holds once the step has written its tokens."""
    return ([(p.session, p.session.kv_len + p.length) for p in plan.prefills]
            + [(w.session, w.session.kv_len + 1 + len(clip(w, max_seq_len))) for w in plan.verifies])


def model_input(plan: Plan, drafts: list[list[int]], block_size: int) -> ModelInput:
    tokens: list[int] = []
    segments: list[Segment] = []
    logit_rows: list[int] = []

    def append(s: Session, ids: list[int]) -> None:
        segments.append(Segment(tuple(s.blocks), len(tokens), len(ids), s.kv_len + len(ids), block_size))
        tokens.extend(ids)

    for p in plan.prefills:
        append(p.session, p.session.tokens[p.session.kv_len: p.session.kv_len + p.length])
    for work, draft in zip(plan.verifies, drafts):
        logit_rows.extend(range(len(tokens), len(tokens) + len(draft) + 1))
        append(work.session, [work.session.tokens[-1]] + draft)
    return ModelInput.build(tokens, segments, logit_rows)


def draft_batch(works: list[VerifyWork], drafts: list[list[int]]) -> DraftBatch:
    """Every clipped draft, flat, with its sparse q, padded once. A draft without q chose each token with certainty:
    q = 1 on it."""
    counts, ids, probs = [], [], []
    for work, draft in zip(works, drafts):
        n, q = len(draft), work.draft.q
        if q is None:
            counts.append(np.ones(n, dtype=np.int64))
            ids.append(np.asarray(draft, dtype=np.int64))
            probs.append(np.ones(n, dtype=np.float32))
        else:
            kept = int(q.counts[:n].sum())
            counts.append(q.counts[:n])
            ids.append(q.ids[:kept])
            probs.append(q.probs[:kept])
    counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    width = int(counts.max()) if len(counts) else 1
    q_ids = np.zeros((len(counts), width), dtype=np.int64)
    q_probs = np.zeros((len(counts), width), dtype=np.float32)
    if len(counts):
        rows = np.repeat(np.arange(len(counts)), counts)
        cols = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        q_ids[rows, cols] = np.concatenate(ids)
        q_probs[rows, cols] = np.concatenate(probs)
    cu = np.concatenate([[0], np.cumsum([len(d) for d in drafts])]).astype(np.int64)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    return DraftBatch(flat, torch.from_numpy(cu), torch.from_numpy(q_ids), torch.from_numpy(q_probs))


def sampling_batch(works: list[VerifyWork], default_gen: torch.Generator | None) -> SamplingBatch:
    sp = [w.session.sampling for w in works]
    return SamplingBatch(
        temperature=torch.tensor([p.temperature for p in sp], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in sp], dtype=torch.long),
        top_p=torch.tensor([p.top_p if 0 < p.top_p <= 1 else 1.0 for p in sp], dtype=torch.float32),
        generators=tuple(w.session.generator for w in works),
        default=default_gen,
        rules=rule_batch([w.session.rule for w in works]),
    )
