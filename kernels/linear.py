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
import logging
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


def linear_onednn(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> Linear:
    """One oneDNN matmul over the weights stacked and reordered once into oneDNN's blocked layout (CPU only).

    Uses the packed-weight ops that PyTorch's own compiler emits for frozen CPU models
    (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`)."""
    if any(w.device.type != "cpu" for w in weights):
        raise ValueError(f"the onednn linear runs on CPU, not {weights[0].device}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("this torch build has no oneDNN (mkldnn)")
    sizes = [w.shape[0] for w in weights]
    with torch.no_grad():
        stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(stacked, PACK_ROWS)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases, strict=True)])
    del stacked

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return y.split(sizes, dim=-1) if len(sizes) > 1 else (y,)

    return project


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
