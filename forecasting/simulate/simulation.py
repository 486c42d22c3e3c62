"""What-if replay: how many prefill tokens would prewarming and retention save on a trace?

A :class:`Scenario` says what happens to the cache (nothing, a restart at ``T``, a new
replica taking a share of the traffic from ``T``); a :class:`Policy` says how the cache
evicts (``lru``, ``retention``, ``belady``) and how it is prewarmed at ``T``:

- ``naive``: the blocks with the most requests in the ``lookback_s`` before ``T``;
- ``kvwarm``: the blocks with the highest predicted reuse at ``T``
  (:class:`~forecasting.simulate.replay.ReusePredictor`: class reuse rates from closed outcomes,
  recency, conversation structure), closed under prefixes;
- ``oracle``: the best possible prewarm from blocks seen before ``T``: those used in
  the evaluation window, the soonest used kept longest (the ceiling for prewarming);
- ``plan``: the prefixes of a kvwarm plan file (what ``prefill warm --plan`` stores), in
  the plan's priority order: the prewarm the real pipeline made.

Every prewarm is a function of the trace before ``T`` only (the oracle excepted, by
definition; a plan is causal when it was made from logs before ``T``, which the
simulation cannot check). :func:`simulate` runs each policy and returns a :class:`SimResult` of
metrics over the evaluation window; :func:`plot` draws the per-minute hit rates.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from forecasting.simulate.prewarm import _occurrences, kvwarm_prewarm, naive_prewarm, oracle_prewarm, planned_prewarm
from forecasting.simulate.replay import (
    BeladyCache,
    BlockIndex,
    LRUCache,
    PredictorConfig,
    RetentionCache,
    ReusePredictor,
    next_use,
    replay,
)
from store.cost import PrefillCost
from store.errors import BadInputError

SCENARIOS = ("steady", "restart", "scale-out")
EVICTIONS = ("lru", "retention", "belady")
PREWARMS = ("none", "naive", "kvwarm", "oracle", "plan")
STEADY_POLICIES = ("lru", "retention", "belady")
WARMUP_POLICIES = ("lru", "lru+naive", "lru+kvwarm", "lru+oracle", "retention", "retention+kvwarm", "belady")


@dataclass(frozen=True)
class Policy:
    """An eviction and a prewarm, written ``eviction[+prewarm]`` (e.g. ``lru+kvwarm``)."""

    eviction: str = "lru"
    prewarm: str = "none"

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise BadInputError(f"unknown eviction {self.eviction!r}; choose one of {', '.join(EVICTIONS)}")
        if self.prewarm not in PREWARMS:
            raise BadInputError(f"unknown prewarm {self.prewarm!r}; choose one of {', '.join(PREWARMS)}")
        if self.eviction == "belady" and self.prewarm != "none":
            raise BadInputError("belady is the eviction ceiling and takes no prewarm; use 'belady' alone")

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``lru``, ``lru+naive``, ``retention+kvwarm``, ``belady``... (see :data:`EVICTIONS`, :data:`PREWARMS`)."""
        eviction, _, prewarm = text.strip().partition("+")
        return cls(eviction, prewarm or "none")

    @property
    def name(self) -> str:
        return self.eviction if self.prewarm == "none" else f"{self.eviction}+{self.prewarm}"


@dataclass(frozen=True)
class Scenario:
    """What happens to the cache under test.

    Attributes:
        kind: ``steady`` (one cache over the whole trace), ``restart`` (emptied at
            ``at_s``) or ``scale-out`` (a new, empty replica gets ``share`` of the
            requests from ``at_s``, routed at random with ``seed``).
        at_s: the event time, seconds from the trace start (ignored for steady).
        window_s: evaluation window after ``at_s``; steady evaluates the whole trace.
        share: traffic share of the new replica (scale-out).
        seed: routing seed (scale-out).
        lookback_s: history the naive prewarm counts requests over.
        bucket_s: width of the per-minute series.
        recovery_fraction: recovered once a bucket reaches this fraction of the
            reference's hit rate in the same bucket.
    """

    kind: str = "steady"
    at_s: float = 0.0
    window_s: float = 600.0
    share: float = 0.25
    seed: int = 0
    lookback_s: float = 1800.0
    bucket_s: float = 60.0
    recovery_fraction: float = 0.9

    def __post_init__(self) -> None:
        if self.kind not in SCENARIOS:
            raise BadInputError(f"unknown scenario {self.kind!r}; choose one of {', '.join(SCENARIOS)}")
        if not 0 < self.share <= 1:
            raise BadInputError(f"share must be in (0, 1], got {self.share}")
        if self.window_s <= 0 or self.bucket_s <= 0 or self.lookback_s <= 0:
            raise BadInputError("window_s, bucket_s and lookback_s must be positive")
        if not 0 < self.recovery_fraction <= 1:
            raise BadInputError(f"recovery_fraction must be in (0, 1], got {self.recovery_fraction}")


