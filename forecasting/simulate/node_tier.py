"""kvwarm's node tier as the replay models it: full blocks, evicting the lowest plan priority, then LRU."""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable


class NodeTier:
    """Full blocks up to ``capacity``, evicting the lowest key ``(priority, order)`` first.

    :meth:`put` gives each block its key. The replay's keys are ``(plan priority, access
    order)``, what the node's pool does (plan priority, then least recently used; blocks no
    plan names have priority 0), or, for the ceiling, ``(-next use, -depth)`` (Belady).
    Priority-0 blocks sit in access order (an ordered dict: plain LRU); the others in a
    heap with lazy deletion.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, float] = OrderedDict()
        self._key: dict[int, tuple[float, float]] = {}
        self._heap: list[tuple[float, float, int]] = []

    def __len__(self) -> int:
        return len(self._lru) + len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._lru or block in self._key

    def blocks(self) -> list[int]:
        """Held blocks, next to be evicted first."""
        keyed = sorted((k[0], k[1], b) for b, k in self._key.items())
        low = [b for p, _, b in keyed if p < 0]
        return low + list(self._lru) + [b for p, _, b in keyed if p >= 0]

    def clear(self) -> None:
        self._lru.clear()
        self._key.clear()
        self._heap.clear()

    def copy(self) -> NodeTier:
        out = NodeTier(self.capacity)
        out._lru, out._key, out._heap = self._lru.copy(), dict(self._key), list(self._heap)
        return out

    def put(self, blocks: Iterable[int], keys: Iterable[tuple[float, float]]) -> None:
        lru, key, heap = self._lru, self._key, self._heap
        for b, k in zip(blocks, keys):
            if k[0] == 0.0:
                key.pop(b, None)
                lru[b] = k[1]
                lru.move_to_end(b)
            else:
                lru.pop(b, None)
                key[b] = k
                heapq.heappush(heap, (k[0], k[1], b))
        while len(lru) + len(key) > self.capacity:
            if heap and heap[0][0] < 0:  # below priority 0: Belady's keys, or a landed copy it does not want
                self._pop_heap()
            elif lru:
                lru.popitem(last=False)
            else:
                self._pop_heap()
        if len(heap) > 4 * self.capacity + 1024:
            self.rekey(lambda b, k: k)

    def _pop_heap(self) -> None:
        while self._heap:
            p, s, b = heapq.heappop(self._heap)
            if self._key.get(b) == (p, s):
                del self._key[b]
                return

    def rekey(self, new_key) -> None:  # noqa: ANN001 - (block, old key) -> new key
        """Give every held block ``new_key(block, old_key)`` (a new plan's priorities)."""
        old = [(b, (0.0, s)) for b, s in self._lru.items()] + list(self._key.items())
        self.clear()
        keys = sorted(((new_key(b, k), b) for b, k in old), key=lambda kb: kb[0][1])
        cap, self.capacity = self.capacity, len(keys) + 1
        self.put([b for _, b in keys], [k for k, _ in keys])
        self.capacity = cap
