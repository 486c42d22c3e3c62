"""Today's block-validity ledger, kept as the oracle for the incremental one's property test.

This is :class:`store.engines.vllm.validity.BlockLedger` as it was before it became
incremental (commit 7893675): every step it walks every context block of every scheduled
request. It is slow by design and is never used by the product; the property test in
``test_validity_properties.py`` drives it and the product's ledger through the same random
steps and asserts that they answer alike. Do not "fix" it: its answers are the specification.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from store.engines.vllm.validity import Compute


class ReferenceLedger:
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
