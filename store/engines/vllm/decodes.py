"""Steady decodes: the requests of a step that only compute their next tokens, told and checked in bulk.

At hundreds of running requests nearly every request of a step is a steady decode: running (not
new, not resumed), given no new engine block, computing its next token into the block its table
already ends in. The scheduler sends them column by column (:class:`Decodes`: no object per
request), and the worker's :class:`store.engines.vllm.validity.BlockLedger` settles most of them
without a Python step per request. A decode

- whose table holds no invalid block (so its context is valid and the block it writes is too),
- that writes one block, which no other table holds (nobody else writes it or reads it), and
- whose table holds no block that another request writes this step (nobody's write is in its context)

cannot change any block's validity: the exact rule would find its context valid and leave the
valid block it writes valid. :func:`unsettled` finds the others with set and map operations at C
speed, and they go through the exact rule with the step's other requests. Its Python work is
bounded by the blocks the step writes and shares, not by the running requests (but for one
comprehension that picks out the decodes of several tokens over a block's end, when there are
any), except in a step the ledger cannot follow (a table it lacks or that is too short: it goes
blind), when each decode is looked at in turn.

Pure: block ids and request ids, no vLLM, no torch.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import count, repeat
from operator import add, floordiv, getitem, sub
from typing import NamedTuple

from store.engines.vllm.tables import BlockTables


class Decodes(NamedTuple):
    """The step's steady decodes, column by column (what the scheduler sends; picklable).

    Each is one request's part of a step with no new block and its table kept, as a
    :class:`store.engines.vllm.validity.Compute` ``(req_id, start, tokens)`` would say it.

    Attributes:
        req_ids: vLLM's request ids.
        starts: tokens of each computed before the step (it attends to them).
        tokens: tokens each computes in the step.
    """

    req_ids: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()


#: A step without steady decodes.
NO_DECODES = Decodes()


def unsettled(index: BlockTables, engine_block: int, decodes: Decodes,
              others: Iterable[tuple[str, int, int]]) -> tuple[list[int], int]:
    """The decodes (their positions, ascending) that could change a block's validity, and the block entries
    the rest write (what the exact rule would have counted as visited for them).

    ``others`` are the step's other requests, ``(req_id, start, tokens, ...)`` each (their tables already
    as :meth:`BlockLedger.begin` left them). Every decode is unsettled when a request is told twice.
    """
    ids, starts, tokens = decodes
    n = len(ids)
    if not n:
        return [], 0
    B = engine_block
    tables, multi = index.tables, index.multi
    others = list(others)
    names = set(ids)
    if len(names) != n or any(c[0] in names for c in others):
        return list(range(n)), 0
    tabs = list(map(tables.get, ids))
    firsts = list(map(floordiv, starts, repeat(B)))
    slow: set[int] = set()
    shared: set[int] = set()  # blocks written this step that more than one table holds
    written: list[int | None] = []
    odd: list[int] = []  # decodes that write other than one block (several tokens over a block's end)
    if tokens.count(1) != n:  # the last block each writes: (start + tokens - 1) // B, its end one past that
        lasts = list(map(floordiv, map(add, starts, map(sub, tokens, repeat(1))), repeat(B)))
        if lasts != firsts:
            odd = [i for i, first, last in zip(count(), firsts, lasts) if first != last]
    try:  # the usual step: every table known and long enough
        written = list(map(getitem, tabs, firsts))  # type: ignore[arg-type]
    except (TypeError, IndexError):  # a table the ledger lacks (None), or one too short
        pass
    if len(written) == n:
        for i in odd:  # the exact rule, for the shared blocks they write too (none when blind)
            first, end, table = firsts[i], lasts[i] + 1, tabs[i]
            slow.add(i)
            written[i] = None
            if len(table) >= end and multi:  # type: ignore[arg-type]
                shared.update(multi.intersection(table[first:end]))  # type: ignore[index]
    else:
        written = []  # a blind step: each decode on its own
        for i, (table, start, first) in enumerate(zip(tabs, starts, firsts)):
            end = -(-(start + tokens[i]) // B)
            if table is None or len(table) < end or end - first != 1:
                slow.add(i)  # blind, or a write over several blocks (or none): the exact rule
                written.append(None)
                if table is not None and len(table) >= end and multi:
                    shared.update(multi.intersection(table[first:end]))
            else:
                written.append(table[first])
    at: dict[str, int] | None = None
    bad = index.bad
    if not bad.keys().isdisjoint(names):
        at = dict(zip(ids, range(n)))
        slow.update(map(at.__getitem__, bad.keys() & names))
    if multi:  # the shared blocks the decodes write ...
        shared.update(multi.intersection(written))
    for c in others:  # ... and those the step's other requests write
        table = tables.get(c[0])
        if table is not None and multi:
            start = c[1]
            shared.update(multi.intersection(table[start // B : -(-(start + c[2]) // B)]))
    if shared:  # whoever holds a block another request writes may read that write (or write it too): the exact rule
        if at is None:
            at = dict(zip(ids, range(n)))
        for b in shared:
            for req_id, _ in index.holders(b):
                i = at.get(req_id)
                if i is not None:
                    slow.add(i)
    return sorted(slow), n - len(slow)
