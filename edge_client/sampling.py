"""The drafter's own sampling distribution: top-K renormalized, exactly what is sent as q."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sled.v1.limits import greedy_temperature


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return greedy_temperature(self.temperature)  # as the server judges it


def sparse_distribution(
    logits: np.ndarray,  # [vocab] float32
    temperature: float,
    top_k: int,
    top_p: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:  # ids [K] int64, probs [K] float32 summing to 1
    """softmax(logits / temperature) over the top_k tokens, then the top_p cut, renormalized."""
    k = min(top_k, logits.shape[0])
    ids = np.argpartition(-logits, k - 1)[:k]
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    z = logits[ids].astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        keep = (np.cumsum(p) - p) < top_p
        ids, p = ids[keep], p[keep] / p[keep].sum()
    probs = p.astype(np.float32)
    probs /= probs.sum(dtype=np.float32)
    return ids.astype(np.int64), probs


def sample(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw from exactly the float32 distribution `probs` over `ids`."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])
