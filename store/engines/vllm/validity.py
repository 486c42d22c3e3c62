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

Pure: block ids and token counts, no vLLM, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Compute:
    """One request's part of a step, as the worker needs it to follow block validity.

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


class BlockLedger:
    """The engine blocks whose contents are not their tokens' KV, and each request's table.

    Args:
        engine_block: vLLM's block size in tokens.

    Call, each step and in this order: :meth:`begin` (the step's tables, copies and ends),
    :meth:`loaded` for each load, :meth:`computed` after the forward, then
    :meth:`valid_prefix` for each save.
    """

    def __init__(self, engine_block: int) -> None:
        if engine_block < 1:
            raise ValueError(f"engine_block must be positive, got {engine_block}")
        self.engine_block = engine_block
        self.invalid: set[int] = set()
        self.tables: dict[str, list[int]] = {}
        self.blind = False
        self._computes: tuple[Compute, ...] = ()

    def begin(self, computes: Sequence[Compute] | None, *, copies: Iterable[tuple[int, int]] = (),
              ended: Iterable[str] = ()) -> None:
        """A new step: requests that ``ended`` (finished or preempted) leave, tables grow, blocks are copied.

        ``copies`` are vLLM's ``(src, dst)`` block copies, made before the step's loads and forward.
        ``computes`` is ``None`` when the scheduler could not say what the step computes: from then on
        the ledger cannot vouch for any block (:attr:`blind`), and :meth:`valid_prefix` answers 0.
        """
        if computes is None:
            self.blind = True
            computes = ()
        for req_id in ended:
            self.tables.pop(req_id, None)
        for src, dst in copies:
            if src in self.invalid:
                self.invalid.add(dst)
            else:
                self.invalid.discard(dst)
        for c in computes:
            if c.replace:
                self.tables[c.req_id] = list(c.new_blocks)
            elif c.new_blocks:
                self.tables.setdefault(c.req_id, []).extend(c.new_blocks)
        self._computes = tuple(computes)

    def loaded(self, block_ids: Sequence[int], ok: int) -> None:
        """A load into ``block_ids`` wrote the first ``ok`` of them; the rest hold whatever was there."""
        for i, b in enumerate(block_ids):
            if i < ok:
                self.invalid.discard(b)
            else:
                self.invalid.add(b)

    def _span(self, c: Compute) -> tuple[list[int], list[int], bool] | None:
        """``c``'s context blocks, the blocks it writes, and whether its write starts inside a block."""
        table = self.tables.get(c.req_id)
        B = self.engine_block
        end = c.start + c.tokens
        if table is None or len(table) < -(-end // B):
            return None
        return table[: -(-c.start // B)], table[c.start // B : -(-end // B)], c.start % B != 0

    def computed(self) -> None:
        """The step's forward ran: the blocks it wrote are valid where their writer's context was."""
        spans = {i: self._span(c) for i, c in enumerate(self._computes)}
        writer: dict[int, list[int]] = {}
        for i, span in spans.items():
            for b in span[1] if span is not None else ():
                writer.setdefault(b, []).append(i)
        clean: dict[int, bool] = {}

        def is_clean(i: int, visiting: frozenset[int]) -> bool:
            if i in clean:
                return clean[i]
            span = spans[i]
            ok = span is not None
            for b in span[0] if span is not None else ():
                if not ok:
                    break
                others = [w for w in writer.get(b, ()) if w != i]
                if not others:
                    ok = b not in self.invalid
                    continue
                # written this step by another request: valid as far as that request computed over valid KV
                # (a write that starts inside the block keeps the block's earlier tokens as they were)
                ok = all(w not in visiting and is_clean(w, visiting | {i}) for w in others)
                if ok and any(spans[w][2] and spans[w][1][0] == b for w in others):  # type: ignore[index]
                    ok = b not in self.invalid
            clean[i] = ok
            return ok

        result = {i: is_clean(i, frozenset()) for i in spans}
        for i, span in spans.items():
            if span is None:  # a table the ledger never saw: which blocks it wrote is unknown
                self.blind = True
                continue
            _, written, mid = span
            for j, b in enumerate(written):
                keep_old = mid and j == 0
                if result[i] and not (keep_old and b in self.invalid):
                    self.invalid.discard(b)
                else:
                    self.invalid.add(b)
        self._computes = ()

    def valid_prefix(self, req_id: str, blocks: int) -> int:
        """How many of the request's first ``blocks`` engine blocks are valid, counting from its first."""
        table = self.tables.get(req_id)
        if table is None or self.blind:
            return 0
        n = 0
        for b in table[:blocks]:
            if b in self.invalid:
                break
            n += 1
        return n

    def vouched(self, req_id: str, first: int, block_ids: Sequence[int], ratio: int) -> int:
        """How far a save of the request's kvwarm blocks from ``first`` (engine blocks ``block_ids``, ``ratio``
        per kvwarm block) holds valid KV: the first kvwarm block not vouched for (its end when all are).

        A plan whose blocks are not the request's as the ledger knows them is vouched for nowhere (0).
        """
        end = first + len(block_ids) // ratio
        table = self.tables.get(req_id)
        if table is None or tuple(table[first * ratio : end * ratio]) != tuple(block_ids):
            return 0
        return min(end, self.valid_prefix(req_id, end * ratio) // ratio)

    def table(self, req_id: str) -> list[int] | None:
        """The request's engine blocks as the worker knows them (``None``: never seen)."""
        return self.tables.get(req_id)
