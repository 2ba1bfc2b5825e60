"""Lossless verification of drafted tokens against the target, over a ragged batch.

Greedy requests (temperature 0) accept the longest prefix equal to the target's
argmax. Sampling requests follow Leviathan et al. 2023 / Chen et al. 2023: accept
draft token x with probability min(1, p(x) / q(x)); at the first rejection sample
from norm(max(0, p - q)); after a full accept sample the bonus token from p.

Layout: request i has k_i draft tokens, flattened in `draft_token_ids`, with
`cu_num_draft_tokens[i] = k_0 + ... + k_{i-1}` (length batch + 1). The target
produced k_i + 1 rows of logits for request i, contiguous, request after request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class NonFiniteLogitsError(ValueError):
    """The target produced NaN or inf logits for some requests of the batch."""

    def __init__(self, request_indices: list[int]):
        self.request_indices = request_indices
        super().__init__(f"non-finite target logits for requests {request_indices}")


class ExactOnly:
    """Every request verified exactly: nothing accepted beyond the exact rule (a LooseRules)."""

    def apply(self, drafts: DraftRows, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return accepted, torch.zeros(accepted.shape[0], dtype=torch.long, device=accepted.device)


EXACT = ExactOnly()


@dataclass(frozen=True)
class SamplingBatch:
    temperature: torch.Tensor  # [batch] float32, 0 means greedy
    top_k: torch.Tensor  # [batch] int64, 0 means no cut
    top_p: torch.Tensor  # [batch] float32, 1 means no cut
    generators: tuple[torch.Generator | None, ...]  # one per request; None draws from `default`
    default: torch.Generator | None = None
    rules: LooseRules = EXACT  # the requests' verification rules: what they accept beyond the exact rule

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


@dataclass(frozen=True)
class DraftBatch:
    """A step's drafts, flat (the layout in this module's docstring), with their sparse distributions padded to one
    width: the speculative-decoding half of the step's metadata, as SamplingBatch is the sampling half."""

    token_ids: torch.Tensor  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64, starts at 0
    q_ids: torch.Tensor  # [num_draft_tokens, K] int64, sparse support of q
    q_probs: torch.Tensor  # [num_draft_tokens, K] float32, 0 on padding


@dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [batch] int64
    next_token: torch.Tensor  # [batch] int64, correction after a rejection or bonus after a full accept
    num_loose: torch.Tensor  # [batch] int64, of num_accepted those accepted by a loose rule


@dataclass(frozen=True)
class DraftRows:
    """A step's draft tokens as a verification rule judges them: each token, the target's row that judges it, and
    its request and position there."""

    logits: torch.Tensor  # [num_rows, vocab] the target's
    token_ids: torch.Tensor  # [num_draft_tokens] int64
    rows: torch.Tensor  # [num_draft_tokens] int64, the row of logits that judges each
    request: torch.Tensor  # [num_draft_tokens] int64
    position: torch.Tensor  # [num_draft_tokens] int64, in its request's draft
    num_draft: torch.Tensor  # [batch] int64
    greedy: torch.Tensor  # [batch] bool


