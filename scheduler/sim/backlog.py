"""The simulated backlog: requests waiting to be popped, in numbered levels (lanes, MLFQ queues).

Each level is a heap by queue key (lowest pops first, as a Redis lane ZSET scored by time),
plus a heap by enqueue time for ages. A request that goes back to the backlog (hand-back,
swap-out, MLFQ promotion) gets a new ticket; entries with an old ticket are skipped.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class Backlog:
    """Waiting requests by level. ``keys`` order requests within a level; ``enqueue_s`` are
    the times ages count from: a level's age is its oldest request's wait."""

    def __init__(self, num_levels: int, keys: Sequence[float], enqueue_s: Sequence[float]) -> None:
        self._keys, self._enqueue_s = keys, enqueue_s
        self._by_key: list[list[tuple[float, int, int]]] = [[] for _ in range(num_levels)]
        self._by_age: list[list[tuple[float, int, int]]] = [[] for _ in range(num_levels)]
        self._ticket = [0] * len(keys)
        self._waiting = [False] * len(keys)
        self._level = [0] * len(keys)
        self._sizes = [0] * num_levels
        self.num_waiting = 0

    def push(self, level: int, idx: int) -> None:
        assert not self._waiting[idx], f"request {idx} is already waiting"
        self._ticket[idx] += 1
        entry = (self._keys[idx], idx, self._ticket[idx])
        heapq.heappush(self._by_key[level], entry)
        heapq.heappush(self._by_age[level], (self._enqueue_s[idx], idx, self._ticket[idx]))
        self._waiting[idx] = True
        self._level[idx] = level
        self._sizes[level] += 1
        self.num_waiting += 1

    def _head(self, heap: list[tuple[float, int, int]]) -> tuple[float, int, int] | None:
        while heap and not (self._waiting[heap[0][1]] and self._ticket[heap[0][1]] == heap[0][2]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, level: int) -> int | None:
        head = self._head(self._by_key[level])
        return None if head is None else head[1]

    def pop(self, level: int) -> int:
        head = self._head(self._by_key[level])
        assert head is not None, f"level {level} is empty"
        heapq.heappop(self._by_key[level])
        self.remove(head[1])
        return head[1]

    def remove(self, idx: int) -> None:
        """Take a waiting request out (its entries go stale), e.g. to push it at another level."""
        assert self._waiting[idx]
        self._waiting[idx] = False
        self._sizes[self._level[idx]] -= 1
        self.num_waiting -= 1

    def oldest(self, level: int) -> int | None:
        """The request of ``level`` that has waited longest (by the enqueue times given)."""
        head = self._head(self._by_age[level])
        return None if head is None else head[1]

    def level_sizes(self) -> list[int]:
        return list(self._sizes)

    def best_level(self) -> int | None:
        """The first non-empty level."""
        return next((level for level, heap in enumerate(self._by_key) if self._head(heap)), None)

    def oldest_wait_ms(self, now_s: float) -> dict[int, float]:
        """Age of each non-empty level's oldest request, ms."""
        ages: dict[int, float] = {}
        for level, heap in enumerate(self._by_age):
            head = self._head(heap)
            if head is not None:
                ages[level] = max(0.0, now_s - head[0]) * 1000.0
        return ages
