"""Cacheback (Ma, Gim, Zhong, EMNLP 2025): drafting with nothing but LRU caches of token n-grams.

Each table maps a leader (the last `n` tokens) to a short most-recent-first list of followers (the
tuples of tokens that came next), and forgets the least recently used leaders past its capacity.
Every committed chunk updates the tables; a draft is built by chained look-ups: the follower of the
current leader is appended, the leader moves to the new tail, and so on until k tokens or a miss.
Longer leaders are tried first. The tables outlive a session, so a device warms to its domain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..sampling import SamplingParams
from .base import DrafterOptions, Proposal


class LRUTable:
    def __init__(self, capacity: int, followers: int):
        self.capacity = capacity
        self.followers = followers
        self._rows: OrderedDict[tuple[int, ...], list[tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, leader: tuple[int, ...], follower: tuple[int, ...]) -> None:
        row = self._rows.pop(leader, [])
        if follower in row:
            row.remove(follower)
        row.insert(0, follower)
        del row[self.followers:]
        self._rows[leader] = row
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def get(self, leader: tuple[int, ...]) -> tuple[int, ...] | None:
        row = self._rows.get(leader)
        if not row:
            return None
        self._rows.move_to_end(leader)
        return row[0]


class CachebackDrafter:
    name = "cacheback"

    def __init__(self, options: DrafterOptions, leader_lengths=(3, 2, 1), follower_length: int = 3,
                 capacity: int = 8192, followers: int = 4):
        self.follower_length = follower_length
        self.tables = {n: LRUTable(capacity, followers) for n in leader_lengths}
        self._seen = 0  # tokens of the current context already folded into the tables
        self._context_id: list[int] = []

    def ingest(self, tokens: list[int], start: int = 0) -> None:
        """Record every (leader, follower) pair whose follower ends at or after `start`."""
        f = self.follower_length
        for n, table in self.tables.items():
            first = max(n, start - f + 1)
            for i in range(first, len(tokens) - f + 1):
                table.put(tuple(tokens[i - n : i]), tuple(tokens[i : i + f]))

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        self._seen = 0
        self.accept(context)

    def accept(self, context: list[int], ahead: Sequence[int] = ()) -> None:
        # Only committed tokens are learned: `ahead` is not verified yet.
        if len(context) > self._seen:
            self.ingest(context, self._seen)
            self._seen = len(context)

    def propose(self, context: list[int], k: int, stop=None) -> Proposal:
        draft: list[int] = []
        tail = list(context[-max(self.tables):])
        while len(draft) < k:
            follower = None
            for n in sorted(self.tables, reverse=True):
                if len(tail) >= n:
                    follower = self.tables[n].get(tuple(tail[-n:]))
                    if follower is not None:
                        break
            if follower is None:
                break
            draft.extend(follower)
            tail.extend(follower)
        return Proposal(draft[:k])

    def close(self) -> None:
        pass
