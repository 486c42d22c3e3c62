"""The reuse model: how likely a stored prefix is to be asked for again soon, from the logs before the plan.

Recurring prefixes (a system prompt every request of a tenant starts with) have a demand
series the forecasts follow. A conversation's prefix does not: whether it is used again
depends on how recently its conversation spoke. This model covers those, for the
planner's ``retain`` entries (:mod:`forecasting.planning.retain`).

A block occurrence's *class* is known when its request arrives: how often the block was
used before (1, 2, 3+), whether it is the chain's last block (a partial tail is almost
never reused), the request's chain length (short conversations come back more often)
and the time since the conversation's previous turn (none, < 30 s, < 2 min, < 10 min,
longer). The model estimates ``p(class) = P(block used again within horizon | class)``,
shrunk towards the overall rate, from **closed outcomes only**: an occurrence at ``t0``
counts at the plan's time ``t`` only when ``t0 + horizon < t``. It is given the logs
before ``t`` only (:func:`forecasting.planning.cadence.plan_now` cuts them), so a plan never
depends on what comes after its time.

Each prefix seen gets the expected uses within the horizon after ``t``:
``p(class of its last use) * exp(-(t - t_last) / tau)``. With fewer than
``min_outcomes`` closed outcomes (too little history to learn a class table from) the
model falls back to recency and frequency: ``p = 1 - (1 - prior_rate) ** uses``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from forecasting.mining.prefix_tree import PrefixTree
from store.errors import BadInputError

#: no next use
NEVER = np.iinfo(np.int64).max
_LEN_EDGES = np.array([4, 8, 16, 32, 64])
_GAP_EDGES = np.array([30.0, 120.0, 600.0])
N_CLASSES = 3 * 2 * (len(_LEN_EDGES) + 1) * (len(_GAP_EDGES) + 2)


@dataclass(frozen=True)
class ReuseConfig:
    """Knobs of the reuse model.

    Attributes:
        horizon_s: an occurrence counts as reused when its block is used again within this.
        tau_s: recency scale: the expected uses of a prefix last used ``a`` seconds ago
            are ``p * exp(-a / tau_s)`` (1,800 s: chosen by ``bench/replay_bench.py --tune``
            on Mooncake events that are never evaluated; docs/guides/simulate.md).
        prior_weight: pseudo-count pulling a class towards the overall reuse rate.
        prior_rate: reuse probability assumed before any outcome is known (and the
            fallback's per-use rate).
        min_outcomes: fewer closed outcomes than this: fall back to recency and frequency.
    """

    horizon_s: float = 300.0
    tau_s: float = 1800.0
    prior_weight: float = 20.0
    prior_rate: float = 0.3
    min_outcomes: int = 1000

    def __post_init__(self) -> None:
        for name in ("horizon_s", "tau_s", "prior_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise BadInputError(f"ReuseConfig.{name} must be a positive number, got {value!r}")
        if not 0 < self.prior_rate < 1:
            raise BadInputError(f"ReuseConfig.prior_rate must be in (0, 1), got {self.prior_rate!r}")
        if not (isinstance(self.min_outcomes, int) and self.min_outcomes >= 0):
            raise BadInputError(f"ReuseConfig.min_outcomes must be an integer >= 0, got {self.min_outcomes!r}")


def chain_links(offsets: np.ndarray, ids: np.ndarray, n_ids: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                              np.ndarray, np.ndarray]:
    """Per occurrence of requests' block chains: its request, position, and the previous and next
    request using the same block; per request, how many leading blocks were seen before.

    ``ids`` are dense block ids (``0 .. n_ids - 1``), request ``i``'s chain being
    ``ids[offsets[i]:offsets[i + 1]]``. Returns ``(request, position, prev, next, lead_seen)``
    (``prev`` -1 and ``next`` :data:`NEVER` where there is none).
    """
    lengths = np.diff(offsets)
    n = len(ids)
    request = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position = np.arange(n, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    order = np.lexsort((np.arange(n), ids))
    same = ids[order[1:]] == ids[order[:-1]]
    nxt = np.full(n, NEVER, dtype=np.int64)
    nxt[order[:-1][same]] = request[order[1:][same]]
    prv = np.full(n, -1, dtype=np.int64)
    prv[order[1:][same]] = request[order[:-1][same]]
    first_new = np.where(prv < 0, position, NEVER)
    lead = np.zeros(len(lengths), dtype=np.int64)
    has = lengths > 0
    if n:
        lead[has] = np.minimum.reduceat(first_new, offsets[:-1][has])
    return request, position, prv, nxt, np.minimum(lead, lengths)


@dataclass(frozen=True, eq=False)
class Occurrences:
    """Requests' paths through a prefix tree, per block occurrence (see :func:`chain_links`).

    Attributes:
        times_s: arrival time of each request, seconds (the tree's clock).
        offsets, nodes: the paths (CSR): request ``i`` uses ``nodes[offsets[i]:offsets[i + 1]]``.
        request, position, prev, next: per occurrence.
        lead_seen: per request, leading blocks seen before.
        n_nodes: tree nodes.
    """

    times_s: np.ndarray
    offsets: np.ndarray
    nodes: np.ndarray
    request: np.ndarray
    position: np.ndarray
    prev: np.ndarray
    next: np.ndarray
    lead_seen: np.ndarray
    n_nodes: int

    @classmethod
    def of(cls, tree: PrefixTree) -> Occurrences:
        """The occurrences of a mined tree."""
        nodes = np.asarray(tree.path_nodes, dtype=np.int64)
        offsets = np.asarray(tree.offsets, dtype=np.int64)
        links = chain_links(offsets, nodes, tree.n_nodes)
        return cls(tree.times_us / 1e6, offsets, nodes, *links, tree.n_nodes)

    def classes(self) -> np.ndarray:
        """The reuse class of each occurrence (see the module docstring), in ``0 .. N_CLASSES - 1``."""
        lengths = np.diff(self.offsets)
        n = len(self.nodes)
        order = np.lexsort((np.arange(n), self.nodes))
        starts = np.r_[True, self.nodes[order[1:]] != self.nodes[order[:-1]]] if n else np.zeros(0, bool)
        pos = np.arange(n)
        seen = np.zeros(n, dtype=np.int64)
        seen[order] = pos - np.maximum.accumulate(np.where(starts, pos, 0))
        tail = np.zeros(n, dtype=np.int64)
        tail[self.offsets[1:][lengths > 0] - 1] = 1
        gap = np.full(len(lengths), -1.0)
        cont = self.lead_seen >= 2
        last_shared = self.offsets[:-1][cont] + self.lead_seen[cont] - 1
        gap[cont] = self.times_s[cont] - self.times_s[self.prev[last_shared]]
        gap_b = np.where(gap < 0, 0, 1 + np.digitize(gap, _GAP_EDGES))
        per_request = np.digitize(lengths, _LEN_EDGES) * (len(_GAP_EDGES) + 2) + gap_b
        return ((np.minimum(seen, 2) * 2 + tail) * ((len(_LEN_EDGES) + 1) * (len(_GAP_EDGES) + 2))
                + np.repeat(per_request, lengths)).astype(np.int64)

    def last_use(self) -> np.ndarray:
        """Per node, its last occurrence (-1: never used)."""
        last = np.full(self.n_nodes, -1, dtype=np.int64)
        np.maximum.at(last, self.nodes, np.arange(len(self.nodes)))
        return last

    def uses(self) -> np.ndarray:
        """Per node, how many requests used it."""
        return np.bincount(self.nodes, minlength=self.n_nodes)


@dataclass(frozen=True)
class ReuseModel:
    """A fitted class table (or the fallback), as of a plan's time.

    Attributes:
        config: the knobs it was fitted with.
        as_of_s: the plan's time (same clock as :attr:`Occurrences.times_s`).
        p: per class, P(used again within the horizon); ``None`` when the model fell back.
        closed: closed outcomes it learned from.
    """

    config: ReuseConfig
    as_of_s: float
    p: np.ndarray | None
    closed: int

    @property
    def fallback(self) -> bool:
        """Whether it ranks by recency and frequency only (too little history)."""
        return self.p is None

    @classmethod
    def fit(cls, occ: Occurrences, as_of_s: float, config: ReuseConfig = ReuseConfig()) -> ReuseModel:
        """Learn ``p(class)`` from the outcomes closed before ``as_of_s``.

        Raises:
            BadInputError: an occurrence at or after ``as_of_s`` (the plan would see its own future).
        """
        if len(occ.times_s) and float(occ.times_s.max()) >= as_of_s:
            raise BadInputError(f"the reuse model got logs up to {float(occ.times_s.max()):.3f} s, not before the "
                                f"plan's time {as_of_s:.3f} s: cut the logs at the plan's time")
        occ_t = occ.times_s[occ.request]
        closed = occ_t + config.horizon_s < as_of_s
        n_closed = int(closed.sum())
        if n_closed < config.min_outcomes:
            return cls(config, float(as_of_s), None, n_closed)
        nxt = occ.next[closed]
        reuse_t = np.where(nxt == NEVER, np.inf, occ.times_s[np.minimum(nxt, len(occ.times_s) - 1)])
        reused = (reuse_t - occ_t[closed]) <= config.horizon_s
        c = occ.classes()[closed]
        n = np.bincount(c, minlength=N_CLASSES).astype(np.float64)
        r = np.bincount(c, weights=reused, minlength=N_CLASSES)
        base = (r.sum() + config.prior_rate) / (n.sum() + 1.0)
        w = config.prior_weight
        return cls(config, float(as_of_s), np.clip((r + w * base) / (n + w), 1e-4, 1.0), n_closed)

    def expected_uses(self, occ: Occurrences) -> np.ndarray:
        """Per node, its expected uses within the horizon after the plan's time (0: never seen)."""
        last = occ.last_use()
        seen = last >= 0
        out = np.zeros(occ.n_nodes)
        at = last[seen]
        if self.p is None:
            p = 1.0 - (1.0 - self.config.prior_rate) ** occ.uses()[seen]
        else:
            p = self.p[occ.classes()[at]]
        age = self.as_of_s - occ.times_s[occ.request[at]]
        out[seen] = p * np.exp(-age / self.config.tau_s)
        return out
