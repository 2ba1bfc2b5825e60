"""Dense projections y = x W^T: the plain reference and a CPU variant over oneDNN-prepacked weights.

A projection may hold several weights that read the same input (q, k and v; gate and up):
it returns one output per weight. The reference runs one `F.linear` per weight over the
model's own tensors; the onednn variant packs them side by side and runs one matmul,
returning views of its output.

At batch 1 a decode step is a chain of matrix-vector products, so its speed is how fast
the weights stream from memory. On CPU, `F.linear` goes to MKL's GEMV, which on this
kind of machine (an AMD EPYC) reads float32 weights at well under the memory bandwidth.
oneDNN dispatches by instruction set, and reading weights reordered once into its blocked
layout streams them at close to the copy bandwidth. The reorder costs a second copy of
the weights (the model keeps its own), which is the price of the switch.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def linear_reference(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> Linear:
    """Plain `F.linear` per weight over the model's own tensors (no copy)."""
    pairs = list(zip(weights, biases, strict=True))

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, w, b) for w, b in pairs)

    return project


# The row count oneDNN packs the weights for: a layout made for 1 row slows every step of several rows, and one row
# runs no slower on this one (docs/kernels.md).
PACK_ROWS = 64


class PackedLinear:
    """One oneDNN matmul over the weights stacked and reordered once into oneDNN's blocked layout (CPU only).

    Uses the packed-weight ops that PyTorch's own compiler emits for frozen CPU models
    (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`). Called, it runs that op; `traced` runs the same
    packed weights through `sled::packed_linear`, one opaque op that a compiled graph holds as it is (inductor takes
    no packed tensor as a graph input, and F.linear in its place lowers to MKL's matrix product, several times
    slower for a few rows on this kind of machine)."""

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]):
        if any(w.device.type != "cpu" for w in weights):
            raise ValueError(f"the onednn linear runs on CPU, not {weights[0].device}")
        if not torch.backends.mkldnn.is_available():
            raise ValueError("this torch build has no oneDNN (mkldnn)")
        self.sizes = [w.shape[0] for w in weights]
        with torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(stacked, PACK_ROWS)
            self.bias = None
            if any(b is not None for b in biases):
                self.bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                                       for w, b in zip(weights, biases, strict=True)])
        self.handle = f"linear-{next(_HANDLES)}"  # a string: dynamo would make an int that varies symbolic
        _PACKED[self.handle] = self

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._split(torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], ""))

    def traced(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._split(torch.ops.sled.packed_linear(x, self.handle))

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


_HANDLES = itertools.count()
_PACKED: weakref.WeakValueDictionary[str, PackedLinear] = weakref.WeakValueDictionary()  # live ones, by handle


@torch.library.custom_op("sled::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, handle: str) -> torch.Tensor:
    w = _PACKED[handle]
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, w.bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, handle: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(_PACKED[handle].sizes))


linear_onednn = PackedLinear
LINEAR: dict[str, Callable[..., Linear]] = {"reference": linear_reference, "onednn": linear_onednn}


@functools.cache  # the probe runs once per process and dtype
def onednn_works(dtype: torch.dtype) -> bool:
    """Whether the onednn linear runs here for `dtype` and agrees with the reference on a probe."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(3, 32, generator=gen).to(dtype)
        got = torch.cat(linear_onednn([w[:40], w[40:]], [b[:40], None])(x), dim=-1)
    except (RuntimeError, ValueError, AttributeError, NotImplementedError) as err:
        log.info("onednn linear unavailable (%s)", err)
        return False
    want = F.linear(x.float(), w.float(), torch.cat([b[:40], b.new_zeros(8)]).float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return got.shape == want.shape and bool(torch.allclose(got.float(), want, atol=tol, rtol=tol))


def resolve_linear(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` means onednn on a CPU where it works and the reference everywhere else."""
    if name != "auto":
        if name not in LINEAR:
            raise ValueError(f"linear must be auto, {' or '.join(LINEAR)}, got {name!r}")
        return name
    if device.type == "cpu" and onednn_works(dtype):
        return "onednn"
    return "reference"
