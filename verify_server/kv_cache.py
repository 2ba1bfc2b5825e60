"""The paged KV pool: keys and values in blocks of `block_size` tokens, held by sessions through block tables.

A session's position p lives at row `table[p // block_size] * block_size + p % block_size` of the pool. Rolling
back is a length change that frees the whole blocks past the new length. Full blocks of committed tokens are
published under a hash of every token up to their end (vLLM's automatic prefix caching), so a later session whose
context starts with the same tokens takes them by reference instead of prefilling them. A block no session holds
keeps its prefix, up to `prefix_cache_tokens` tokens of such blocks, until the pool needs it; 0 turns sharing off.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kernels.flex import PoolShape

from .errors import exhausted


def chain_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """One hash per full block of `tokens`, each over its block's tokens and the hash before it: equal hashes
    mean equal prefixes, so equal keys and values (causal attention, absolute positions)."""
    out = []
    ids = np.asarray(tokens, dtype=np.int64)
    for i in range(len(ids) // block_size):
        parent = hashlib.sha256(parent + ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(parent)
    return out


class BlockPool:
    """Which blocks are free, held (with reference counts) and published under a prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache_tokens: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_cached = prefix_cache_tokens // block_size  # idle blocks kept for their prefix
        self.refs = [0] * num_blocks
        self._shared = 0  # blocks whose reference count is above 1, kept as counts change (read every step)
        self._empty = list(range(num_blocks - 1, -1, -1))  # free, holding nothing worth keeping
        self._idle: OrderedDict[int, None] = OrderedDict()  # free, published: least recently freed first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one session."""
        return self._shared

    @property
    def num_cached(self) -> int:
        """Blocks published under a prefix hash, held or idle."""
        return len(self._hash_of)

    def describe(self) -> str:
        return f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_blocks * self.block_size} tokens)"

    def allocate(self, n: int) -> list[int]:
        """n blocks, all or none: an idle published block is reused (and unpublished) only when no empty one is
        left."""
        if n > self.num_free:
            raise exhausted(f"KV pool exhausted: {n} more blocks needed, {self.num_free} free of the pool's "
                            f"{self.describe()}; retry later, or raise kv_cache_tokens")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Let go of one reference to each block."""
        for block in blocks:
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 1:
                self._shared -= 1
            if self.refs[block]:
                continue
            if block in self._hash_of and self.max_cached:
                self._idle[block] = None
                while len(self._idle) > self.max_cached:
                    self._unpublish(self._idle.popitem(last=False)[0])
            else:
                self._unpublish(block)

    def _unpublish(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]
        self._empty.append(block)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The published blocks of the longest run of `hashes` from the first, each now held once more."""
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._idle[block]
            self.refs[block] += 1
            if self.refs[block] == 2:
                self._shared += 1
            out.append(block)
        return out

    def publish(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Publish held full blocks under their prefix hashes; a hash already published keeps its block. With
        prefix_cache_tokens 0 nothing is published: prefix sharing is off."""
        if not self.max_cached:
            return
        for block, h in zip(blocks, hashes):
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h


@dataclass(frozen=True)
class KVLayout:
    """What one token's keys and values are made of, in every layer: KV heads of head_dim, in dtype on device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class KVCache:
    """Keys and values of every layer in one pool of blocks.

    k and v are [layers, kv_heads, pool_rows, head_dim]: a KV head's rows are the pool's token rows, so a session
    whose blocks are consecutive reads its keys as one view. How many positions of a session are valid is its
    `kv_len`. One block past the pool's is no session's: the compiled step writes its padding tokens there."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, max_seq_len: int,
                 prefix_cache_tokens: int = 0):
        shape = (layout.num_layers, layout.num_kv_heads, (num_blocks + 1) * block_size, layout.head_dim)
        # torch.empty: pages are only touched as sessions fill them.
        self.k = torch.empty(shape, dtype=layout.dtype, device=layout.device)
        self.v = torch.empty(shape, dtype=layout.dtype, device=layout.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_seq_len = max_seq_len
        self.scratch_row = num_blocks * block_size
        self.blocks = BlockPool(num_blocks, block_size, prefix_cache_tokens)
        # Zero each block handed out: for kernels that read whole blocks (FlexAttention), where a row past a
        # session's length must be finite (0 x NaN is NaN even under a masked score).
        self.zero_blocks = False

    @classmethod
    def create(cls, layout: KVLayout, num_tokens: int, block_size: int, max_seq_len: int,
               prefix_cache_tokens: int = 0) -> KVCache:
        """A pool of at least `num_tokens` tokens, or a ValueError that says what it needed where the device's
        memory cannot hold it."""
        num_blocks = -(-num_tokens // block_size)
        try:
            return cls(layout, num_blocks, block_size, max_seq_len, prefix_cache_tokens)
        except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
            size = num_blocks * block_size * layout.bytes_per_token()
            raise ValueError(f"the KV pool of {num_blocks * block_size} tokens ({size / 2**30:.1f} GiB) does not "
                             f"fit in {layout.device}'s memory: lower kv_cache_tokens") from None

    def pool_shape(self) -> PoolShape:
        """The pool as FlexAttention reads it (kernels.flex), the scratch block included."""
        return PoolShape(self.num_blocks + 1, self.block_size, self.max_seq_len, self.k.device)

    def bytes_per_token(self) -> int:
        layers, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def grow(self, table: list[int], length: int) -> None:
        """Blocks appended to `table` until it holds `length` positions; none appended where the pool cannot."""
        need = self.blocks_for(length) - len(table)
        if need > 0:
            new = self.blocks.allocate(need)
            if self.zero_blocks:
                rows = (torch.tensor(new)[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
                self.k[:, :, rows.to(self.k.device)] = 0
                self.v[:, :, rows.to(self.k.device)] = 0
            table.extend(new)

    def truncate(self, table: list[int], length: int) -> None:
        """The whole blocks past `length` positions freed (a rollback)."""
        keep = self.blocks_for(length)
        if len(table) > keep:
            self.blocks.free(table[keep:])
            del table[keep:]

    def release(self, table: list[int]) -> None:
        self.blocks.free(table)
        table.clear()

    def rows(self, table: list[int], start: int, stop: int) -> list[int]:
        """The pool rows of positions [start, stop) of a session with block table `table`."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]
