"""Reuse survival: when will a cached block be used again, and what is it worth keeping?

:class:`ReuseHazard` learns, per reuse class (:func:`~forecasting.replay.occurrence_classes`),
the hazard of a block's next use as a function of its age (seconds since it was last
used): a piecewise-constant hazard on age bins, censoring-aware, estimated online from
the trace before the decision time only. An occurrence last used at ``t0`` contributes,
at time ``t``, its exposure up to ``min(gap, t - t0)`` and an event only if its reuse
already happened (``t0 + gap < t``); nothing after ``t`` is read.

From the hazard it derives each (class, age) pair's *hit density*: the best achievable
ratio of reuse probability to expected cache occupancy, ``max over A > a of
P(reuse in (a, A] | alive at a) / E[seconds held in (a, A] | alive at a)``, the Gittins
index of the keep-or-evict problem (the rule behind LHD-style caches). A block that is
usually reused a minute or two later but never within 30 s is worth keeping while it
is young and not once it is past its class's usual return time; an exponential decay
of one rate for all classes cannot express that.

:class:`SurvivalCache` evicts the cached blocks of lowest hit density x tokens. Hit
density changes with age differently per class, so the order is recomputed (vectorised)
at each request that overflows the cache, instead of kept in a heap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from forecasting.replay import _GAP_EDGES, _LEN_EDGES, NEVER, BlockIndex, occurrence_classes

#: Age bin edges in seconds (the last is the longest age the hazard is estimated for).
DEFAULT_EDGES = (0.0, 10.0, 20.0, 30.0, 45.0, 60.0, 75.0, 90.0, 120.0, 150.0, 180.0, 240.0, 300.0, 360.0,
                 450.0, 600.0, 750.0, 900.0, 1200.0, 1800.0)


_N_GAP = len(_GAP_EDGES) + 2
#: Number of :func:`survival_classes`.
N_SURVIVAL_CLASSES = 3 * 2 * _N_GAP


def survival_classes(index: BlockIndex) -> np.ndarray:
    """The hazard class of each block occurrence: use count (1, 2, 3+) x chain tail x turn gap.

    The features of :func:`~forecasting.replay.occurrence_classes` without the chain
    length: a hazard by age needs more outcomes per class than a reuse rate, and on
    the tuning points (``bench/replay_bench.py --tune``) the 30 coarser classes beat
    the 180 finer ones (see docs/simulate.md).
    """
    full = occurrence_classes(index)
    per_count_tail = (len(_LEN_EDGES) + 1) * _N_GAP
    return (full // per_count_tail) * _N_GAP + full % _N_GAP


@dataclass(frozen=True)
class SurvivalConfig:
    """Knobs of :class:`ReuseHazard`.

    Attributes:
        edges_s: increasing age bin edges in seconds, starting at 0; the last is the
            longest age modelled (older blocks keep the last bin's hazard).
        refresh_s: how often the hazard table is re-estimated.
        prior_weight: pseudo-occurrences per bin pulling a class towards the pooled hazard.
        prior_hazard: reuses per second assumed before anything is observed.
        class_prior: pseudo-occurrences (times ``prior_weight``) pulling a class's
            overall rate towards the pooled one, before its age profile is shrunk.
    """

    edges_s: tuple[float, ...] = DEFAULT_EDGES
    refresh_s: float = 15.0
    prior_weight: float = 50.0
    prior_hazard: float = 1e-3
    class_prior: float = 1.0

    def __post_init__(self) -> None:
        e = np.asarray(self.edges_s, dtype=np.float64)
        if len(e) < 2 or e[0] != 0 or np.any(np.diff(e) <= 0):
            raise ValueError(f"SurvivalConfig.edges_s must start at 0 and increase, got {self.edges_s!r}")
        for name in ("refresh_s", "prior_weight", "prior_hazard", "class_prior"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SurvivalConfig.{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class ReuseHazard:
    """Per-class hazard of reuse by age, from the trace before each :meth:`update` time.

    Attributes (after :meth:`update`):
        hazard: ``(n_classes, n_bins)`` reuses per second by age bin.
        density: ``(n_classes, n_bins)`` hit density of a block whose age is in the bin
            (per second held; multiply by tokens for tokens per block-second).
    """

    index: BlockIndex
    config: SurvivalConfig = field(default_factory=SurvivalConfig)
    classes: np.ndarray | None = None  # default: survival_classes(index)

    def __post_init__(self) -> None:
        if self.classes is None:
            self.classes = survival_classes(self.index)
            self.n_classes = N_SURVIVAL_CLASSES
        else:
            self.n_classes = int(self.classes.max(initial=-1)) + 1
        self.edges = np.asarray(self.config.edges_s, dtype=np.float64)
        self.widths = np.diff(self.edges)
        nb = len(self.widths)
        ts = self.index.trace.timestamps_s
        self._t0 = ts[self.index.request]
        nxt = self.index.next_request
        gap = np.where(nxt == NEVER, np.inf, ts[np.minimum(nxt, max(len(ts) - 1, 0))] - self._t0)
        max_age = self.edges[-1]
        self._gap = gap
        end = np.minimum(gap, max_age)
        self._close = self._t0 + end
        self._order = np.argsort(self._close, kind="stable")
        self._closed = 0
        # Closed outcomes: per (class, end bin), count, partial exposure and events.
        self._cnt = np.zeros((self.n_classes, nb + 1))
        self._part = np.zeros((self.n_classes, nb + 1))
        self._ev = np.zeros((self.n_classes, nb + 1))
        self._as_of = -math.inf
        self.hazard = np.full((self.n_classes, nb), self.config.prior_hazard)
        self.density = self._densities(self.hazard)

    def _bin(self, age: np.ndarray) -> np.ndarray:
        """End bin of an age: ``nb`` when it reaches the last edge."""
        return np.minimum(np.searchsorted(self.edges, age, side="right") - 1, len(self.widths))

    def _fold(self, occ: np.ndarray, end_age: np.ndarray, event: np.ndarray,
              cnt: np.ndarray, part: np.ndarray, ev: np.ndarray) -> None:
        c = self.classes[occ]
        b = self._bin(end_age)
        nb1 = len(self.widths) + 1
        flat = c * nb1 + b
        size = self.n_classes * nb1
        cnt += np.bincount(flat, minlength=size).reshape(cnt.shape)
        edge = np.append(self.edges, self.edges[-1])
        part += np.bincount(flat, weights=end_age - edge[b], minlength=size).reshape(part.shape)
        ev += np.bincount(flat, weights=event.astype(np.float64), minlength=size).reshape(ev.shape)

    def update(self, t: float) -> None:
        """Re-estimate from every outcome known before ``t`` (``t`` must not decrease)."""
        if t < self._as_of:
            raise ValueError(f"ReuseHazard.update went back in time: {t} < {self._as_of}")
        self._as_of = t
        max_age = self.edges[-1]
        m = int(np.searchsorted(self._close[self._order], t, side="left"))
        if m > self._closed:
            occ = self._order[self._closed : m]
            end = np.minimum(self._gap[occ], max_age)
            self._fold(occ, end, self._gap[occ] <= max_age, self._cnt, self._part, self._ev)
            self._closed = m
        # Open outcomes: used before t, neither reused nor past the last edge yet (censored at t).
        lo = int(np.searchsorted(self._t0, t - max_age, side="left"))
        hi = int(np.searchsorted(self._t0, t, side="left"))
        occ = np.arange(lo, hi)
        occ = occ[self._close[occ] >= t]
        cnt, part, ev = self._cnt.copy(), self._part.copy(), self._ev.copy()
        self._fold(occ, t - self._t0[occ], np.zeros(len(occ), dtype=bool), cnt, part, ev)
        # Exposure in bin j: full width for outcomes ending beyond it, partial for those ending in it.
        beyond = np.cumsum(cnt[:, ::-1], axis=1)[:, ::-1][:, 1:]
        exposure = beyond * self.widths + part[:, :-1]
        events = ev[:, :-1]
        w = self.config.prior_weight * self.widths
        pooled = (events.sum(axis=0) + w * self.config.prior_hazard) / (exposure.sum(axis=0) + w)
        # Each class: the pooled age profile scaled by the class's own rate (proportional
        # hazards), the prior each (class, age) cell is shrunk towards.
        k = self.config.prior_weight * self.config.class_prior
        expected = exposure @ pooled
        rate = (events.sum(axis=1) + k) / (expected + k)
        self.hazard = (events + w * rate[:, None] * pooled) / (exposure + w)
        self.density = self._densities(self.hazard)

    def _densities(self, hazard: np.ndarray) -> np.ndarray:
        """Hit density by (class, age bin): the Gittins index of keeping a block of that age."""
        cum = np.concatenate([np.zeros((hazard.shape[0], 1)), np.cumsum(hazard * self.widths, axis=1)], axis=1)
        surv = np.exp(-cum)  # S at each edge
        # Expected seconds alive within each bin, then cumulative.
        held = np.where(hazard > 0, surv[:, :-1] * -np.expm1(-hazard * self.widths) / np.maximum(hazard, 1e-300),
                        surv[:, :-1] * self.widths)
        occ = np.concatenate([np.zeros((hazard.shape[0], 1)), np.cumsum(held, axis=1)], axis=1)
        nb = hazard.shape[1]
        out = np.empty_like(hazard)
        for i in range(nb):
            num = surv[:, i : i + 1] - surv[:, i + 1 :]
            den = occ[:, i + 1 :] - occ[:, i : i + 1]
            out[:, i] = np.max(num / np.maximum(den, 1e-300), axis=1)
        return out


class SurvivalCache:
    """Forecast-informed retention: evict the blocks of lowest hit density x tokens (ties: deepest first).

    A block's score is its class's hit density at its current age (:class:`ReuseHazard`)
    times its tokens; a block whose parent is no longer cached scores lowest (it can
    never hit again). Scores change with age differently per class, so they are
    recomputed, vectorised, at each request that overflows the cache.

    Args:
        capacity: blocks.
        hazard: the reuse model (it holds the trace's :class:`BlockIndex`).
    """

    def __init__(self, capacity: int, hazard: ReuseHazard) -> None:
        self.capacity = capacity
        self.hazard = hazard
        index = hazard.index
        self._index = index
        size = capacity + int(index.trace.chain_lengths().max(initial=0)) + 1
        self._pos = np.full(index.n_unique, -1, dtype=np.int64)
        self._blk = np.full(size, -1, dtype=np.int64)
        self._par = np.full(size, -1, dtype=np.int64)
        self._t = np.zeros(size)
        self._cls = np.zeros(size, dtype=np.int64)
        self._tok = np.zeros(size)
        self._depth = np.zeros(size, dtype=np.int64)
        self._free = list(range(size - 1, -1, -1))
        self._n = 0
        self._now = 0.0
        self._next_refresh = -math.inf

    def __len__(self) -> int:
        return self._n

    def __contains__(self, block: int) -> bool:
        return bool(self._pos[block] >= 0)

    def clear(self) -> None:
        for s in np.flatnonzero(self._blk >= 0).tolist():
            self._drop(s)

    def blocks(self) -> list[int]:
        """Cached blocks, next to be evicted first (scored at the last request's time)."""
        occ = np.flatnonzero(self._blk >= 0)
        order = np.lexsort((-self._depth[occ], self._scores(self._now)[occ]))
        return self._blk[occ[order]].tolist()

    def load(self, blocks: Sequence[int], scores: Sequence[float] | None = None, *,
             at_s: float | None = None) -> None:
        """Prewarm with ``blocks``, each in the state of its last use before ``at_s``.

        A prewarmed block takes the class and time of its last use before ``at_s``
        (default: the end of the trace), as a cache that had kept it would hold; its
        eviction order is this cache's own, so ``scores`` are ignored.

        Raises:
            ValueError: a block was not used before ``at_s``.
        """
        index = self._index
        tr = index.trace
        t = float(tr.timestamps_s[-1]) if at_s is None else float(at_s)
        z = int(tr.offsets[int(np.searchsorted(tr.timestamps_s, t, side="left"))])
        last = np.full(index.n_unique, -1, dtype=np.int64)
        np.maximum.at(last, index.ids[:z], np.arange(z))
        b = np.asarray(blocks, dtype=np.int64)
        occ = last[b]
        if np.any(occ < 0):
            raise ValueError(f"SurvivalCache.load: {int(np.sum(occ < 0))} block(s) were not used before "
                             f"{t:g} s; prewarm only blocks seen before the prewarm time")
        self._refresh(t)
        self._put(b, occ)
        self._evict(t)

    def admit(self, index: BlockIndex, i: int) -> None:
        t = float(index.trace.timestamps_s[i])
        self._refresh(t)
        a, z = int(index.trace.offsets[i]), int(index.trace.offsets[i + 1])
        self._put(index.ids[a:z], np.arange(a, z))
        self._evict(t)

    def _refresh(self, t: float) -> None:
        self._now = t
        if t >= self._next_refresh:
            self.hazard.update(t)
            self._next_refresh = t + self.hazard.config.refresh_s

    def _drop(self, s: int) -> None:
        self._pos[self._blk[s]] = -1
        self._blk[s] = -1
        self._free.append(s)
        self._n -= 1

    def _put(self, blocks: np.ndarray, occ: np.ndarray) -> None:
        """Insert or touch ``blocks`` as used at occurrences ``occ`` (their class, time, tokens)."""
        index = self._index
        slots = self._pos[blocks]
        for k in np.flatnonzero(slots < 0).tolist():
            s = self._free.pop()
            slots[k] = s
            self._pos[blocks[k]] = s
            self._blk[s] = blocks[k]
            self._n += 1
        self._par[slots] = index.parent[blocks]
        self._t[slots] = index.trace.timestamps_s[index.request[occ]]
        self._cls[slots] = self.hazard.classes[occ]
        self._tok[slots] = index.tokens[occ]
        self._depth[slots] = index.depth[occ]

    def _scores(self, t: float) -> np.ndarray:
        h = self.hazard
        used = self._blk >= 0
        b = np.clip(np.searchsorted(h.edges, t - self._t, side="right") - 1, 0, len(h.widths) - 1)
        score = np.where(used, h.density[self._cls, b] * self._tok, np.inf)
        orphan = used & (self._par >= 0) & (self._pos[np.maximum(self._par, 0)] < 0)
        return np.where(orphan, -np.inf, score)

    def _evict(self, t: float) -> None:
        over = self._n - self.capacity
        if over <= 0:
            return
        key = self._scores(t) - 1e-9 * self._depth
        for s in np.argpartition(key, over - 1)[:over].tolist():
            self._drop(s)
