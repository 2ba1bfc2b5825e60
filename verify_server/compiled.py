"""The step compiled whole: the runner's forward under torch.compile(fullgraph=True) at static shapes.

A step's tokens are padded to a bucket; tokens, positions, pool rows and logit rows sit in static buffers of the
bucket's size, the padding tokens writing to the pool's scratch row; attention is FlexAttention over the pool with
the step's BlockMask (kernels/flex.py), built on the host from the block tables. On CUDA the graph is captured as
CUDA graphs (mode "reduce-overhead"); on the CPU inductor compiles it to C++. Each bucket compiles once (at
warm-up); inductor's on-disk cache makes a restart's compile a load.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from kernels.attention import Segment
from kernels.flex import PagedFlex
from kernels.linear import linear_reference

from .model_runner import FLEX_BUCKETS, LayerKernels, ModelInput, ModelRunner

log = logging.getLogger(__name__)


def buckets_for(max_tokens: int) -> tuple[int, ...]:
    """The buckets a server whose steps hold at most max_tokens tokens compiles."""
    out = [b for b in FLEX_BUCKETS if b < max_tokens]
    last = next((b for b in FLEX_BUCKETS if b >= max_tokens), None)
    return tuple(out + [last if last is not None else -(-max_tokens // FLEX_BUCKETS[-1]) * FLEX_BUCKETS[-1]])


class CompiledStep:
    """runner's forward, compiled per bucket of token counts."""

    def __init__(self, runner: ModelRunner, max_tokens: int):
        if runner.shard is not None and runner.shard.world > 1:
            raise ValueError("the compiled step does not run tensor parallel yet: compile off")
        self.runner = runner
        kv = runner.kv
        self.buckets = buckets_for(max_tokens)
        self.flex = PagedFlex(kv.pool_shape(), max_tokens=self.buckets[-1], compiled=False)
        kv.zero_blocks = True  # FlexAttention reads whole blocks
        long = dict(dtype=torch.long, device=runner.device)
        self.inputs = {b: (torch.zeros(b, **long), torch.zeros(b, **long), torch.full((b,), kv.scratch_row, **long),
                           torch.zeros(b, **long)) for b in self.buckets}
        # On a CPU the runner's oneDNN-packed projections, through the op a graph holds (kernels.linear); elsewhere
        # plain F.linear over the model's own weights, whose matrix products inductor chooses.
        if runner.linear == "onednn":
            self.proj = [tuple(p.traced for p in group) for group in runner.proj]
            self.project_logits = runner.project_logits.traced
        else:
            self.proj, self.project_logits = runner.projections(linear_reference)
        # each layer's pool as an input of its own (a view made here): inductor's FlexAttention reads its input
        self.caches = [(kv.k[i], kv.v[i]) for i in range(kv.k.shape[0])]
        mode = "reduce-overhead" if runner.device.type == "cuda" else None  # CUDA graphs on CUDA
        # Each bucket (and each step object of the process) is one more graph of the same function: past dynamo's
        # default of 8 it would stop compiling (and fail, fullgraph) rather than serve the eleventh bucket.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.fn = torch.compile(self.body, fullgraph=True, dynamic=False, mode=mode)
        self.compiled: set[int] = set()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a step of {n} tokens is past the largest bucket ({self.buckets[-1]})")

    def body(self, tokens, positions, rows, logit_rows, plans, caches):
        r = self.runner
        h = r.layers_forward(r.embed_tokens(tokens), positions, rows, None, plans,
                             LayerKernels(self.attend, self.proj, caches))
        return r.logits(h, logit_rows, self.project_logits)

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
        flex_plans = self.flex.plans(inp.segments, self.runner.windows, size)
        logits = self.fn(tokens, positions, rows, logit_rows, {w: p.block_mask for w, p in flex_plans.items()},
                         self.caches)
        self.compiled.add(size)
        return logits[:r]

    def warmup(self, blocks: list[int], progress=log.info) -> dict[int, float]:
        """Compile every bucket, one placeholder step each (segments of up to what `blocks` hold, all over them);
        seconds per bucket."""
        bs = self.runner.kv.block_size
        room = min(len(blocks) * bs, self.runner.kv.max_seq_len)
        table = tuple(blocks)
        took = {}
        for size in self.buckets:
            segments, start = [], 0
            while start < size:
                n = min(room, size - start)
                segments.append(Segment(table, start, n, n, bs))
                start += n
            t0 = time.monotonic()
            self.forward(ModelInput.build([1] * size, segments, list(range(size))))
            took[size] = time.monotonic() - t0
            progress("compiled the step for %d tokens in %.1fs (%d of %d buckets)", size, took[size],
                     len(took), len(self.buckets))
        return took
