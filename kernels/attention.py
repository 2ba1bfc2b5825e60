"""Attention of a ragged batch of new tokens over each session's cached keys and values."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Segment:
    """New tokens [start, start + length) of the flat batch belong to the session with block table `blocks`;
    after they are written, positions [0, context_len) of it are valid. Position p of the session lives at row
    blocks[p // block_size] * block_size + p % block_size of the pool."""

    blocks: tuple[int, ...]
    start: int
    length: int
    context_len: int
    block_size: int

    @functools.cached_property
    def keys(self) -> slice | torch.Tensor:
        """The pool rows of positions [0, context_len): a slice (a view, no copy) where its blocks are
        consecutive, else an index."""
        n, bs = self.context_len, self.block_size
        used = self.blocks[: -(-n // bs)]
        if all(b == used[0] + i for i, b in enumerate(used)):
            first = used[0] * bs if used else 0
            return slice(first, first + n)
        return (torch.tensor(used, dtype=torch.long)[:, None] * bs + torch.arange(bs)).flatten()[:n]


def slot_segment(slot: int, start: int, length: int, context_len: int, max_seq_len: int) -> Segment:
    """A session that holds one block of max_seq_len positions (the pool as one slot per session)."""
    return Segment((slot,), start, length, context_len, max_seq_len)


def attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    v_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    segments: list[Segment],
    scale: float,
    window: int | None = None,  # sliding-window attention: each query sees its last `window` positions only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain math, one segment at a time: softmax(q k^T * scale + causal mask) v, heads grouped."""
    out = torch.empty_like(q)
    num_heads, num_kv = q.shape[1], k_cache.shape[0]
    for seg in segments:
        qs = q[seg.start : seg.start + seg.length].transpose(0, 1).float()  # [heads, L, d]
        ks = k_cache[:, seg.keys].float().repeat_interleave(num_heads // num_kv, 0)
        vs = v_cache[:, seg.keys].float().repeat_interleave(num_heads // num_kv, 0)
        scores = qs @ ks.transpose(1, 2) * scale  # [heads, L, ctx]
        query_pos = torch.arange(seg.context_len - seg.length, seg.context_len, device=q.device)
        key_pos = torch.arange(seg.context_len, device=q.device)
        hidden = key_pos[None, :] > query_pos[:, None]
        if window is not None:
            hidden |= key_pos[None, :] <= query_pos[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[seg.start : seg.start + seg.length] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


# A long segment's queries (a prompt's chunk) are attended in blocks of QUERY_BLOCK, each over the key positions it
# can see: the kernel then reads no keys past the block's last query (half of a whole prompt's scores) and, in a
# sliding window, none before the window of its first query (docs/kernels.md).
QUERY_BLOCK = 256


@dataclass(frozen=True)
class QueryBlock:
    """Queries [start, start + length) of a segment, which see key positions [lo, hi) of its context at most."""

    start: int
    length: int
    lo: int
    hi: int
    mask: torch.Tensor  # additive [groups * length, hi - lo]: 0 where the query sees the key, -inf elsewhere


def _mask(queries: torch.Tensor, keys: torch.Tensor, groups: int, dtype, window: int | None) -> torch.Tensor:
    """The additive mask of query positions [..., L] over key positions [S]: [..., groups * L, S], tiled once per
    query head of a KV group."""
    seen = keys <= queries[..., None]
    if window is not None:
        seen &= keys > queries[..., None] - window
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
    return mask.repeat(*[1] * (mask.dim() - 2), groups, 1)


def causal_masks(segments: list[Segment], device, groups: int = 1, dtype: torch.dtype = torch.float32,
                 window: int | None = None) -> list[torch.Tensor | tuple[QueryBlock, ...] | None]:
    """Per segment of several tokens, an additive mask [groups * length, context_len]: 0 where query i (at
    context_len - length + i) sees the key, -inf past it (and, with a sliding `window`, -inf at `window`
    positions before it and earlier), tiled once per query head of a KV group; for a segment longer than
    QUERY_BLOCK, its QueryBlocks instead; None for a one-token segment that sees every key. Built once per forward
    and shared by every layer of that window."""
    masks: list[torch.Tensor | tuple[QueryBlock, ...] | None] = []
    for seg in segments:
        first = seg.context_len - seg.length  # the first query's position
        if seg.length == 1 and (window is None or seg.context_len <= window):
            masks.append(None)
            continue
        if seg.length <= QUERY_BLOCK:
            masks.append(_mask(torch.arange(first, seg.context_len, device=device),
                               torch.arange(seg.context_len, device=device), groups, dtype, window))
            continue
        blocks = []
        for start in range(0, seg.length, QUERY_BLOCK):
            length = min(QUERY_BLOCK, seg.length - start)
            hi = first + start + length
            lo = 0 if window is None else max(0, first + start - window + 1)
            blocks.append(QueryBlock(start, length, lo, hi,
                                     _mask(torch.arange(first + start, hi, device=device),
                                           torch.arange(lo, hi, device=device), groups, dtype, window)))
        masks.append(tuple(blocks))
    return masks


# On CPU a short segment (a decode token, or a draft's K + 1 tokens) is faster as two batched matmuls than through
# the fused kernel, whose set-up dominates at that size (docs/kernels.md).
MATMUL_MAX_TOKENS = 32


def attention_sdpa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    v_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    segments: list[Segment],
    scale: float,
    masks: list | None = None,  # from causal_masks(..., groups, q.dtype)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Fused scaled_dot_product_attention on each segment's keys (views of the pool where its blocks are
    consecutive, else gathered); on CPU, segments of up to
    MATMUL_MAX_TOKENS tokens in float32 as softmax(q k^T * scale + mask) v in two batched matmuls instead.

    Grouped-query attention without expanding K and V: the `groups` query heads that share a KV head
    are folded into the query-length dimension ([heads, L, d] -> [kv_heads, groups * L, d]), which is
    exact since query rows are independent, and keeps torch on its fused kernel (enable_gqa would send
    it to the unfused math path on CPU, copying K and V).
    """
    heads, kv_heads, dim = q.shape[1], k_cache.shape[0], q.shape[2]
    groups = heads // kv_heads
    if masks is None:
        masks = causal_masks(segments, q.device, groups, q.dtype)
    matmul_max = MATMUL_MAX_TOKENS if q.device.type == "cpu" and q.dtype == torch.float32 else 0
    out = torch.empty_like(q) if len(segments) > 1 else None
    for seg, mask in zip(segments, masks):
        n = seg.length
        ks = k_cache[:, seg.keys]  # [kv_heads, ctx, d]
        vs = v_cache[:, seg.keys]
        if isinstance(mask, tuple):  # QueryBlocks
            o = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
            for blk in mask:
                rows = slice(seg.start + blk.start, seg.start + blk.start + blk.length)
                o[blk.start : blk.start + blk.length] = _attend(q[rows], ks[:, blk.lo : blk.hi],
                                                                vs[:, blk.lo : blk.hi], blk.mask, scale, matmul_max)
        else:
            o = _attend(q[seg.start : seg.start + n], ks, vs, mask, scale, matmul_max)
        if out is None:  # one segment: its output is the whole output
            return o
        out[seg.start : seg.start + n] = o
    return out


def _attend(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None, scale: float,
            matmul_max: int) -> torch.Tensor:
    """Queries [L, heads, d] over keys and values [kv_heads, ctx, d] with an additive mask [groups * L, ctx]."""
    n, heads, dim = q.shape
    kv_heads = ks.shape[0]
    groups = heads // kv_heads
    qs = q.transpose(0, 1).reshape(kv_heads, groups * n, dim)
    if n <= matmul_max:
        scores = (torch.bmm(qs, ks.transpose(1, 2)).mul_(scale) if mask is None
                  else torch.baddbmm(mask, qs, ks.transpose(1, 2), alpha=scale))
        o = torch.bmm(scores.softmax(-1), vs)
    else:
        # 4-D ([1, kv_heads, groups * L, d]): with 3-D inputs torch's CPU dispatch skips its flash kernel.
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None],
                                           attn_mask=None if mask is None else mask[None, None], scale=scale)[0]
    return o.reshape(heads, n, dim).transpose(0, 1)


# On CUDA every kernel launch costs a few microseconds of host time, and the per-segment loop above launches
# about six per segment and layer: at 32 sessions, 3,000 launches a step for a 16-layer model. The short
# segments of a step (drafts and decode tokens) go instead through one padded call per layer; longer ones
# (prompts) keep their own call, so one prompt does not pad every draft to its length.
BATCH_MAX_TOKENS = 32


@dataclass(frozen=True)
class BatchPlan:
    """The short segments of a ragged batch laid out for one padded attention call per layer: B segments, each
    padded to `max_len` query rows and `max_ctx` keys. Built once per forward and shared by every layer."""

    keys: torch.Tensor  # [B, max_ctx] pool row of each segment's key positions (row 0 past its context)
    rows: torch.Tensor  # [B, max_len] flat token index of each padded query row (0 for padding)
    seg: torch.Tensor  # [m] segment of each of the m tokens the plan covers
    offset: torch.Tensor  # [m] its row within the segment
    tokens: torch.Tensor  # [m] its flat index in the batch
    key_ok: torch.Tensor  # [B, 1, max_ctx, 1] bool, key position < context_len
    mask: torch.Tensor  # [B, 1, groups * max_len, max_ctx] additive: 0 where the query sees the key, -inf past it
    rest: list[Segment]  # the long segments, attended one at a time
    rest_masks: list  # causal_masks of the rest


def batch_plan(segments: list[Segment], device, groups: int = 1, dtype: torch.dtype = torch.float32,
               window: int | None = None) -> BatchPlan:
    short = [s for s in segments if s.length <= BATCH_MAX_TOKENS]
    rest = [s for s in segments if s.length > BATCH_MAX_TOKENS]
    lens = torch.tensor([s.length for s in short], dtype=torch.long)
    ctx = torch.tensor([s.context_len for s in short], dtype=torch.long)
    starts = torch.tensor([s.start for s in short], dtype=torch.long)
    max_len = int(lens.max()) if short else 0
    max_ctx = int(ctx.max()) if short else 0
    i = torch.arange(max_len)
    valid = i[None, :] < lens[:, None]  # [B, max_len]
    rows = torch.where(valid, starts[:, None] + i[None, :], 0)
    seg = torch.repeat_interleave(torch.arange(len(short)), lens)
    offset = torch.cat([torch.arange(n) for n in lens.tolist()]) if short else torch.zeros(0, dtype=torch.long)
    to = dict(device=device, non_blocking=True)
    # The mask is built where it is used: its size grows with the context, the index tensors' does not.
    lens_d, ctx_d, i_d = lens.to(**to), ctx.to(**to), i.to(**to)
    keys = torch.arange(max_ctx, device=device)
    # Query row i of a segment sits at position context_len - length + i and sees keys [0, that position]; a
    # padding row sees the same as the segment's last row (its output is dropped; it only must not be NaN).
    qpos = (ctx_d - lens_d)[:, None] + torch.minimum(i_d[None, :], lens_d[:, None] - 1)  # [B, max_len]
    mask = _mask(qpos, keys, groups, dtype, window)[:, None]  # [B, 1, groups * max_len, max_ctx]
    key_ok = (keys[None, :] < ctx_d[:, None])[:, None, :, None]
    key_rows = torch.zeros(len(short), max_ctx, dtype=torch.long)
    for b, s in enumerate(short):
        keys = s.keys
        key_rows[b, : s.context_len] = torch.arange(keys.start, keys.stop) if isinstance(keys, slice) else keys
    return BatchPlan(keys=key_rows.to(**to), rows=rows.to(**to),
                     seg=seg.to(**to), offset=offset.to(**to), tokens=(starts[seg] + offset).to(**to),
                     key_ok=key_ok, mask=mask, rest=rest,
                     rest_masks=causal_masks(rest, device, groups, dtype, window))


def attention_batched(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    v_cache: torch.Tensor,  # [num_kv_heads, pool_rows, head_dim]
    plan: BatchPlan,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The plan's short segments in one padded scaled_dot_product_attention, the long ones one at a time.

    Each segment's keys are gathered from its blocks up to the longest context of the batch ([B, kv_heads,
    max_ctx, d], a copy of what the step reads anyway); keys and values past a segment's own context are zeroed,
    since an unwritten pool row may hold anything (NaN too, and 0 * NaN is NaN even under a -inf score)."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[0], q.shape[2]
    groups = heads // kv_heads
    out = torch.empty_like(q)
    b, max_len = plan.rows.shape
    if b:
        qs = q[plan.rows].permute(0, 2, 1, 3).reshape(b, kv_heads, groups * max_len, dim)
        ks = k_cache[:, plan.keys].transpose(0, 1).masked_fill_(~plan.key_ok, 0)  # [B, kv_heads, max_ctx, d]
        vs = v_cache[:, plan.keys].transpose(0, 1).masked_fill_(~plan.key_ok, 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.mask, scale=scale)
        o = o.reshape(b, heads, max_len, dim).permute(0, 2, 1, 3)  # [B, max_len, heads, d]
        out[plan.tokens] = o[plan.seg, plan.offset]
    for seg, mask in zip(plan.rest, plan.rest_masks):
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = attention_sdpa(q[rows], k_cache, v_cache, [dataclasses.replace(seg, start=0)], scale, [mask])
    return out


def attention_plan(segments: list[Segment], device, groups: int = 1, dtype: torch.dtype = torch.float32,
                   window: int | None = None):
    """What the attention of one forward shares across layers (of one window): on CUDA with several segments a
    BatchPlan, else the per-segment masks of causal_masks."""
    if torch.device(device).type == "cuda" and len(segments) > 1:
        return batch_plan(segments, device, groups, dtype, window)
    return causal_masks(segments, device, groups, dtype, window)


def attention_auto(q, k_cache, v_cache, segments, scale, plan=None):
    """`sdpa`: one padded call per layer where attention_plan gave a BatchPlan (CUDA), the per-segment loop else."""
    if isinstance(plan, BatchPlan):
        return attention_batched(q, k_cache, v_cache, plan, scale)
    return attention_sdpa(q, k_cache, v_cache, segments, scale, plan)


def window_only(segments, device, groups=1, dtype=torch.float32, window=None):
    """The reference builds its masks itself: all it is handed is the window."""
    return window


# name -> (what one forward prepares for every layer, the attention of one layer)
ATTENTION = {
    "sdpa": (attention_plan, attention_auto),  # the default: batched on CUDA, per segment on CPU
    "segments": (causal_masks, attention_sdpa),  # per segment everywhere (the CUDA path before batching)
    "reference": (window_only, attention_reference),
}
