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


def causal_masks(segments: list[Segment], device, groups: int = 1,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor | None]:
    """Per segment of several tokens, an additive mask [groups * length, context_len]: 0 where query i (at
    context_len - length + i) sees the key, -inf past it, tiled once per query head of a KV group; None for a
    one-token segment, which sees every key. Built once per forward and shared by every layer."""
    masks: list[torch.Tensor | None] = []
    for seg in segments:
        if seg.length == 1:
            masks.append(None)
            continue
        seen = torch.ones(seg.length, seg.context_len, dtype=torch.bool, device=device).tril(seg.context_len - seg.length)
        masks.append(torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
                     .repeat(groups, 1))
    return masks


# On CPU a short segment (a decode token, or a draft's K + 1 tokens) is faster as two batched matmuls than
# through the fused kernel, whose setup dominates at that size. Measured here per call, 9 query heads over 3 KV
# heads of 64: 1 token over 129 keys 24 -> 22 us, 5 over 133 50 -> 36 us, 9 over 137 69 -> 50 us, 33 over 200
# 145 -> 136 us; from 64 tokens over 400 keys the fused kernel wins (430 against 971 us).
MATMUL_MAX_TOKENS = 32


def attention_sdpa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, max_seq_len, head_dim]
    segments: list[Segment],
    scale: float,
    masks: list[torch.Tensor | None] | None = None,  # from causal_masks(..., groups, q.dtype)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Fused scaled_dot_product_attention on views of the cache, no copy of the cache; on CPU, segments of up to
    MATMUL_MAX_TOKENS tokens in float32 as softmax(q k^T * scale + mask) v in two batched matmuls instead.

    Grouped-query attention without expanding K and V: the `groups` query heads that share a KV head
    are folded into the query-length dimension ([heads, L, d] -> [kv_heads, groups * L, d]), which is
    exact since query rows are independent, and keeps torch on its fused kernel (enable_gqa would send
    it to the unfused math path on CPU, copying K and V).
    """
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    groups = heads // kv_heads
    if masks is None:
        masks = causal_masks(segments, q.device, groups, q.dtype)
    matmul_max = MATMUL_MAX_TOKENS if q.device.type == "cpu" and q.dtype == torch.float32 else 0
    out = torch.empty_like(q) if len(segments) > 1 else None
    for seg, mask in zip(segments, masks):
        n = seg.length
        qs = q[seg.start : seg.start + n].transpose(0, 1).reshape(kv_heads, groups * n, dim)
        ks = k_cache[seg.slot, :, : seg.context_len]  # [kv_heads, ctx, d], a view
        vs = v_cache[seg.slot, :, : seg.context_len]
        if n <= matmul_max:
            scores = (torch.bmm(qs, ks.transpose(1, 2)).mul_(scale) if mask is None
                      else torch.baddbmm(mask, qs, ks.transpose(1, 2), alpha=scale))
            o = torch.bmm(scores.softmax(-1), vs)
        else:
            # 4-D ([1, kv_heads, groups * L, d]): with 3-D inputs torch's CPU dispatch skips its flash kernel.
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None],
                                               attn_mask=None if mask is None else mask[None, None], scale=scale)[0]
        o = o.reshape(heads, n, dim).transpose(0, 1)
        if out is None:  # one segment: its output is the whole output
            return o
        out[seg.start : seg.start + n] = o
    return out


ATTENTION = {"reference": attention_reference, "sdpa": attention_sdpa}