@dataclass(frozen=True)
class PolicyResult:
    """Metrics of one policy over the evaluation window (rates in [0, 1], times in seconds)."""

    policy: str
    requests: int
    tokens: int
    hit_tokens: int
    hit_rate: float
    hit_rate_excl_root: float
    first_bucket_hit_rate_excl_root: float
    minutes_to_recover: float | None
    prefill_tokens_saved: int
    ttft_saved_s: float
    ttft_saved_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    prewarm_blocks: int
    warmup_precision: float | None
    warmup_recall: float | None
    per_bucket: tuple[tuple[float, float], ...]
    seconds: float


@dataclass(frozen=True)
class SimResult:
    """Everything :func:`simulate` measured: one row per policy plus the reference."""

    scenario: Scenario
    capacity_blocks: int
    window: tuple[float, float]
    reference: PolicyResult | None
    rows: tuple[PolicyResult, ...]

    def row(self, policy: str) -> PolicyResult:
        """The row of ``policy`` (e.g. ``"lru+kvwarm"``)."""
        for r in self.rows:
            if r.policy == policy:
                return r
        raise KeyError(f"no row for policy {policy!r}; have {[r.policy for r in self.rows]}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"scenario": asdict(self.scenario), "capacity_blocks": self.capacity_blocks,
                "window_s": list(self.window),
                "reference": None if self.reference is None else asdict(self.reference),
                "rows": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        """A plain-text table, one line per policy."""
        head = (f"{'policy':<20}{'hit%':>7}{'excl0%':>8}{'1st-min%':>9}{'recover':>8}"
                f"{'saved tok':>12}{'TTFT s':>10}{'p99 ms':>9}{'prec%':>7}{'rec%':>7}")
        lines = [head]
        for r in ([self.reference] if self.reference else []) + list(self.rows):
            rec = "-" if r.minutes_to_recover is None else f"{r.minutes_to_recover:g}"
            prec = "-" if r.warmup_precision is None else f"{100 * r.warmup_precision:.1f}"
            recall = "-" if r.warmup_recall is None else f"{100 * r.warmup_recall:.1f}"
            lines.append(f"{r.policy:<20}{100 * r.hit_rate:>7.1f}{100 * r.hit_rate_excl_root:>8.1f}"
                         f"{100 * r.first_bucket_hit_rate_excl_root:>9.1f}{rec:>8}{r.prefill_tokens_saved:>12,}"
                         f"{r.ttft_saved_s:>10.1f}{1e3 * r.ttft_p99_s:>9.1f}{prec:>7}{recall:>7}")
        return "\n".join(lines)


# -------------------------------------------------------------------------- simulate


@dataclass(frozen=True)
class _Plan:
    """Which requests a scenario serves, from where, and against what reference."""

    start: int
    served: np.ndarray
    reference: np.ndarray | None
    window: tuple[float, float]


def _plan(index: BlockIndex, scenario: Scenario) -> _Plan:
    ts = index.trace.timestamps_s
    n = len(ts)
    if scenario.kind == "steady":
        rows = np.arange(n, dtype=np.int64)
        return _Plan(0, rows, None, (0.0, float(ts[-1]) if n else 0.0))
    if not 0 <= scenario.at_s <= (ts[-1] if n else 0):
        raise BadInputError(f"event time {scenario.at_s:g} s is outside the trace (0 to {ts[-1] if n else 0:g} s)")
    start = int(np.searchsorted(ts, scenario.at_s, side="left"))
    end = int(np.searchsorted(ts, scenario.at_s + scenario.window_s, side="left"))
    rows = np.arange(end, dtype=np.int64)
    if scenario.kind == "scale-out":
        routed = np.random.default_rng(scenario.seed).random(n) < scenario.share
        rows = rows[routed[:end]]
    return _Plan(start, rows[rows >= start], rows, (scenario.at_s, scenario.at_s + scenario.window_s))


def _make_cache(policy: Policy, capacity: int, index: BlockIndex, predictor: PredictorConfig,
                served: np.ndarray) -> LRUCache | BeladyCache | RetentionCache:
    if policy.eviction == "lru":
        return LRUCache(capacity)
    if policy.eviction == "belady":
        return BeladyCache(capacity, next_use(index, served))
    return RetentionCache(capacity, ReusePredictor(index, predictor))


def _prewarm(policy: Policy, index: BlockIndex, plan: _Plan, capacity: int, scenario: Scenario,
             predictor: PredictorConfig, planned: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    if policy.prewarm == "plan":
        assert planned is not None  # simulate() checks before any replay
        return planned_prewarm(planned, capacity), None
    if policy.prewarm == "naive":
        return naive_prewarm(index, plan.start, capacity, scenario.lookback_s), None
    if policy.prewarm == "kvwarm":
        return kvwarm_prewarm(index, plan.start, capacity, predictor)
    return oracle_prewarm(index, plan.start, plan.served, capacity), None


def _measure(name: str, index: BlockIndex, rows: np.ndarray, hits: np.ndarray, scenario: Scenario,
             window: tuple[float, float], cost: PrefillCost, reference: PolicyResult | None,
             prewarmed: np.ndarray | None, start: int, seconds: float) -> PolicyResult:
    tr = index.trace
    keep = tr.timestamps_s[rows] >= window[0]  # rows already end at the window's end
    rows, hits = rows[keep], hits[keep]
    cum = np.concatenate([[0], np.cumsum(index.tokens)])
    a = tr.offsets[rows]
    hit_tok = cum[a + hits] - cum[a]
    root_tok = np.where(tr.offsets[rows + 1] > a, index.tokens[np.minimum(a, len(index.tokens) - 1)], 0)
    total = tr.input_tokens[rows]
    hit_x = hit_tok - np.where(hits > 0, root_tok, 0)
    total_x = total - root_tok
    bucket = np.floor((tr.timestamps_s[rows] - window[0]) / scenario.bucket_s).astype(np.int64)
    n_buckets = int(bucket.max(initial=-1)) + 1
    num = np.bincount(bucket, weights=hit_x, minlength=n_buckets)
    den = np.bincount(bucket, weights=total_x, minlength=n_buckets)
    rates = np.divide(num, den, out=np.zeros(n_buckets), where=den > 0)
    per_bucket = tuple((float(k * scenario.bucket_s / 60.0), float(r)) for k, r in enumerate(rates))
    recover = None
    if reference is not None:
        ref = dict(reference.per_bucket)
        for minute, r in per_bucket:
            if r >= scenario.recovery_fraction * ref.get(minute, 0.0):
                recover = minute
                break
    precision = recall = None
    if prewarmed is not None:
        used = np.zeros(index.n_unique, dtype=bool)
        used[index.ids[_occurrences(index, rows)]] = True
        seen = np.zeros(index.n_unique, dtype=bool)
        seen[index.ids[: tr.offsets[start]]] = True
        good = int(used[prewarmed[prewarmed < index.n_unique]].sum())  # plan blocks the trace lacks never hit
        precision = good / len(prewarmed) if len(prewarmed) else 0.0
        possible = int((used & seen).sum())
        recall = good / possible if possible else 0.0
    saved = cost.seconds(hit_tok)
    ttft = cost.seconds(total, hit_tok)  # the uncached suffix's prefill; no queueing
    p50, p99 = np.percentile(ttft, [50, 99]) if len(ttft) else (0.0, 0.0)
    return PolicyResult(
        policy=name, requests=len(rows), tokens=int(total.sum()), hit_tokens=int(hit_tok.sum()),
        hit_rate=float(hit_tok.sum() / max(total.sum(), 1)),
        hit_rate_excl_root=float(hit_x.sum() / max(total_x.sum(), 1)),
        first_bucket_hit_rate_excl_root=float(rates[0]) if n_buckets else 0.0,
        minutes_to_recover=recover, prefill_tokens_saved=int(hit_tok.sum()),
        ttft_saved_s=float(saved.sum()), ttft_saved_mean_s=float(saved.mean()) if len(saved) else 0.0,
        ttft_p50_s=float(p50), ttft_p99_s=float(p99),
        prewarm_blocks=0 if prewarmed is None else len(prewarmed), warmup_precision=precision,
        warmup_recall=recall, per_bucket=per_bucket, seconds=seconds,
    )


def simulate(index: BlockIndex, capacity_blocks: int, scenario: Scenario, policies: Sequence[Policy | str],
             *, predictor: PredictorConfig = PredictorConfig(), cost: PrefillCost = PrefillCost(),
             plan_blocks: np.ndarray | None = None) -> SimResult:
    """Replay ``index``'s trace under each policy in ``scenario``; metrics over its window.

    The reference row (``no-event``) is LRU without the restart, or, for a scale-out, an
    LRU replica that received the same share of traffic from the start. ``plan_blocks``
    (:func:`forecasting.simulate.prewarm.plan_blocks`, most valuable first) is what the ``plan``
    prewarm loads.

    Raises:
        BadInputError: a bad capacity, event time or policy (prewarms need a restart or
            scale-out; the ``plan`` prewarm needs ``plan_blocks``).
    """
    if not isinstance(capacity_blocks, (int, np.integer)) or capacity_blocks < 1:
        raise BadInputError(f"capacity must be at least one block, got {capacity_blocks!r}")
    pols = [p if isinstance(p, Policy) else Policy.parse(p) for p in policies]
    if scenario.kind == "steady" and any(p.prewarm != "none" for p in pols):
        raise BadInputError("prewarm policies need an event to prewarm for: use --scenario restart or scale-out")
    if plan_blocks is None and any(p.prewarm == "plan" for p in pols):
        raise BadInputError("the plan prewarm needs a plan: pass --plan FILE (a kvwarm plan, docs/plan.md)")
    plan = _plan(index, scenario)
    reference = None
    if plan.reference is not None:
        t0 = time.perf_counter()
        hits = replay(index, LRUCache(int(capacity_blocks)), plan.reference)
        reference = _measure("no-event (lru)", index, plan.reference, hits, scenario, plan.window, cost, None,
                             None, plan.start, time.perf_counter() - t0)
    rows = []
    for policy in pols:
        t0 = time.perf_counter()
        cache = _make_cache(policy, int(capacity_blocks), index, predictor, plan.served)
        prewarmed = None
        if policy.prewarm != "none":
            prewarmed, scores = _prewarm(policy, index, plan, int(capacity_blocks), scenario, predictor,
                                         plan_blocks)
            if scores is None and isinstance(cache, RetentionCache):
                # Other prewarms have no reuse score: rank them just under a fresh, typical block.
                base = scenario.at_s / predictor.tau_s + math.log(predictor.prior_rate)
                scores = base - 1e-6 * np.arange(len(prewarmed), 0, -1)
            cache.load(prewarmed.tolist(), None if scores is None else scores.tolist())
        hits = replay(index, cache, plan.served)
        rows.append(_measure(policy.name, index, plan.served, hits, scenario, plan.window, cost, reference,
                             prewarmed, plan.start, time.perf_counter() - t0))
    return SimResult(scenario, int(capacity_blocks), plan.window, reference, tuple(rows))


def plot(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draw per-bucket hit rates (excluding the root block) of every row to a PNG at ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'kvwarm[pipeline]' (or matplotlib)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if result.reference is not None:
        xs, ys = zip(*result.reference.per_bucket) if result.reference.per_bucket else ((), ())
        ax.plot(xs, [100 * y for y in ys], "k--", label=result.reference.policy)
    for r in result.rows:
        if r.per_bucket:
            xs, ys = zip(*r.per_bucket)
            ax.plot(xs, [100 * y for y in ys], marker=".", label=r.policy)
    sc = result.scenario
    event = "start of trace" if sc.kind == "steady" else f"{sc.kind} at {sc.at_s:g} s"
    ax.set_xlabel(f"minutes since {event}")
    ax.set_ylabel("token hit rate excluding block 0 (%)")
    ax.set_title(title or f"{sc.kind}, {result.capacity_blocks} blocks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