class LooseRules(Protocol):
    """The rules of a step's requests, as the sampler asks them (verify_server.verification.RuleBatch)."""

    def apply(self, drafts: DraftRows, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`accepted` ([batch, max_k] int64, the exact rule's per draft token) with what the rules accept beyond it,
        and per request how many of its accepted prefix they added ([batch] int64)."""


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    temperature: torch.Tensor,  # [num_rows], > 0
    top_k: torch.Tensor,  # [num_rows] int64, 0 means no cut
    top_p: torch.Tensor,  # [num_rows], 1 means no cut
) -> torch.Tensor:  # [num_rows, vocab]
    """Softmax of logits / temperature after the top-k and top-p (nucleus) cuts."""
    scaled = logits.float() / temperature.unsqueeze(-1)
    vocab = scaled.shape[-1]
    needs_cut = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    if not bool(needs_cut.any()):
        return torch.softmax(scaled, dim=-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = (top_k.unsqueeze(-1) > 0) & (ranks.unsqueeze(0) >= top_k.unsqueeze(-1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays. A row with top_p = 1 keeps
    # every token: its float32 running sum can reach 1 before its tail does.
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p.unsqueeze(-1) < 1.0)
    drop[:, 0] = False
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _uniform(sampling: SamplingBatch, counts: list[int], device) -> torch.Tensor:
    """One independent U[0, 1) draw per draft token, from each request's generator."""
    parts = []
    shared = [i for i, g in enumerate(sampling.generators) if g is None]
    shared_draws = torch.rand(sum(counts[i] for i in shared), generator=sampling.default)
    offset = 0
    for i, count in enumerate(counts):
        gen = sampling.generators[i]
        if gen is None:
            parts.append(shared_draws[offset : offset + count])
            offset += count
        else:
            parts.append(torch.rand(count, generator=gen))
    return torch.cat(parts).to(device) if parts else torch.empty(0, device=device)


def _exponential(sampling: SamplingBatch, vocab: int, device) -> torch.Tensor:  # [batch, vocab]
    rows = []
    for gen in sampling.generators:
        g = gen if gen is not None else sampling.default
        rows.append(torch.empty(vocab).exponential_(generator=g))
    return torch.stack(rows).to(device)


def rejection_sample(
    target_logits: torch.Tensor,  # [num_draft_tokens + batch, vocab]
    drafts: DraftBatch,
    sampling: SamplingBatch,
    row_argmax: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> Verification:
    """row_argmax, where given: a faster way to each row's argmax, -1 for a row that is not finite (the fused CPU
    step's sled_row_argmax: kernels.cpu_step.row_argmax); None from it, or none given, takes PyTorch's."""
    draft_token_ids, cu_num_draft_tokens = drafts.token_ids, drafts.cu_num_draft_tokens
    draft_q_ids, draft_q_probs = drafts.q_ids, drafts.q_probs
    device = target_logits.device
    batch = sampling.batch_size
    vocab = target_logits.shape[-1]
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.long)
    num_draft = (cu[1:] - cu[:-1])  # [batch]
    req_ids = torch.arange(batch, device=device)

    argmax = row_argmax(target_logits) if row_argmax is not None else None
    if argmax is not None:
        finite_rows = argmax >= 0
    else:
        # A row is finite iff its min and max are (both propagate NaN): one pass, no [rows, vocab] temporary.
        # (amax and amin are vectorised reductions; aminmax and isfinite().all() are each ~6x slower here.)
        finite_rows = torch.isfinite(target_logits.amax(dim=-1)) & torch.isfinite(target_logits.amin(dim=-1))
    if not bool(finite_rows.all()):
        row_req = torch.repeat_interleave(req_ids, num_draft + 1)
        raise NonFiniteLogitsError(sorted(set(row_req[~finite_rows].tolist())))

    greedy = sampling.temperature.to(device) <= 0  # [batch]
    rows_per_req = num_draft + 1
    row_req = torch.repeat_interleave(req_ids, rows_per_req)  # [num_rows]
    if argmax is None:
        argmax = target_logits.argmax(dim=-1)  # [num_rows]
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature.to(device)), sampling.temperature.to(device))
    if bool(greedy.all()):
        probs = None
    else:
        probs = target_probs(
            target_logits,
            temperature[row_req],
            sampling.top_k.to(device)[row_req],
            sampling.top_p.to(device)[row_req],
        )  # [num_rows, vocab]

    total_draft = int(cu[-1])
    draft_req = torch.repeat_interleave(req_ids, num_draft)  # [num_draft_tokens]
    pos_in_req = torch.arange(total_draft, device=device) - cu[draft_req]
    draft_rows = cu[draft_req] + draft_req + pos_in_req  # target row that judges each draft token
    x = draft_token_ids.to(device=device, dtype=torch.long)

    accept = x == argmax[draft_rows]
    if probs is not None and total_draft > 0:
        p_x = probs[draft_rows].gather(-1, x.unsqueeze(-1)).squeeze(-1)
        q_x = ((draft_q_ids.to(device) == x.unsqueeze(-1)) * draft_q_probs.to(device)).sum(-1)
        u = _uniform(sampling, num_draft.tolist(), device)
        accept_sampled = (q_x > 0) & (u * q_x < p_x)
        accept = torch.where(greedy[draft_req], accept, accept_sampled)

    max_k = int(num_draft.max()) if batch else 0
    accepted = torch.zeros(batch, max_k, dtype=torch.long, device=device)
    accepted[draft_req, pos_in_req] = accept.long()
    drafts = DraftRows(target_logits, x, draft_rows, draft_req, pos_in_req, num_draft, greedy)
    accepted, num_loose = sampling.rules.apply(drafts, accepted)
    num_accepted = accepted.cumprod(dim=-1).sum(dim=-1) if max_k else torch.zeros(batch, dtype=torch.long, device=device)

    # The row right after the accepted prefix judges the first rejection, or is the bonus row.
    next_rows = cu[:-1] + req_ids + num_accepted
    next_token = argmax[next_rows]
    if probs is not None:
        dist = probs[next_rows].clone()  # [batch, vocab]
        rejected = num_accepted < num_draft
        if bool(rejected.any()):
            rej = rejected.nonzero().squeeze(-1)
            draft_idx = cu[rej] + num_accepted[rej]
            residual = dist[rej].scatter_add(-1, draft_q_ids[draft_idx].to(device), -draft_q_probs[draft_idx].to(device))
            residual = residual.clamp_min(0.0)
            mass = residual.sum(-1, keepdim=True)
            # p == q leaves no residual mass: then sample from p itself.
            dist[rej] = torch.where(mass > 0, residual / mass.clamp_min(1e-30), dist[rej])
        sampled = (dist / _exponential(sampling, vocab, device)).argmax(dim=-1)
        next_token = torch.where(greedy, next_token, sampled)
    return Verification(num_accepted=num_accepted, next_token=next_token, num_loose=num_loose)
