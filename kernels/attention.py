"""Attention of a ragged batch of new tokens over each session's cached keys and values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Segment:
    """New tokens [start, start + length) of the flat batch belong to cache slot `slot`;
    after they are written, positions [0, context_len) of the slot are valid."""

    slot: int
    start: int
    length: int
    context_len: int


def attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    segments: list[Segment],
    scale: float,
    masks=None,  # unused: the reference builds its own
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain math, one segment at a time: softmax(q k^T * scale + causal mask) v, heads grouped."""
    out = torch.empty_like(q)
    num_heads, num_kv = q.shape[1], k_cache.shape[1]
    for seg in segments:
        qs = q[seg.start : seg.start + seg.length].transpose(0, 1).float()  # [heads, L, d]
        ks = k_cache[seg.slot, :, : seg.context_len].float().repeat_interleave(num_heads // num_kv, 0)
        vs = v_cache[seg.slot, :, : seg.context_len].float().repeat_interleave(num_heads // num_kv, 0)
        scores = qs @ ks.transpose(1, 2) * scale  # [heads, L, ctx]
        query_pos = torch.arange(seg.context_len - seg.length, seg.context_len, device=q.device)
        key_pos = torch.arange(seg.context_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[seg.start : seg.start + seg.length] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def causal_masks(segments: list[Segment], device, groups: int = 1) -> list[torch.Tensor | None]:
    """Per segment, [groups * length, context_len] bool: query i (at context_len - length + i) sees keys up to
    it, tiled once per query head of a KV group. Built once per forward and shared by every layer."""
    return [None if seg.length == 1 else
            torch.ones(seg.length, seg.context_len, dtype=torch.bool, device=device)
            .tril(seg.context_len - seg.length).repeat(groups, 1)
            for seg in segments]


def attention_sdpa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    segments: list[Segment],
    scale: float,
    masks: list[torch.Tensor | None] | None = None,  # from causal_masks(..., groups)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Fused scaled_dot_product_attention on views of the cache, no copy of the cache.

    Grouped-query attention without expanding K and V: the `groups` query heads that share a KV head
    are folded into the query-length dimension ([heads, L, d] -> [kv_heads, groups * L, d]), which is
    exact since query rows are independent, and keeps torch on its fused kernel (enable_gqa would send
    it to the unfused math path on CPU, copying K and V).
    """
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    groups = heads // kv_heads
    if masks is None:
        masks = causal_masks(segments, q.device, groups)
    for seg, mask in zip(segments, masks):
        n = seg.length
        qs = q[seg.start : seg.start + n].transpose(0, 1).reshape(kv_heads, groups * n, dim)
        ks = k_cache[seg.slot, :, : seg.context_len]  # [kv_heads, ctx, d], a view
        vs = v_cache[seg.slot, :, : seg.context_len]
        # 4-D ([1, kv_heads, groups * L, d]): with 3-D inputs torch's CPU dispatch skips its flash kernel.
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None],
                                           attn_mask=None if mask is None else mask[None, None], scale=scale)
        out[seg.start : seg.start + n] = o[0].reshape(heads, n, dim).transpose(0, 1)
    return out


ATTENTION = {"reference": attention_reference, "sdpa": attention_sdpa}
