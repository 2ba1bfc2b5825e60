"""Prompt lookup: continue the latest earlier occurrence of the context's last n-gram. Needs no model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sampling import SamplingParams
from .base import DrafterOptions, Proposal


def lookup(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # starts whose n-gram has a following token
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, options: DrafterOptions):
        if not 1 <= options.ngram_min <= options.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {options.ngram_min}, {options.ngram_max}")
        self.n_max, self.n_min = options.ngram_max, options.ngram_min

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        pass

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        return Proposal(lookup(context, k, self.n_max, self.n_min) if k > 0 else [])

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        pass

    def close(self) -> None:
        pass
