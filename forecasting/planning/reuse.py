"""The reuse model: how likely a stored prefix is to be asked for again soon, from the logs before the plan.

Recurring prefixes (a system prompt every request of a tenant starts with) have a demand
series the forecasts follow. A conversation's prefix does not: whether it is used again
depends on how recently its conversation spoke. This model covers those, for the
planner's ``retain`` entries (:mod:`forecasting.planning.retain`).

A block occurrence's *class* is known when its request arrives: how often the block was
used before (1, 2, 3+), whether it is the chain's last block (a partial tail is almost
never reused), the request's chain length (short conversations come back more often)
and the time since the conversation's previous turn (none, < 30 s, < 2 min, < 10 min,
longer). A block's *age* is the traffic since its last use: the requests of its tenant
that came after it (bins of two per doubling), not the seconds. After an idle night no
request has come, so the blocks last used keep the probability they had when traffic
stopped; in steady traffic the two ages agree up to the rate.

The model estimates ``p(class, age) = P(block used within horizon_s | class of its last
use, age)`` from **closed outcomes only**. Each past occurrence is looked at as of the
requests after it (checkpoints at ages 0, 1, 2, 3, 4, 6, 8, 11, 16, ... requests, while the
block is still unused), and a checkpoint counts at the plan's time ``t`` only when its
outcome is closed: checkpoint time ``+ horizon_s < t``. It is given the logs before ``t``
only (:func:`forecasting.planning.cadence.plan_now` cuts them), so a plan never depends on
what comes after its time. Sparse cells are shrunk towards the class's rate one age bin
younger, scaled by how the overall rate falls between the two bins.

Each prefix seen gets its expected uses within the horizon after ``t``,
``p(class of its last use, its age now)``, and an *urgency*: the same probability for
the shorter ``urgent_s``, which orders the copies (soonest needed first). With fewer than
``min_outcomes`` closed outcomes the model falls back to recency and frequency, aged by
traffic too: ``p = (1 - (1 - prior_rate) ** uses) * exp(-age / tau_requests)``.
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
#: lower edges of the age bins after 0, in requests since the last use (two per doubling, to 2**22)
AGE_EDGES = np.unique(np.r_[[1, 2, 3], np.round(2.0 ** np.arange(2, 22.5, 0.5))]).astype(np.int64)
N_AGES = len(AGE_EDGES) + 1


def age_bin(age: np.ndarray) -> np.ndarray:
    """The age bin of ages in requests since the last use (0: none since)."""
    return np.searchsorted(AGE_EDGES, np.asarray(age, dtype=np.int64), side="right")


@dataclass(frozen=True)
class ReuseConfig:
    """Knobs of the reuse model.

    Attributes:
        horizon_s: an occurrence counts as reused when its block is used again within this
            (seconds after a moment its tenant had traffic).
        urgent_s: the shorter window of the urgency that orders the copies (60 s: the first
            minute after a node starts, which its prefetch must serve first; at most the horizon).
        tau_requests: the fallback's recency scale, in requests of the tenant since the last
            use: ``p * exp(-age / tau_requests)`` (6,000: the 1,800 s the recency scale had when
            it was wall-clock time, at the Mooncake trace's 3.4 requests a second).
        prior_weight: pseudo-count pulling a cell towards its prior.
        prior_rate: reuse probability assumed before any outcome is known (and the
            fallback's per-use rate).
        min_outcomes: fewer closed outcomes than this: fall back to recency and frequency.
    """

    horizon_s: float = 300.0
    urgent_s: float = 60.0
    tau_requests: float = 6000.0
    prior_weight: float = 20.0
    prior_rate: float = 0.3
    min_outcomes: int = 1000

    def __post_init__(self) -> None:
        for name in ("horizon_s", "urgent_s", "tau_requests", "prior_weight"):
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
        tenant: per request, its tenant's code (traffic is counted per tenant).
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
    tenant: np.ndarray | None = None

    @classmethod
    def of(cls, tree: PrefixTree) -> Occurrences:
        """The occurrences of a mined tree."""
        nodes = np.asarray(tree.path_nodes, dtype=np.int64)
        offsets = np.asarray(tree.offsets, dtype=np.int64)
        links = chain_links(offsets, nodes, tree.n_nodes)
        return cls(tree.times_us / 1e6, offsets, nodes, *links, tree.n_nodes,
                   np.asarray(tree.tenant_codes, dtype=np.int64))

    def traffic(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """How traffic is counted: ``(by_tenant, position, end)``: the requests in (tenant, time)
        order; each request's index in it; and per request, where its tenant's run ends. The
        request ``a`` after request ``i`` in its tenant is ``by_tenant[position[i] + a]`` while
        ``position[i] + a < end[i]``; its age at the end of the logs is ``end[i] - 1 - position[i]``."""
        n = len(self.times_s)
        tenant = np.zeros(n, dtype=np.int64) if self.tenant is None else self.tenant
        by_tenant = np.lexsort((np.arange(n), self.times_s, tenant))
        position = np.empty(n, dtype=np.int64)
        position[by_tenant] = np.arange(n)
        sorted_t = tenant[by_tenant]
        ends = np.searchsorted(sorted_t, sorted_t, side="right")
        end = np.empty(n, dtype=np.int64)
        end[by_tenant] = ends
        return by_tenant, position, end

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
    """A fitted table (or the fallback), as of a plan's time.

    Attributes:
        config: the knobs it was fitted with.
        as_of_s: the plan's time (same clock as :attr:`Occurrences.times_s`).
        p: per class and age bin (``N_CLASSES x N_AGES``), P(used within the horizon);
            ``None`` when the model fell back.
        p_urgent: the same for ``urgent_s`` (``None`` when it fell back).
        p_by_uses: P(used within the horizon) per uses class (1, 2, 3+) and age bin, the
            other parts of the class pooled (:meth:`fleet_curve`; ``None`` when it fell back).
        closed: closed outcomes it learned from (occurrences with a closed checkpoint at age 0).
    """

    config: ReuseConfig
    as_of_s: float
    p: np.ndarray | None
    closed: int
    p_urgent: np.ndarray | None = None
    p_by_uses: np.ndarray | None = None

    @property
    def fallback(self) -> bool:
        """Whether it ranks by recency and frequency only (too little history)."""
        return self.p is None

    @classmethod
    def fit(cls, occ: Occurrences, as_of_s: float, config: ReuseConfig = ReuseConfig()) -> ReuseModel:
        """Learn ``p(class, age)`` from the outcomes closed before ``as_of_s``.

        Raises:
            BadInputError: an occurrence at or after ``as_of_s`` (the plan would see its own future).
        """
        if len(occ.times_s) and float(occ.times_s.max()) >= as_of_s:
            raise BadInputError(f"the reuse model got logs up to {float(occ.times_s.max()):.3f} s, not before the "
                                f"plan's time {as_of_s:.3f} s: cut the logs at the plan's time")
        occ_t = occ.times_s[occ.request]
        n_closed = int((occ_t + config.horizon_s < as_of_s).sum())
        if n_closed < config.min_outcomes:
            return cls(config, float(as_of_s), None, n_closed)
        n, r, u = _checkpoints(occ, as_of_s, config)
        level = np.arange(N_CLASSES) // (N_CLASSES // 3)  # the class's uses before it: 1, 2, 3+
        by_uses = [np.stack([m[level == k].sum(axis=0) for k in range(3)]) for m in (n, r)]
        return cls(config, float(as_of_s), _shrunk(n, r, config), n_closed, _shrunk(n, u, config),
                   _shrunk(*by_uses, config))

    def fleet_curve(self) -> dict | None:
        """The table a node agent ranks the fleet's records with (a plan's ``extra["fleet_reuse"]``,
        :class:`store.serving.urgency.ReuseCurve`): P(used within the horizon | uses 1, 2, 3+,
        requests since the last use), the same checkpoints as :attr:`p` pooled over the other
        parts of the class. ``None`` when the model fell back."""
        if self.p_by_uses is None:
            return None
        return {"horizon_s": self.config.horizon_s, "traffic_edges": [int(e) for e in AGE_EDGES],
                "p": [[round(float(x), 6) for x in np.minimum(row, 0.999)] for row in self.p_by_uses]}

    def _now(self, occ: Occurrences) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node seen: which nodes, their last occurrence, and their age in requests now."""
        last = occ.last_use()
        seen = np.flatnonzero(last >= 0)
        at = last[seen]
        _, position, end = occ.traffic()
        req = occ.request[at]
        return seen, at, end[req] - 1 - position[req]

    def expected_uses(self, occ: Occurrences) -> np.ndarray:
        """Per node, its expected uses within the horizon after the plan's time (0: never seen)."""
        return self._forecast(occ, self.p, 1.0)

    def urgency(self, occ: Occurrences) -> np.ndarray:
        """Per node, its expected uses within ``urgent_s`` (the fallback: the horizon's, scaled by
        ``urgent_s / horizon_s``, so it orders as the value does)."""
        return self._forecast(occ, self.p_urgent, min(self.config.urgent_s / self.config.horizon_s, 1.0))

    def _forecast(self, occ: Occurrences, table: np.ndarray | None, scale: float) -> np.ndarray:
        out = np.zeros(occ.n_nodes)
        seen, at, age = self._now(occ)
        if table is None:
            p = 1.0 - (1.0 - self.config.prior_rate) ** occ.uses()[seen]
            out[seen] = scale * p * np.exp(-age / self.config.tau_requests)
        else:
            out[seen] = table[occ.classes()[at], np.minimum(age_bin(age), N_AGES - 1)]
        return out


def _checkpoints(occ: Occurrences, as_of_s: float, config: ReuseConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per class and age bin: closed checkpoints, and how many saw a use within the horizon
    and within ``urgent_s``. A checkpoint of an occurrence at age ``a`` is at the ``a``-th
    request of its tenant after it, while its block is unused; it is closed when that
    request's time ``+ horizon_s`` is before the plan's time."""
    by_tenant, position, end = occ.traffic()
    times = occ.times_s
    cls = occ.classes()
    nxt_t = np.where(occ.next == NEVER, np.inf, times[np.minimum(occ.next, max(len(times) - 1, 0))])
    live = np.arange(len(occ.nodes))
    pos, stop = position[occ.request], end[occ.request]
    n = np.zeros((N_CLASSES, N_AGES))
    r = np.zeros((N_CLASSES, N_AGES))
    u = np.zeros((N_CLASSES, N_AGES))
    for k, a in enumerate(np.r_[0, AGE_EDGES]):
        live = live[pos[live] + a < stop[live]]
        c = by_tenant[pos[live] + a]
        unused = occ.next[live] > c  # still unused at the checkpoint
        live, c = live[unused], c[unused]
        if not live.size:
            break
        tau = times[c]
        closed = tau + config.horizon_s < as_of_s
        wait = nxt_t[live[closed]] - tau[closed]
        c_cls = cls[live[closed]]
        n[:, k] = np.bincount(c_cls, minlength=N_CLASSES)
        r[:, k] = np.bincount(c_cls, weights=wait <= config.horizon_s, minlength=N_CLASSES)
        u[:, k] = np.bincount(c_cls, weights=wait <= min(config.urgent_s, config.horizon_s), minlength=N_CLASSES)
    return n, r, u


def _shrunk(n: np.ndarray, r: np.ndarray, config: ReuseConfig) -> np.ndarray:
    """Rates per class and age bin, each shrunk towards its class's rate one bin younger
    scaled by the overall rate's fall between the bins (age 0: towards the overall rate)."""
    w = config.prior_weight
    total_n, total_r = n.sum(axis=0), r.sum(axis=0)
    overall = np.empty(N_AGES)
    overall[0] = (total_r[0] + w * (total_r.sum() + config.prior_rate) / (total_n.sum() + 1.0)) / (total_n[0] + w)
    for k in range(1, N_AGES):
        overall[k] = (total_r[k] + w * overall[k - 1]) / (total_n[k] + w)
    overall = np.clip(overall, 1e-6, 1.0)
    p = np.empty_like(n)
    p[:, 0] = (r[:, 0] + w * overall[0]) / (n[:, 0] + w)
    for k in range(1, N_AGES):
        prior = np.minimum(p[:, k - 1] * overall[k] / overall[k - 1], 1.0)
        p[:, k] = (r[:, k] + w * prior) / (n[:, k] + w)
    return np.clip(p, 1e-6, 1.0)
