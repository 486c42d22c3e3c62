"""The worker's block tables, indexed both ways: each request's engine blocks, who holds each block, and
where in each table the invalid ones sit.

:class:`store.engines.vllm.validity.BlockLedger` asks, every step, whether a request's context holds
an invalid block. Walking the context to find out costs O(context) per request per step; this index
answers it from the first invalid position of the request's table, kept up to date only when a
block's validity *changes* (a failed load, a write over bad KV, a recompute): then every table that
holds the block is told, through the reverse index ``block -> (request, position)``. A table costs
O(its length) once, when it is given, replaced or dropped, and O(new blocks) when it grows.

Pure: block ids and request ids, no vLLM, no torch.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, MutableSet, Sequence

#: One place a block is held: ``(request id, position in its table)``.
Holder = tuple[str, int]


class BlockTables:
    """Each request's table of engine blocks, the invalid blocks, and the positions of those in every table.

    Attributes:
        tables: request id -> its engine blocks in token order (read it; change it only through the methods).
        invalid: the engine blocks whose contents are not their tokens' KV.
        bad: request id -> the positions in its table of invalid blocks, ascending (absent: none).
        multi: the blocks held in more than one place (:meth:`shared`), as a set: a step's writes are checked
            against it in bulk (:mod:`store.engines.vllm.decodes`).
        visited: how many block entries the index has touched, cumulative (what its work scales with).
    """

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.invalid: set[int] = set()
        self.bad: dict[str, list[int]] = {}
        self.multi: set[int] = set()
        self.visited = 0
        # block -> its one holder (the usual case, kept as a bare tuple) or a set of several
        self._holders: dict[int, Holder | set[Holder]] = {}

    def holders(self, block: int) -> Iterable[Holder]:
        """Where ``block`` is held: ``(request, position)`` for every table that has it."""
        got = self._holders.get(block)
        if got is None:
            return ()
        return (got,) if got.__class__ is tuple else got  # type: ignore[return-value]

    def shared(self, block: int) -> bool:
        """Whether ``block`` is held in more than one place."""
        return block in self.multi

    def replace(self, req_id: str, blocks: Sequence[int]) -> None:
        """``req_id``'s whole table is now ``blocks`` (a new or resumed request)."""
        self.drop(req_id)
        self.extend(req_id, blocks)

    def extend(self, req_id: str, blocks: Sequence[int]) -> None:
        """``blocks`` are added to the end of ``req_id``'s table (made empty first if it has none)."""
        table = self.tables.get(req_id)
        if table is None:
            table = self.tables[req_id] = []
        first = len(table)
        table.extend(blocks)
        holders, invalid = self._holders, self.invalid
        bad = None
        for pos in range(first, len(table)):
            b = table[pos]
            held = (req_id, pos)
            got = holders.get(b)
            if got is None:
                holders[b] = held
            elif got.__class__ is tuple:
                holders[b] = {got, held}  # type: ignore[arg-type]
                self.multi.add(b)
            else:
                got.add(held)  # type: ignore[union-attr]
            if b in invalid:
                if bad is None:
                    bad = self.bad.setdefault(req_id, [])
                bad.append(pos)  # positions only grow here: the list stays sorted
        self.visited += len(table) - first

    def drop(self, req_id: str) -> None:
        """``req_id`` left (finished, preempted, or about to get a new table): forget its table."""
        table = self.tables.pop(req_id, None)
        if table is None:
            return
        holders = self._holders
        for pos, b in enumerate(table):
            held = (req_id, pos)
            got = holders[b]
            if got.__class__ is tuple:
                del holders[b]
            else:
                got.discard(held)  # type: ignore[union-attr]
                if len(got) == 1:  # type: ignore[arg-type]
                    holders[b] = next(iter(got))  # type: ignore[call-overload]
                    self.multi.discard(b)
        self.bad.pop(req_id, None)
        self.visited += len(table)

    def mark_invalid(self, block: int) -> None:
        """``block`` no longer holds its tokens' KV; every table holding it learns where."""
        if block in self.invalid:
            return
        self.invalid.add(block)
        bad = self.bad
        for req_id, pos in self.holders(block):
            got = bad.get(req_id)
            if got is None:
                bad[req_id] = [pos]
            else:
                insort(got, pos)
            self.visited += 1

    def mark_valid(self, block: int) -> None:
        """``block`` holds its tokens' KV again."""
        if block not in self.invalid:
            return
        self.invalid.discard(block)
        bad = self.bad
        for req_id, pos in self.holders(block):
            got = bad[req_id]
            del got[bisect_left(got, pos)]
            if not got:
                del bad[req_id]
            self.visited += 1

    def first_invalid(self, req_id: str) -> int:
        """The position of the first invalid block in ``req_id``'s table (its length when none); the table must exist."""
        got = self.bad.get(req_id)
        return got[0] if got else len(self.tables[req_id])


class InvalidBlocks(MutableSet[int]):
    """A live, writable view of :attr:`BlockTables.invalid`: changing it keeps the index in step.

    It is what :attr:`store.engines.vllm.validity.BlockLedger.invalid` gives, so that a test (or a
    debugger) can mark a block bad by hand as it could when the ledger held a plain set.
    """

    def __init__(self, tables: BlockTables) -> None:
        self._tables = tables

    def __contains__(self, block: object) -> bool:
        return block in self._tables.invalid

    def __iter__(self) -> Iterator[int]:
        return iter(self._tables.invalid)

    def __len__(self) -> int:
        return len(self._tables.invalid)

    def add(self, value: int) -> None:
        self._tables.mark_invalid(value)

    def discard(self, value: int) -> None:
        self._tables.mark_valid(value)

    def __repr__(self) -> str:
        return f"InvalidBlocks({sorted(self._tables.invalid)!r})"
