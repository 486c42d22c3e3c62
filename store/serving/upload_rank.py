"""The upload backlog's order: which written-back block goes to S3 first.

A block on the node's NVMe but not yet in S3 waits in the upload backlog
(:mod:`store.tiers.backlog`), and the uploads drain it as the link allows. What a replacement
node finds in S3 is what was drained before the old node went, so the drain takes the most
valuable blocks first. A block's value is the node agent's ranking of it
(:func:`store.serving.urgency.rank`): ``p``, the probability that it is used within the plan's
horizon, from the plan's forecast and the fleet's memory together. Several agents rank one
node's blocks (one per tenant and key root): a block takes the highest value any of them gives it.

A block no ranking names (no plan names it, and no node of the fleet served it) has value 0
and goes by age, oldest first: an old block has waited longest, and it is the first that the
NVMe tier's LRU evicts, after which it can never be uploaded. Ties go by name, so the order is
total and the same wherever it is computed.

Pure: the connector's uploads (through the backlog's SQL order, which :func:`drain_key` states)
and the replay call the same functions.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, Mapping, Protocol, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

#: the value of a block no ranking names: it goes after every ranked block, by age
UNRANKED = 0.0


class WantLike(Protocol[K]):
    """A ranked block: what :func:`upload_ranks` reads of a :class:`store.serving.urgency.Want`."""

    @property
    def name(self) -> K: ...
    @property
    def p(self) -> float: ...


def upload_value(p: float) -> float:
    """A block's value in the drain order from its odds of use: ``p`` in ``[0, 1]`` (anything
    else, NaN included, is unranked)."""
    p = float(p)
    if not math.isfinite(p) or p <= 0.0:
        return UNRANKED
    return min(p, 1.0)


def upload_ranks(wanted: Iterable[WantLike[K]]) -> dict[K, float]:
    """One ranking's values by block: each wanted block's :func:`upload_value` (the highest
    where a block is named twice); blocks of value 0 are left out (they go by age)."""
    out: dict[K, float] = {}
    for w in wanted:
        v = upload_value(w.p)
        if v > out.get(w.name, UNRANKED):
            out[w.name] = v
    return out


def merged_rank(rankings: Iterable[Mapping[K, float]], name: K) -> float:
    """A block's value over several rankings (one per agent): the highest any gives it."""
    return max((r.get(name, UNRANKED) for r in rankings), default=UNRANKED)


def drain_key(rank: float, enqueued: float, name: str) -> tuple[float, float, str]:
    """The sort key of the drain order: highest value first, then the oldest, then by name.

    The backlog's SQL (``ORDER BY rank DESC, enqueued, name``) is this order.
    """
    return (-rank, enqueued, name)


def drain_order(items: Sequence[T] | Iterable[T], *, rank: Callable[[T], float], enqueued: Callable[[T], float],
                name: Callable[[T], str]) -> list[T]:
    """``items`` in drain order (:func:`drain_key`)."""
    return sorted(items, key=lambda x: drain_key(rank(x), enqueued(x), name(x)))
