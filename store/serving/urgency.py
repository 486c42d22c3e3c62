"""How much a node wants each block, and in what order to copy them: the node agent's ranking.

Two sources tell a node which blocks it will need (docs/guides/loader.md, "The node agent"):

- **the plan's forecast**: each plan entry's ``expected_hits``, the uses the planner expects
  within its horizon (``horizon_s`` in the plan's ``extra``, default 300 s);
- **the fleet's memory** (:mod:`store.serving.fleet`): which blocks the fleet's nodes served
  recently, how often, and how much traffic the node that served them has seen since.

Both become one figure per block, the probability ``p`` that it is used within the horizon:
``1 - exp(-expected_hits)`` for a plan entry (at least one use of a Poisson count; an entry
without ``expected_hits``, as a hand-written plan has, counts as an even bet), and
:meth:`ReuseCurve.prob` of its uses and traffic age for a fleet record; a block named by both
gets ``1 - (1 - p_plan)(1 - p_fleet)``. Its rate of use is ``λ = -ln(1 - p) / horizon``, so
the block with the highest ``p`` is the one needed soonest: copies go in that order.

The set is sized to what the node can use: at most its tier's capacity in blocks (those it
holds count), and a copy only while it is still worth its link time. The ``k``-th copy lands
after ``k`` copy times; it helps only if its block is not needed before then (a request that
comes first computes the block, and write-back keeps it): its value is
``p · exp(-λ · t_k)``, and copies stop below ``min_value``. The plan's blocks are retained at
their ``p``; blocks only the fleet names are copied and age in the tier's LRU like any block
the node used. Nothing here does I/O; the agent
(:mod:`store.serving.agent`) feeds it and applies what it returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Iterable, Mapping, Protocol, Sequence, TypeVar

from store.errors import ConfigError

K = TypeVar("K", bound=Hashable)

#: the planner's horizon when a plan does not say (the reuse model's default)
DEFAULT_HORIZON_S = 300.0
#: the odds given to a plan entry with no ``expected_hits`` (hand-written plans): an even bet,
#: taken in the plan's order
UNFORECAST_P = 0.5


class UseLike(Protocol[K]):
    """A block the fleet served: what :func:`rank` reads of a :class:`store.serving.fleet.Use`."""

    @property
    def name(self) -> K: ...
    @property
    def at(self) -> float: ...
    @property
    def uses(self) -> int: ...
    @property
    def traffic_age(self) -> int: ...


@dataclass(frozen=True)
class ReuseCurve:
    """``P(a block is used within horizon_s | its uses in the window, the traffic since its last use)``.

    Age is counted in requests of the block's namespace that the recording node served since
    its last use (as the planner counts a tenant's requests), so a night of silence ages
    nothing: the blocks last used before it keep their odds. The
    planner publishes a curve learned from the logs in the plan (``extra["fleet_reuse"]``,
    :meth:`to_json`); without one the default below is a prior: a block used once is
    reused within 5 minutes about 30 % of the time when nothing else has happened since
    (the reuse model's ``prior_rate``), halving roughly with every tenfold more traffic, and a
    block used twice or more (a shared head, a conversation that keeps going) more often.

    Attributes:
        horizon_s: the window ``p`` is about.
        traffic_edges: ascending request counts: bin ``i`` is ``[edges[i-1], edges[i])``.
        p: per uses class (1, 2, 3 or more), one probability per traffic bin
            (``len(traffic_edges) + 1``).
    """

    horizon_s: float = DEFAULT_HORIZON_S
    traffic_edges: tuple[int, ...] = (10, 100, 1000, 10000)
    p: tuple[tuple[float, ...], ...] = field(default=(
        (0.30, 0.22, 0.12, 0.05, 0.02),
        (0.45, 0.35, 0.22, 0.10, 0.04),
        (0.70, 0.60, 0.40, 0.20, 0.08),
    ))

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.traffic_edges)
        if any(b <= a for a, b in zip(edges, edges[1:])) or any(e < 0 for e in edges):
            raise ConfigError("fleet_reuse.traffic_edges must be ascending non-negative counts, got "
                              f"{self.traffic_edges!r}")
        rows = tuple(tuple(float(x) for x in row) for row in self.p)
        if not rows or any(len(r) != len(edges) + 1 for r in rows):
            raise ConfigError(f"fleet_reuse.p must hold rows of {len(edges) + 1} probabilities (one per traffic "
                              f"bin), got {self.p!r}")
        if any(not 0.0 <= x < 1.0 for r in rows for x in r):
            raise ConfigError(f"fleet_reuse.p must hold probabilities in [0, 1), got {self.p!r}")
        if not (self.horizon_s > 0 and math.isfinite(self.horizon_s)):
            raise ConfigError(f"fleet_reuse.horizon_s must be a positive number of seconds, got {self.horizon_s!r}")
        object.__setattr__(self, "traffic_edges", edges)
        object.__setattr__(self, "p", rows)

    def prob(self, uses: int, traffic_age: int) -> float:
        """The probability a block used ``uses`` times, last ``traffic_age`` requests ago, is used again."""
        row = self.p[min(max(int(uses), 1), len(self.p)) - 1]
        age = max(int(traffic_age), 0)
        i = sum(1 for e in self.traffic_edges if age >= e)
        return row[i]

    def to_json(self) -> dict[str, Any]:
        return {"horizon_s": self.horizon_s, "traffic_edges": list(self.traffic_edges), "p": [list(r) for r in self.p]}

    @classmethod
    def from_json(cls, doc: Any) -> "ReuseCurve":
        """A curve from a plan's ``extra["fleet_reuse"]``.

        Raises:
            ConfigError: the document is not a curve (names the field).
        """
        if not isinstance(doc, dict) or not {"traffic_edges", "p"} <= set(doc):
            raise ConfigError(f"fleet_reuse must be an object with 'traffic_edges' and 'p', got {str(doc)[:80]!r}")
        try:
            return cls(horizon_s=float(doc.get("horizon_s", DEFAULT_HORIZON_S)),
                       traffic_edges=tuple(doc["traffic_edges"]), p=tuple(tuple(r) for r in doc["p"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fleet_reuse is not a valid curve: {exc}") from None


@dataclass(frozen=True)
class PlanChain(Generic[K]):
    """One plan entry as a node holds it: its blocks in prefix order and the uses expected of it."""

    names: tuple[K, ...]
    expected_hits: float
    score: float = 0.0


@dataclass(frozen=True)
class Want(Generic[K]):
    """A block the node wants: ``p`` within the horizon, ``rate`` per second, and where that came from."""

    name: K
    p: float
    rate: float
    source: str  # "plan", "fleet" or "both"


@dataclass(frozen=True)
class Warmup(Generic[K]):
    """What the agent asks of a node: retention priorities, and the copies to make in order.

    Attributes:
        priority: per block the plan wants, its retention priority (its ``p``; every other block
            keeps 0, and the tier's LRU orders those).
        order: the blocks to copy, soonest needed first (those the node holds are left out).
        wanted: every block kept, in rank order (held or copied).
        dropped: wanted blocks left out: past the tier's capacity, or not worth their link time.
    """

    priority: dict[K, float]
    order: list[K]
    wanted: list[Want[K]]
    dropped: int = 0

    def sources(self) -> dict[str, int]:
        """How many kept blocks came from the plan, the fleet's memory, or both."""
        out: dict[str, int] = {"plan": 0, "fleet": 0, "both": 0}
        for w in self.wanted:
            out[w.source] += 1
        return out


def plan_p(expected_hits: float) -> float:
    """The probability of at least one use when ``expected_hits`` are expected (a Poisson count)."""
    return 1.0 - math.exp(-max(float(expected_hits), 0.0))


def rank(plan: Sequence[PlanChain[K]], uses: Iterable[UseLike[K]], *, curve: ReuseCurve, held: Mapping[K, Any] | set[K],
         capacity: int, copy_s: float, min_value: float = 0.02, horizon_s: float | None = None) -> Warmup[K]:
    """Rank every block the plan or the fleet names, soonest needed first, and size the set.

    Args:
        plan: the plan's chains for this node, in the plan's order.
        uses: the fleet's records (any order).
        curve: turns a fleet record into ``p``.
        held: the blocks the node holds now (they cost no copy).
        capacity: blocks the node's tier holds.
        copy_s: seconds of the node's link per block copied (0: copies are free).
        min_value: the least ``p · exp(-rate · t_k)`` a copy landing at ``t_k`` must keep.
        horizon_s: the horizon of the plan's ``expected_hits`` (default the curve's).
    """
    horizon = float(horizon_s or curve.horizon_s)
    p_plan: dict[K, float] = {}
    order_of: dict[K, int] = {}
    for c in plan:
        # an entry without a forecast (a hand-written plan, an older planner) is wanted as an even bet
        p = plan_p(c.expected_hits) if c.expected_hits > 0 else UNFORECAST_P
        for b in c.names:
            if p > p_plan.get(b, 0.0):
                p_plan[b] = p
            order_of.setdefault(b, len(order_of))
    p_fleet: dict[K, float] = {}
    recency: dict[K, float] = {}
    for u in uses:
        p = curve.prob(u.uses, u.traffic_age)
        if p > p_fleet.get(u.name, -1.0):
            p_fleet[u.name] = p
        recency[u.name] = max(recency.get(u.name, -math.inf), float(u.at))
    wants: list[Want[K]] = []
    for b in set(p_plan) | set(p_fleet):
        a, f = p_plan.get(b, 0.0), p_fleet.get(b, 0.0)
        p = 1.0 - (1.0 - a) * (1.0 - f)
        if p <= 0.0:
            continue
        source = "both" if b in p_plan and b in p_fleet else ("plan" if b in p_plan else "fleet")
        wants.append(Want(b, p, -math.log1p(-min(p, 1.0 - 1e-12)) / horizon, source))
    # soonest needed first; ties: the most recently used, then the plan's order (a chain's head first)
    wants.sort(key=lambda w: (-w.p, -recency.get(w.name, -math.inf), order_of.get(w.name, 1 << 60)))
    kept: list[Want[K]] = []
    order: list[K] = []
    dropped = 0
    for w in wants:
        if len(kept) >= capacity:
            dropped += 1
            continue
        if w.name in held:
            kept.append(w)
            continue
        landing = (len(order) + 1) * copy_s
        if w.p * math.exp(-w.rate * landing) < min_value:
            dropped += 1
            continue
        kept.append(w)
        order.append(w.name)
    # The plan's blocks are retained at their odds, above every block no plan names; a block only
    # the fleet's memory names is copied, not pinned: it lands as the tier's most recently used.
    return Warmup({w.name: w.p for w in kept if w.source != "fleet"}, order, kept, dropped)
