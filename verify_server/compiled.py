"""The step compiled whole: the runner's forward under torch.compile(fullgraph=True).

A step's tokens are padded to a bucket; tokens, positions, pool rows and logit rows sit in static buffers of the
bucket's size, the padding tokens writing to the pool's scratch row. The graph ends at the final norm of the logit
rows; the LM head then runs over the real ones alone.

On CUDA, attention is FlexAttention over the pool with the step's BlockMask (kernels/flex.py, built on the host from
the block tables), each of a few buckets is a graph of static shapes, captured as CUDA graphs (mode
"reduce-overhead"). On a CPU, attention is the runner's own per-segment kernel as one op of the graph, and one graph
whose token count is symbolic serves vLLM's fine buckets (inductor's C++). Graphs compile at warm-up; inductor's
on-disk cache makes a restart's compile a load.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch
from torch.nn.attention.flex_attention import flex_attention

from kernels.attention import Segment
from kernels.flex import PagedFlex
from kernels.linear import linear_reference

from .model_runner import FLEX_BUCKETS, LayerKernels, ModelInput, ModelRunner

log = logging.getLogger(__name__)

# Live steps by handle. Handles and plan names are strings: an int argument that differs between two steps'
# graphs would be made symbolic by dynamo's automatic dynamic shapes, and the op needs its value.
_STEPS: weakref.WeakValueDictionary[str, CompiledStep] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("sled::segment_attention", mutates_args=())
def _segment_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, handle: str, plan: str,
                       scale: float) -> torch.Tensor:
    """The runner's own attention over the step's segments with its plan named `plan` (set by
    CompiledStep.attention_plans), as one op of the graph; the bucket's padding rows get zeros."""
    step = _STEPS[handle]
    segments = step.segments
    n = segments[-1].start + segments[-1].length
    out = q.new_zeros(q.shape)
    out[:n] = step.runner.attention(q[:n], k_cache, v_cache, segments, scale, step.plans[plan])
    return out


@_segment_attention.register_fake
def _(q, k_cache, v_cache, handle, plan, scale):
    return torch.empty_like(q)


# vLLM's CUDA-graph capture sizes: 1, 2, 4, then every 8 tokens up to 256 and every 16 past it. One graph whose
# token count is symbolic serves them all, so their number costs no compile.
FINE_BUCKETS = (1, 2, 4, *range(8, 256, 8), *range(256, 4097, 16))


