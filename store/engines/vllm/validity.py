"""Which engine blocks hold the right KV: the rule that keeps KV computed over a failed load out of the store.

vLLM's prefix cache shares blocks between requests, and it registers a block as cached
when it is *allocated*, before its KV is written. So a request B can attend to blocks that
request A is loading in the same step, or (with async scheduling) that A loaded in the step
before, before the failure of that load is known to the scheduler. vLLM recovers its own
output (it recomputes what A failed to load, and rewinds B), but KV that B computed over
the garbage is in B's blocks, and write-back must never store it.

:class:`BlockLedger` is the worker's record of engine blocks whose contents are *not* the
KV of their tokens, kept across requests and steps. A block is valid when it was

- loaded, and its load succeeded; or
- computed in a step in which every block the computing request attended to (its blocks
  before the step's first token) was valid. A block another request writes in the same
  step counts as valid when that request's own computation is: vLLM writes every scheduled
  token's KV of a layer before that layer's attention reads any of it;
- copied (vLLM's copy-on-write of a cached tail block) from a valid block.

A block whose load failed is invalid, and so is every block computed over an invalid one,
until it is written again by a valid computation or load. Write-back stores a request's
block only if it and every block before it in the request's table are valid once the step
has run (:meth:`BlockLedger.valid_prefix`). The worker sees every load's outcome before the
step's forward, so the rule needs no word from the scheduler about failures: it holds for
sync and async scheduling, chunked prefill (a chunk attends to the chunks before it) and
preemption (a resumed request's table is replaced).

The ledger runs on vLLM's worker thread every step, so its work is bounded by what the step
schedules, not by context length or the number of running requests: a request's context is
checked from the first invalid position of its table (:class:`store.engines.vllm.tables.BlockTables`,
kept up to date only when a block's validity changes), and the in-step rule above is worked out
only for the blocks the step writes that another scheduled request holds. Steady decodes, the
most of a step at many running requests, come in bulk (:class:`store.engines.vllm.decodes.Decodes`)
and the rule runs only for those that could change a block's validity
(:func:`store.engines.vllm.decodes.unsettled`).

Pure: block ids and token counts, no vLLM, no torch.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from store.engines.vllm.decodes import Decodes, unsettled
from store.engines.vllm.tables import BlockTables, InvalidBlocks


class Compute(NamedTuple):
    """One request's part of a step, as the worker needs it to follow block validity.

    A named tuple, not a dataclass: the scheduler makes one per running request every step,
    and a tuple is made at C speed (:func:`store.engines.vllm.planning.computes_of`).

    Attributes:
        req_id: vLLM's request id.
        start: tokens of the request computed (or loaded) before this step: it attends to them.
        tokens: tokens it computes in this step (their KV is written into its blocks).
        new_blocks: engine blocks added to its table this step, in token order ...
        replace: ... or, when true, its whole table (a new or resumed request).
    """

    req_id: str
    start: int
    tokens: int
    new_blocks: tuple[int, ...] = ()
    replace: bool = False


#: One scheduled request's span in :meth:`BlockLedger.computed`: its id, its table, the positions it
#: writes (``first``, ``end``), how many blocks it attends to, and whether its write starts inside a block.
_Span = tuple[str, list[int], int, int, int, bool]


class BlockLedger:
    """The engine blocks whose contents are not their tokens' KV, and each request's table.

    Args:
        engine_block: vLLM's block size in tokens.

    Call, each step and in this order: :meth:`begin` (the step's tables, copies and ends),
    :meth:`loaded` for each load, :meth:`computed` after the forward, then
    :meth:`valid_prefix` for each save.

    Attributes:
        invalid: the invalid engine blocks (a live view: marking a block here marks it in every table).
        tables: request id -> its engine blocks (read only).
        blind: the ledger lost track of a step (one it could not follow): it vouches for no block from then on.
        visited: block entries touched so far, cumulative: per step it grows with the blocks the step
            schedules, writes, loads or copies, and with tables given, replaced or dropped, never with
            context length.
    """

    def __init__(self, engine_block: int) -> None:
        if engine_block < 1:
            raise ValueError(f"engine_block must be positive, got {engine_block}")
        self.engine_block = engine_block
        self._index = BlockTables()
        self._view = InvalidBlocks(self._index)
        self.blind = False
        self._computes: tuple[Compute, ...] = ()
        self._decodes: Decodes | None = None

    @property
    def invalid(self) -> InvalidBlocks:
        return self._view

    @invalid.setter
    def invalid(self, blocks: Iterable[int]) -> None:
        if blocks is self._view:  # ``led.invalid |= {...}`` assigns the view it changed in place
            return
        wanted = set(blocks)
        for b in [b for b in self._index.invalid if b not in wanted]:
            self._index.mark_valid(b)
        for b in wanted:
            self._index.mark_invalid(b)

    @property
    def tables(self) -> dict[str, list[int]]:
        return self._index.tables

    @property
    def visited(self) -> int:
        return self._index.visited

    def begin(self, computes: Sequence[Compute] | None, *, decodes: Decodes | None = None,
              copies: Iterable[tuple[int, int]] = (), ended: Iterable[str] = ()) -> None:
        """A new step: requests that ``ended`` (finished or preempted) leave, tables grow, blocks are copied.

        ``decodes`` are the step's steady decodes, after ``computes`` in the step's order (each as
        ``Compute(req_id, start, tokens)`` would be, at a fraction of the cost).
        ``copies`` are vLLM's ``(src, dst)`` block copies, made before the step's loads and forward.
        ``computes`` is ``None`` when the scheduler could not say what the step computes: from then on
        the ledger cannot vouch for any block (:attr:`blind`), and :meth:`valid_prefix` answers 0.
        """
        if computes is None:
            self.blind = True
            computes, decodes = (), None
        index = self._index
        for req_id in ended:
            index.drop(req_id)
        for src, dst in copies:
            if src in index.invalid:
                index.mark_invalid(dst)
            else:
                index.mark_valid(dst)
            index.visited += 1
        for c in computes:
            if c.replace:
                index.replace(c.req_id, c.new_blocks)
            elif c.new_blocks:
                index.extend(c.req_id, c.new_blocks)
        self._computes = tuple(computes)
        self._decodes = decodes

    def loaded(self, block_ids: Sequence[int], ok: int) -> None:
        """A load into ``block_ids`` wrote the first ``ok`` of them; the rest hold whatever was there."""
        index = self._index
        ok = max(ok, 0)
        for b in block_ids[:ok]:
            index.mark_valid(b)
        for b in block_ids[ok:]:
            index.mark_invalid(b)
        index.visited += len(block_ids)

    def computed(self) -> None:
        """The step's forward ran: the blocks it wrote are valid where their writer's context was.

        A request computed over valid KV when every block before its first token is valid, or is
        written in this step by other requests that computed over valid KV themselves (and, for a
        write that starts inside that block, the block was valid before). Requests that depend on
        each other's writes in a cycle are not trusted.
        """
        computes, self._computes = self._computes, ()
        decodes, self._decodes = self._decodes, None
        index = self._index
        B = self.engine_block
        visited = 0
        if decodes is not None:
            slow, visited = unsettled(index, B, decodes, computes)
            ids, starts, tokens = decodes
            computes += tuple(Compute(ids[i], starts[i], tokens[i]) for i in slow)
        tables, bad, invalid = index.tables, index.bad, index.invalid
        spans: list[_Span | None] = []
        ok: list[bool] = []
        writers: dict[int, int | list[int]] = {}  # block written this step -> who writes it
        shared: list[int] = []  # ... those another request holds, or several write
        redo: set[int] = set()  # computes whose writes may change a block's validity
        check: list[int] = []  # computes with an invalid block in their context
        for i, c in enumerate(computes):
            table = tables.get(c.req_id)
            start = c.start
            end = -(-(start + c.tokens) // B)
            if table is None or len(table) < end:  # a table the ledger never saw: which blocks it wrote is unknown
                self.blind = True
                spans.append(None)
                ok.append(False)
                continue
            first, attends = start // B, -(-start // B)
            spans.append((c.req_id, table, first, end, attends, start % B != 0))
            for pos in range(first, end):
                b = table[pos]
                w = writers.get(b)
                if w is None:
                    writers[b] = i
                    if index.shared(b):
                        shared.append(b)
                elif w != i:
                    if w.__class__ is int:
                        writers[b] = [w, i]  # type: ignore[list-item]
                        if not index.shared(b):
                            shared.append(b)
                        redo.add(w)  # type: ignore[arg-type]
                    elif i not in w:  # type: ignore[operator]
                        w.append(i)  # type: ignore[union-attr]
                    redo.add(i)
                if b in invalid:
                    redo.add(i)
            visited += end - first
            got = bad.get(c.req_id)
            if got is None or got[0] >= attends:
                ok.append(True)
            else:
                ok.append(False)
                check.append(i)
        deps, excused = self._cross(spans, writers, shared) if shared else ({}, {})
        for i in check:
            span = spans[i]
            assert span is not None
            got, attends, excuse = bad[span[0]], span[4], excused.get(i, {})
            good = True
            for pos in got:
                visited += 1
                if pos >= attends:
                    break
                if excuse.get(pos, True):  # not written by another request, or written from inside it
                    good = False
                    break
            ok[i] = good
        if deps:
            _trust(ok, deps)
        redo.update(i for i, good in enumerate(ok) if not good and spans[i] is not None)
        for i in sorted(redo):
            _, table, first, end, _, mid = spans[i]  # type: ignore[misc]
            good = ok[i]
            for pos in range(first, end):
                b = table[pos]
                if good and not (mid and pos == first and b in invalid):
                    index.mark_valid(b)
                else:
                    index.mark_invalid(b)
            visited += end - first
        index.visited += visited

    def _cross(self, spans: list[_Span | None], writers: dict[int, int | list[int]],
               shared: list[int]) -> tuple[dict[int, set[int]], dict[int, dict[int, bool]]]:
        """Who reads another request's writes this step: ``deps`` (reader -> its writers) and ``excused``
        (reader -> the context positions those writes cover -> whether a write starts inside that block,
        so the block's earlier tokens must have been valid already)."""
        by_req: dict[str, list[int]] = {}
        for i, span in enumerate(spans):
            if span is not None:
                by_req.setdefault(span[0], []).append(i)
        deps: dict[int, set[int]] = {}
        excused: dict[int, dict[int, bool]] = {}
        visited = 0
        for b in shared:
            w = writers[b]
            ws = (w,) if w.__class__ is int else w
            inside = {x for x in ws if spans[x][5] and spans[x][1][spans[x][2]] == b}  # type: ignore[index, union-attr]
            for req_id, pos in self._index.holders(b):
                visited += 1
                for i in by_req.get(req_id, ()):
                    if pos >= spans[i][4]:  # type: ignore[index]
                        continue  # not in its context
                    others = [x for x in ws if x != i]  # type: ignore[union-attr]
                    if others:
                        deps.setdefault(i, set()).update(others)
                        excused.setdefault(i, {})[pos] = any(x in inside for x in others)
        self._index.visited += visited
        return deps, excused

    def valid_prefix(self, req_id: str, blocks: int) -> int:
        """How many of the request's first ``blocks`` engine blocks are valid, counting from its first."""
        table = self.tables.get(req_id)
        if table is None or self.blind:
            return 0
        n = len(table)
        limit = max(0, min(n, blocks if blocks >= 0 else n + blocks))  # as many as table[:blocks] holds
        got = self._index.bad.get(req_id)
        return min(limit, got[0]) if got else limit

    def vouched(self, req_id: str, first: int, block_ids: Sequence[int], ratio: int) -> int:
        """How far a save of the request's kvwarm blocks from ``first`` (engine blocks ``block_ids``, ``ratio``
        per kvwarm block) holds valid KV: the first kvwarm block not vouched for (its end when all are).

        A plan whose blocks are not the request's as the ledger knows them is vouched for nowhere (0).
        """
        end = first + len(block_ids) // ratio
        table = self.tables.get(req_id)
        if table is None:
            return 0
        mine = table[first * ratio : end * ratio]  # the save's blocks only, not the table before them
        if len(mine) != len(block_ids) or mine != list(block_ids):
            return 0
        return min(end, self.valid_prefix(req_id, end * ratio) // ratio)

    def table(self, req_id: str) -> list[int] | None:
        """The request's engine blocks as the worker knows them (``None``: never seen)."""
        return self.tables.get(req_id)


def _trust(ok: list[bool], deps: dict[int, set[int]]) -> None:
    """Settle ``ok`` for the requests that read others' writes: trusted once every writer they read is.

    ``ok`` holds each request's own verdict (its context apart from those writes). A request in a
    cycle of such reads, or reading from one, is never settled, so never trusted: no order of
    computation makes its KV right.
    """
    pending: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, ws in deps.items():
        if ok[i]:
            ok[i] = False
            pending[i] = len(ws)
            for w in ws:
                readers.setdefault(w, []).append(i)
    ready = [w for w in readers if w not in pending and ok[w]]
    while ready:
        w = ready.pop()
        for i in readers.get(w, ()):
            pending[i] -= 1
            if not pending[i]:
                ok[i] = True
                ready.append(i)
