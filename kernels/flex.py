"""FlexAttention over the paged KV pool: one attention call per layer for the whole ragged batch.

The pool is read in place ([kv_heads, pool_rows, head_dim] as one "sequence" of keys). Which keys a query sees is
a BlockMask built from the step's block tables, once per forward: each block of `q_block` query rows lists the
pool blocks of the sessions it holds, and a mask_mod sorts out the rest row by row. Every block a session holds has
one logical index (prefix blocks are shared only at the same positions), so the mask reads a pool-wide
`block_logical` and the step's tables, all in buffers of fixed shape that are refilled in place: the compiled
kernel never sees a new shape or a new closure, only new values.

A segment may also be a tree of draft tokens (parents per token): a token then sees the context and its own
ancestors in the tree, and its KV row is its index in the segment while its position is its depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .attention import Segment

NO_TREE = 2**62  # a token whose tree starts here sees plain causal attention


@dataclass(frozen=True)
class FlexPlan:
    block_mask: BlockMask
    length: int  # query rows, padded to whole q blocks


def _ancestors(parents: list[int]) -> list[list[int]]:
    """Per node, the nodes on its path from the root, itself included."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: a parent must come before its child")
        out.append((out[p] if p >= 0 else []) + [i])
    return out


def tree_positions(parents: list[int], first: int) -> list[int]:
    """The RoPE position of each node of a draft tree whose root sits at position `first`: first + its depth."""
    return [first + len(path) - 1 for path in _ancestors(parents)]


@dataclass(frozen=True)
class PoolShape:
    """The KV pool as FlexAttention reads it: blocks (the scratch block included), positions a block, the longest
    session, and where it lives."""

    num_blocks: int
    block_size: int
    max_seq_len: int
    device: torch.device | str


