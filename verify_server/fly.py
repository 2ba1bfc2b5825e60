"""FLy (Li et al., arXiv 2511.22972), a loose verification rule for greedy sessions: a mismatch is accepted where
the target is unsure there (entropy at least the threshold), the draft token is possible for it, and the target
agrees with the draft on each of the next W - 1 positions, a variant the target corrects around. A mismatch in a
draft's last W positions stays a rejection, as in the paper's code. Its parameters: sled/verification.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernels.rejection_sampler import DraftRows


def top3_entropy(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows]
    """-sum p log p over the target's three most likely tokens, p from its full softmax (FLy's reference code, not
    renormalized over the three): high where the target hesitates between a few continuations."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(3, dim=-1).values
    return -(top.exp() * top).sum(-1)


def loose_accept(
    match: torch.Tensor,  # [batch, max_k] bool, draft token == the target's argmax; False past a draft's end
    num_draft: torch.Tensor,  # [batch] int64
    entropy: torch.Tensor,  # [batch, max_k] float32, top3_entropy of the row judging each draft token
    possible: torch.Tensor,  # [batch, max_k] bool, the draft token's target probability is above zero
    window: torch.Tensor,  # [batch] int64, W; 0: exact
    threshold: torch.Tensor,  # [batch] float32
) -> torch.Tensor:  # [batch, max_k] bool, accepted loosely
    """The rule over a batch, in tensors."""
    max_k = match.shape[1]
    pos = torch.arange(max_k, device=match.device)
    ahead = (window - 1).clamp_min(0)[:, None]  # [batch, 1] positions the window must see matched
    csum = torch.nn.functional.pad(match.long().cumsum(-1), (1, 0))  # [batch, max_k + 1], csum[:, i] = matches before i
    last = (pos[None, :] + ahead).clamp_max(max_k - 1)
    agreed = csum.gather(1, last + 1) - csum[:, 1:]  # matches at positions pos + 1 .. pos + W - 1
    before_last_w = pos[None, :] + window[:, None] < num_draft[:, None]
    return ((window[:, None] > 0) & ~match & possible & (entropy >= threshold[:, None]) & before_last_w
            & (agreed == ahead))


class Fly:
    """One session's FLy: its window W and entropy threshold."""

    name = "fly"

    def __init__(self, params: Mapping[str, float]):
        self.params = dict(params)
        self.window, self.entropy_threshold = int(params["window"]), float(params["entropy_threshold"])

    @staticmethod
    def loose(drafts: DraftRows, exact: torch.Tensor, members: torch.Tensor, rules: Sequence[Fly]) -> torch.Tensor:
        """loose_accept over the step's FLy sessions (`members`, their batch indices; `rules`, theirs), from the
        target's logits at their rows; [batch, max_k] bool."""
        device, batch = exact.device, exact.shape[0]
        window = torch.zeros(batch, dtype=torch.long, device=device)
        threshold = torch.zeros(batch, dtype=torch.float32, device=device)
        window[members] = torch.tensor([r.window for r in rules], dtype=torch.long, device=device)
        threshold[members] = torch.tensor([r.entropy_threshold for r in rules], dtype=torch.float32, device=device)
        window = torch.where(drafts.greedy, window, torch.zeros_like(window))
        on = window[drafts.request] > 0  # the draft tokens whose session this rule judges
        rows = drafts.rows[on]
        entropy = torch.zeros(exact.shape, device=device)
        possible = torch.zeros(exact.shape, dtype=torch.bool, device=device)
        if rows.numel():
            judged = drafts.logits[rows].float()
            at = (drafts.request[on], drafts.position[on])
            entropy[at] = top3_entropy(judged)
            log_p = torch.log_softmax(judged, dim=-1).gather(-1, drafts.token_ids[on].unsqueeze(-1)).squeeze(-1)
            possible[at] = log_p.exp() > 0  # float32's zero, as the target's softmax has it
        return loose_accept(exact, drafts.num_draft, entropy, possible, window, threshold)
