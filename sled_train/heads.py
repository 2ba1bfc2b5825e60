"""The trained parts of a drafter: blocks on the backbone's hidden states, with the backbone model's own final norm
and LM head (frozen) on top."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .graph import Block, DraftGraph, ParallelGraph, blocks_of, causal_mask, inv_freq, rms, rope, slot_rows


def head_blocks(model, layers: int, count: int) -> list[Block]:
    """`count` trainable blocks, copies of the backbone model's layers from `layers` on (its last, past the end):
    at step 0 the drafter is the model's first `layers + count` layers, so training starts from an early exit."""
    stack = list(model.model.layers)
    return [Block(stack[min(layers + i, len(stack) - 1)], model.config, trainable=True) for i in range(count)]


class Head(torch.nn.Module):
    def __init__(self, model, layers: int, count: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(head_blocks(model, layers, count))
        self.layers = layers
        self.register_buffer("freqs", inv_freq(model), persistent=False)
        # frozen: the backbone model's final norm and LM head, read, never trained (nor saved)
        self.register_buffer("norm_w", model.model.norm.weight.detach(), persistent=False)
        self.register_buffer("lm", model.lm_head.weight.detach(), persistent=False)  # [vocab, hidden]
        self.eps = model.config.rms_norm_eps

    def norm(self, x):
        return rms(x, self.norm_w, self.eps)

    def logits(self, x):  # x normed
        return x @ self.lm.T

    def run(self, x, positions, mask):
        cos, sin = rope(positions, self.freqs)
        for block in self.blocks:
            x, _, _ = block(x, cos, sin, mask)
        return x


class ImitationHead(Head):
    """FastVLM's imitation network: blocks trained so that the backbone's early exit imitates the full model."""

    kind = "imitation"

    def forward(self, hidden):  # [B, T, hidden] -> normed [B, T, hidden], what the LM head reads
        b, t, _ = hidden.shape
        dev = hidden.device
        return self.norm(self.run(hidden, torch.arange(t, device=dev)[None].expand(b, t), causal_mask(0, t).to(dev)))

    def graph(self, model) -> DraftGraph:
        return DraftGraph(model, blocks_of(model, self.layers) + list(self.blocks))


class ParallelHead(Head):
    """SpecFormer's draft block: slot 0 is the last context row itself (what an imitation head drafts there), and
    S - 1 more slot rows, each that row's hidden state moved by its own learned residual map (slot_rows), attend
    causally to the context and bidirectionally to each other; with `blank`, a CTC head's extra logit. Slot j sits
    at the last context position + j."""

    kind = "parallel"

    def __init__(self, model, layers: int, count: int, slots: int, blank: bool, seed: int):
        super().__init__(model, layers, count)
        hidden = model.config.hidden_size
        g = torch.Generator().manual_seed(seed)
        # slots 1..S-1: each its own residual map of the anchor row (Medusa's heads), zero at the start
        self.slot_maps = torch.nn.Parameter(torch.zeros(slots - 1, hidden, hidden))
        self.slots = torch.nn.Parameter(torch.randn(slots - 1, hidden, generator=g) * 0.02)
        self.blank = torch.nn.Linear(hidden, 1) if blank else None
        if blank:
            torch.nn.init.zeros_(self.blank.weight)
            torch.nn.init.constant_(self.blank.bias, -2.0)

    def forward(self, hidden, anchors):
        """hidden [B, T, hidden]; anchors [B, A] (context ends, each its own slots) -> the slot rows normed
        [B, A, S, hidden] and the context rows normed [B, T, hidden] (each its imitation of the next token)."""
        b, t, d = hidden.shape
        a, s, dev = anchors.shape[1], self.slots.shape[0], hidden.device
        rows = torch.gather(hidden, 1, anchors[..., None].expand(b, a, d))  # [B, A, hidden]
        slots = slot_rows(rows, self.slot_maps, self.slots, self.eps).reshape(b, a * s, d)
        x = torch.cat([hidden, slots], dim=1)
        slot_pos = (anchors[..., None] + 1 + torch.arange(s, device=dev)).reshape(b, a * s)
        positions = torch.cat([torch.arange(t, device=dev)[None].expand(b, t), slot_pos], dim=1)
        x = self.run(x, positions, self.mask(anchors.cpu(), t, s).to(dev))
        context = x[:, :t]
        first = torch.gather(context, 1, anchors[..., None].expand(b, a, d))[:, :, None]  # slot 0: the anchor row
        return self.norm(torch.cat([first, x[:, t:].reshape(b, a, s, d)], dim=2)), self.norm(context)

    @staticmethod
    def mask(anchors, t: int, s: int) -> torch.Tensor:
        """[B, 1, T + A*s, T + A*s] for s extra slots an anchor: the context causal; anchor a's slots see the context
        up to it and its own slots."""
        b, a = anchors.shape
        n = t + a * s
        allowed = torch.zeros(b, n, n, dtype=torch.bool)
        allowed[:, :t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
        ctx = torch.arange(t)[None, None] <= anchors[..., None]  # [B, A, T]
        allowed[:, t:, :t] = ctx[:, :, None].expand(b, a, s, t).reshape(b, a * s, t)
        for i in range(a):
            allowed[:, t + i * s:t + (i + 1) * s, t + i * s:t + (i + 1) * s] = True
        return torch.where(allowed, 0.0, float("-inf"))[:, None]

    def slot_logits(self, x):  # normed slot rows -> [..., vocab (+1)]
        logits = self.logits(x)
        if self.blank is not None:
            logits = torch.cat([logits, self.blank(x)], dim=-1)
        return logits

    def graph(self, model) -> ParallelGraph:
        return ParallelGraph(model, blocks_of(model, self.layers), list(self.blocks), self.slot_maps, self.slots,
                             self.blank)


def soft_cross_entropy(logits, top_ids, top_probs):
    """The KL to the target's distribution (its top tokens), up to the target's entropy, which training cannot
    change."""
    return -(top_probs * F.log_softmax(logits.float(), -1).gather(-1, top_ids)).sum(-1)


def ctc_loss(logits, targets, blank: int):
    """logits [N, S, vocab + 1], targets [N, K]: CTC over the S slots (blank and repeats collapse)."""
    n, s, _ = logits.shape
    log_probs = F.log_softmax(logits.float(), -1).transpose(0, 1)  # [S, N, C]
    return F.ctc_loss(log_probs, targets, torch.full((n,), s, dtype=torch.long),
                      torch.full((n,), targets.shape[1], dtype=torch.long), blank=blank, reduction="none",
                      zero_infinity=True) / targets.shape[1]


def ctc_collapse(tokens: list[int], blank: int) -> list[int]:
    """CTC's decoding of one path: repeats merged, then blanks dropped."""
    out, prev = [], None
    for t in tokens:
        if t != prev and t != blank:
            out.append(t)
        prev = t
    return out
