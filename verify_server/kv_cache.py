"""Preallocated per-session KV cache: one slot per session, rollback by length."""

from __future__ import annotations

import torch

from .errors import exhausted


class KVCache:
    """Keys and values of every layer for `num_slots` sessions of up to `max_seq_len` tokens.

    A session owns one slot; how many positions of it are valid is the session's
    `kv_len`, so rolling back rejected draft tokens is setting a number.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # torch.empty: pages are only touched as sessions fill them.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, max_seq_len, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._free = list(range(num_slots - 1, -1, -1))

    @classmethod
    def create(cls, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        """A cache, or a ValueError that says what it needed where the device's memory cannot hold it."""
        try:
            return cls(num_layers, num_slots, num_kv_heads, max_seq_len, head_dim, dtype, device)
        except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
            size = 2 * num_layers * num_slots * num_kv_heads * max_seq_len * head_dim * dtype.itemsize
            raise ValueError(f"the KV cache of {num_slots} sessions of {max_seq_len} tokens ({size / 2**30:.1f} GiB) "
                             f"does not fit in {device}'s memory: lower max_sessions or max_seq_len") from None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise exhausted(
                f"KV cache full: all {self.num_slots} session slots are in use; retry later or raise max_sessions"
            )
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()