class PagedFlex:
    """The buffers and the compiled kernel of one runner's FlexAttention over its pool."""

    def __init__(self, pool: PoolShape, q_block: int = 8, max_tokens: int = 2048, max_segments: int | None = None,
                 max_tree: int = 64, compiled: bool = True):
        num_blocks, block_size, max_seq_len, device = pool.num_blocks, pool.block_size, pool.max_seq_len, pool.device
        max_segments = max_segments or max_tokens  # a segment has at least one token
        self.block_size, self.q_block, self.num_blocks = block_size, q_block, num_blocks
        self.rows = num_blocks * block_size
        width = -(-max_seq_len // block_size)
        long = dict(dtype=torch.long, device=device)
        self.block_logical = torch.zeros(num_blocks, **long)
        self.tables = torch.full((max_segments, width), -1, **long)
        self.qseg = torch.zeros(max_tokens, **long)
        self.qlog = torch.zeros(max_tokens, **long)  # the query's own logical row: it sees rows up to it
        self.qpos = torch.zeros(max_tokens, **long)
        self.tstart = torch.full((max_tokens,), NO_TREE, **long)  # where its tree begins, if it is in one
        self.anc = torch.zeros(max_tokens, max_tree, dtype=torch.bool, device=device)
        self.device = device
        self._mask_mods: dict[int | None, object] = {}
        self.attend_fn = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compiled else flex_attention

    def mask_mod(self, window: int | None):
        """The mask of one window (None: global), made once so the compiled kernel keeps its closure."""
        if window not in self._mask_mods:
            bs, width, tree = self.block_size, self.tables.shape[1], self.anc.shape[1]
            block_logical, tables, qseg, qlog, qpos = self.block_logical, self.tables, self.qseg, self.qlog, self.qpos
            tstart, anc = self.tstart, self.anc

            def mask(b, h, q, kv):
                block = kv // bs
                lb = block_logical[block]
                li = lb * bs + kv % bs
                mine = tables[qseg[q], lb.clamp(0, width - 1)] == block
                offset = li - tstart[q]
                in_tree = anc[q, offset.clamp(0, tree - 1)]
                seen = mine & (li <= qlog[q]) & ((li < tstart[q]) | in_tree)
                if window is not None:
                    seen = seen & ((li >= tstart[q]) | (qpos[q] - li < window))
                return seen

            self._mask_mods[window] = mask
        return self._mask_mods[window]

    def prepare(self, segments: list[Segment], window: int | None = None, length: int | None = None,
                trees: dict[int, list[int]] | None = None) -> FlexPlan:
        """The BlockMask of a step: `segments` in flat order, the query rows padded to `length` (default: whole
        q blocks); trees: segment index -> each token's parent within the segment (-1: the context)."""
        return self.plans(segments, [window], length, trees)[window]

    def plans(self, segments: list[Segment], windows, length: int | None = None,
              trees: dict[int, list[int]] | None = None) -> dict[int | None, FlexPlan]:
        """One plan per window, from one filling of the buffers (they differ by their mask_mod alone)."""
        n = sum(s.length for s in segments)
        qb = self.q_block
        length = length or max(qb, -(-n // qb) * qb)
        if length % qb or length < n or length > self.qseg.shape[0]:
            raise ValueError(f"{length} query rows cannot hold {n} tokens in blocks of {qb}")
        if len(segments) > self.tables.shape[0]:
            raise ValueError(f"{len(segments)} segments: at most {self.tables.shape[0]}")
        bs, trees = self.block_size, trees or {}
        # padding rows read the last segment's first new row, whose blocks their q block lists
        last = segments[-1]
        pad = last.context_len - last.length
        qseg, qlog, qpos = [len(segments) - 1] * length, [pad] * length, [pad] * length
        tstart = [NO_TREE] * length
        self.anc.zero_()
        self.tables.fill_(-1)  # no block: padding never matches
        spans = []  # per segment, its rows' range
        for i, seg in enumerate(segments):
            used = seg.blocks[: -(-seg.context_len // bs)]
            self.tables[i, : len(used)] = torch.tensor(used, dtype=torch.long)
            self.block_logical[torch.tensor(used, dtype=torch.long)] = torch.arange(len(used), device=self.device)
            first = seg.context_len - seg.length
            rows = range(seg.start, seg.start + seg.length)
            spans.append((seg.start, seg.start + seg.length, set(used)))
            for j, r in enumerate(rows):
                qseg[r], qlog[r], qpos[r] = i, first + j, first + j
            if i in trees:
                parents = trees[i]
                if len(parents) != seg.length or seg.length > self.anc.shape[1]:
                    raise ValueError(f"segment {i}: a tree of {len(parents)} nodes for {seg.length} tokens "
                                     f"(at most {self.anc.shape[1]})")
                for j, (r, path) in enumerate(zip(rows, _ancestors(parents))):
                    tstart[r] = first
                    self.anc[r, path] = True
                    qpos[r] = first + len(path) - 1
        self.qseg[:length] = torch.tensor(qseg)
        self.qlog[:length] = torch.tensor(qlog)
        self.qpos[:length] = torch.tensor(qpos)
        self.tstart[:length] = torch.tensor(tstart)
        nqb = length // qb
        kv_num = torch.zeros(1, 1, nqb, dtype=torch.int32)
        kv_idx = torch.zeros(1, 1, nqb, self.num_blocks, dtype=torch.int32)
        for j in range(nqb):
            lo, hi = j * qb, min((j + 1) * qb, n)
            blocks = set()
            for start, end, used in spans:
                if start < hi and end > lo:
                    blocks |= used
            if lo >= n:  # padding rows only
                blocks = spans[-1][2]
            blocks = sorted(blocks)
            kv_num[0, 0, j] = len(blocks)
            kv_idx[0, 0, j, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        kv_num, kv_idx = kv_num.to(self.device), kv_idx.to(self.device)
        return {w: FlexPlan(BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(qb, bs), mask_mod=self.mask_mod(w),
                                                     seq_lengths=(length, self.rows)), length) for w in windows}

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlexPlan,
               scale: float) -> torch.Tensor:
        """q [num_tokens, heads, d] over k_cache, v_cache [kv_heads, pool_rows, d] -> [num_tokens, heads, d]."""
        n = q.shape[0]
        qs = q.new_zeros(plan.length, *q.shape[1:])
        qs[:n] = q
        out = self.attend_fn(qs.transpose(0, 1)[None], k_cache[None], v_cache[None], block_mask=plan.block_mask,
                             scale=scale, enable_gqa=k_cache.shape[0] != q.shape[1])
        return out[0].transpose(0, 1)[:n]
