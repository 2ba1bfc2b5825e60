"""KV of prompt prefixes that different sessions share (a system prompt, a few-shot header).

A new session whose context starts with a kept prefix gets that prefix's keys and values copied
into its slot at open, and prefills only the rest. Keys and values at positions below L depend
only on the first L tokens (causal attention, absolute positions), so a copy is what a fresh
prefill would write, up to the float rounding of a different batch shape.

An entry is made from what two different prompts share: when a session's prompt is prefilled,
the longest common prefix with a recent, different prompt is kept if it is at least
`min_tokens` long. A prompt repeated whole is never kept whole: this caches shared headers, not
whole requests. Entries are evicted least recently used first, under a budget in tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVCache


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class Entry:
    tokens: np.ndarray  # [length] int64
    k: torch.Tensor  # [layers, kv_heads, length, head_dim]
    v: torch.Tensor


class PrefixCache:
    def __init__(self, kv: KVCache, max_tokens: int, min_tokens: int = 16, recent: int = 64):
        self.kv = kv
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU order, oldest first
        self._recent: deque[np.ndarray] = deque(maxlen=recent)  # prompts seen lately, for new entries

    @property
    def tokens(self) -> int:
        """Tokens held over all entries."""
        return sum(len(e.tokens) for e in self._entries.values())

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, ids: np.ndarray) -> tuple[Entry | None, int]:
        best, length = None, 0
        for entry in self._entries.values():
            n = common_prefix(entry.tokens, ids)
            if n > length:
                best, length = entry, n
        return best, length

    def load(self, slot: int, context: list[int]) -> int:
        """Copy the longest kept prefix of `context[:-1]` (the last token is computed with the first
        verification) into `slot`; return how many positions it filled."""
        if not self.enabled or len(context) < 2:
            return 0
        entry, n = self._best(np.asarray(context[:-1], dtype=np.int64))
        if entry is None or n < self.min_tokens:
            return 0
        self.kv.k[:, slot, :, :n] = entry.k[:, :, :n]
        self.kv.v[:, slot, :, :n] = entry.v[:, :, :n]
        self._entries.move_to_end(entry.tokens.tobytes())
        return n

    def observe(self, slot: int, prompt: list[int], kv_len: int) -> None:
        """A session's prompt is in `slot` (its first `kv_len` positions): keep what it shares with a
        recent, different prompt."""
        if not self.enabled:
            return
        ids = np.asarray(prompt, dtype=np.int64)
        shared = 0
        for other in self._recent:
            if not np.array_equal(other, ids):
                shared = max(shared, common_prefix(other, ids))
        self._recent.append(ids)
        shared = min(shared, kv_len, self.max_tokens)
        if shared < self.min_tokens:
            return
        _, held = self._best(ids[:shared])
        if held >= shared:
            return
        key = ids[:shared]
        # A kept prefix of the new one is now redundant.
        for k, entry in list(self._entries.items()):
            if len(entry.tokens) <= shared and common_prefix(entry.tokens, key) == len(entry.tokens):
                del self._entries[k]
        while self.tokens + shared > self.max_tokens:
            self._entries.popitem(last=False)
        self._entries[key.tobytes()] = Entry(key.copy(), self.kv.k[:, slot, :, :shared].clone(),
                                             self.kv.v[:, slot, :, :shared].clone())