def buckets_for(max_tokens: int, sizes: tuple[int, ...] = FLEX_BUCKETS) -> tuple[int, ...]:
    """The buckets a server whose steps hold at most max_tokens tokens compiles, from `sizes`."""
    out = [b for b in sizes if b < max_tokens]
    last = next((b for b in sizes if b >= max_tokens), None)
    return tuple(out + [last if last is not None else -(-max_tokens // sizes[-1]) * sizes[-1]])


class CompiledStep:
    """runner's forward, compiled per bucket of token counts."""

    def __init__(self, runner: ModelRunner, max_tokens: int, attention: str = "auto"):
        """attention: "flex" (FlexAttention over the pool, in the graph), "segments" (the runner's own attention,
        one op of the graph) or "auto": segments on a CPU, whose FlexAttention template runs a small step's
        attention several times slower than the runner's batched matmuls (docs/architecture.md), flex elsewhere."""
        if runner.shard is not None and runner.shard.world > 1:
            raise ValueError("the compiled step does not run tensor parallel yet: compile off")
        if attention not in ("auto", "flex", "segments"):
            raise ValueError(f"attention is auto, flex or segments, not {attention!r}")
        self.runner = runner
        kv = runner.kv
        if attention == "auto":
            attention = "segments" if runner.device.type == "cpu" and runner.prepare_attention else "flex"
        self.attention = attention
        # FlexAttention's BlockMask is built for one query length: a graph a bucket, few buckets. The segments op
        # takes any length: one graph with a symbolic token count (and one for a single token, which dynamo
        # specializes) serves vLLM's fine buckets.
        self.dynamic = attention == "segments"
        self.buckets = buckets_for(max_tokens, FINE_BUCKETS if self.dynamic else FLEX_BUCKETS)
        self.handle = f"step-{next(_HANDLES)}"
        _STEPS[self.handle] = self
        self.segments: list[Segment] = []  # the step's, and its attention plans, while the graph runs
        self.plans: dict = {}
        self.flex = None
        if attention == "flex":
            self.flex = PagedFlex(kv.pool_shape(), max_tokens=self.buckets[-1], compiled=False)
            kv.zero_blocks = True  # FlexAttention reads whole blocks
        long = dict(dtype=torch.long, device=runner.device)
        self.inputs = {b: (torch.zeros(b, **long), torch.zeros(b, **long), torch.full((b,), kv.scratch_row, **long),
                           torch.zeros(b, **long)) for b in self.buckets}
        if self.dynamic:
            for b in self.buckets:
                for t in self.inputs[b] if b > 1 else ():
                    torch._dynamo.mark_dynamic(t, 0)
        # On a CPU the runner's oneDNN-packed projections, through the op a graph holds (kernels.linear); elsewhere
        # plain F.linear over the model's own weights, whose matrix products inductor chooses.
        if runner.linear == "onednn":
            self.proj = [tuple(p.traced for p in group) for group in runner.proj]
        else:
            self.proj = runner.projections(linear_reference)[0]
        # each layer's pool as an input of its own (a view made here): inductor's FlexAttention reads its input
        self.caches = [(kv.k[i], kv.v[i]) for i in range(kv.k.shape[0])]
        mode = "reduce-overhead" if runner.device.type == "cuda" else None  # CUDA graphs on CUDA
        # Each bucket (and each step object of the process) is one more graph of the same function: past dynamo's
        # default of 8 it would stop compiling (and fail, fullgraph) rather than serve the eleventh bucket.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.fn = torch.compile(self.body, fullgraph=True, dynamic=None if self.dynamic else False, mode=mode)
        self.compiled: set[int] = set()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a step of {n} tokens is past the largest bucket ({self.buckets[-1]})")

    def body(self, tokens, positions, rows, logit_rows, plans, caches):
        r = self.runner
        attend = self.attend if self.attention == "flex" else self.attend_segments
        h = r.layers_forward(r.embed_tokens(tokens), positions, rows, None, plans,
                             LayerKernels(attend, self.proj, caches))
        return r.final_norm(h, logit_rows)

    def attention_plans(self, segments: list[Segment], size: int) -> dict:
        """The graph's `plans` for a step: each window's BlockMask (flex), or each window's plan name, the step's own
        plans kept here for the op to read (segments)."""
        run = self.runner
        if self.attention == "flex":
            return {w: p.block_mask for w, p in self.flex.plans(segments, run.windows, size).items()}
        self.segments = segments
        self.plans = {str(w): run.prepare_attention(segments, run.device, run.num_heads // run.num_kv_heads,
                                                    run.dtype, w) for w in run.windows}
        return {w: str(w) for w in run.windows}

    def attend_segments(self, q, k_cache, v_cache, segments, scale, plan):
        return _segment_attention(q, k_cache, v_cache, self.handle, plan, scale)

    @staticmethod
    def attend(q, k_cache, v_cache, segments, scale, block_mask):
        # The query scaled here, a 4-D buffer of its own: inductor's CPU template reads its input's layout as 4-D
        # (a view of the projection's 3-D output fails, with one head too, where a copy would be elided).
        out = flex_attention(q.transpose(0, 1)[None] * scale, k_cache[None], v_cache[None], block_mask=block_mask,
                             scale=1.0, enable_gqa=k_cache.shape[0] != q.shape[1])
        return out[0].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        n, r = inp.token_ids.shape[0], inp.logit_rows.shape[0]
        size = self.bucket(n)
        tokens, positions, rows, logit_rows = self.inputs[size]
        tokens[:n] = inp.token_ids
        tokens[n:] = 0
        positions[:n] = inp.positions
        positions[n:] = 0
        rows[:n] = inp.rows
        rows[n:] = self.runner.kv.scratch_row
        logit_rows[:r] = inp.logit_rows
        logit_rows[r:] = 0
        try:
            normed = self.fn(tokens, positions, rows, logit_rows, self.attention_plans(inp.segments, size),
                             self.caches)
        finally:
            self.segments, self.plans = [], {}
        self.compiled.add(size)
        # The LM head, the step's largest matrix, over the logit rows alone, outside the graph: inside, it would
        # run at every row of the bucket.
        return self.runner.head(normed[:r])

    def warmup(self, blocks: list[int], progress=log.info) -> dict[int, float]:
        """Compile every graph, one placeholder step each (segments of up to what `blocks` hold, all over them):
        every bucket's, or with a symbolic token count the single token's, the smallest bucket past it and the
        largest; seconds per bucket."""
        bs = self.runner.kv.block_size
        room = min(len(blocks) * bs, self.runner.kv.max_seq_len)
        table = tuple(blocks)
        took = {}
        sizes = sorted({*self.buckets[:2], self.buckets[-1]}) if self.dynamic else self.buckets
        for size in sizes:
            segments, start = [], 0
            while start < size:
                n = min(room, size - start)
                segments.append(Segment(table, start, n, n, bs))
                start += n
            t0 = time.monotonic()
            self.forward(ModelInput.build([1] * size, segments, list(range(size))))
            took[size] = time.monotonic() - t0
            progress("compiled the step for %d tokens in %.1fs (%d of %d%s)", size, took[size], len(took), len(sizes),
                     f"; one graph serves {self.buckets[1]} to {self.buckets[-1]} tokens" if self.dynamic
                     else " buckets")
        return took
