"""The replay shaped like the deployment: policies side by side through restarts, replacements and scale-outs.

A :class:`Scenario` says what happens to the node under test:

- ``steady``: one node serves the whole trace;
- ``restart`` at ``T``: the engine restarts: vLLM's cache is emptied, the node tier survives;
- ``replacement`` at ``T``: a new node, with an empty node tier, takes all the traffic;
- ``scale-out`` at ``T``: a new node takes a random ``share`` of the requests.

S3 is shared by the fleet: with write-back, a block is there from the request after its
first use anywhere (:func:`forecasting.simulate.policies.written_back`). Every policy
(:mod:`forecasting.simulate.policies`) runs on the same :class:`Deployment`, and each
event's window is measured against the same policy without the event (the reference:
the node that kept running, or for a scale-out a node that had its share from the start).
:func:`simulate` returns one :class:`SimResult` per scenario; :func:`plot` draws it.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from forecasting.simulate.live_node import AgentRun
from forecasting.simulate.metrics import PolicyResult, measure
from forecasting.simulate.policies import (
    POLICIES,
    NodeRun,
    Planner,
    PlanTick,
    kvwarm_plans,
    make_node,
    prefill_blocks,
    prefill_gpu_s,
    start,
    stored_with_prefill,
    written_back,
)
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import NODE_TIER, S3_LINK_BYTES_PER_S, S3_STREAM, NodeShape, TierCosts
from store.config import KvCacheConfig, LoaderConfig
from store.cost import PrefillCost
from store.errors import BadInputError
from store.format.header import Layout
from store.format.payload import kv_bytes_per_token
from store.format.precision import Precision

SCENARIOS = ("steady", "restart", "replacement", "scale-out")


@dataclass(frozen=True)
class Scenario:
    """An event and its evaluation window (see the module docstring).

    Attributes:
        kind: one of :data:`SCENARIOS`.
        at_s: the event time, seconds from the trace start (ignored for steady).
        window_s: evaluation window after the event; steady evaluates the whole trace.
        share: the new node's traffic share (scale-out), routed at random with ``seed``.
        bucket_s: width of the per-minute series (and of the "first minute").
    """

    kind: str = "steady"
    at_s: float = 0.0
    window_s: float = 600.0
    share: float = 0.25
    seed: int = 0
    bucket_s: float = 60.0

    def __post_init__(self) -> None:
        if self.kind not in SCENARIOS:
            raise BadInputError(f"unknown scenario {self.kind!r}; choose one of {', '.join(SCENARIOS)}")
        if not 0 < self.share <= 1:
            raise BadInputError(f"share must be in (0, 1], got {self.share}")
        if self.window_s <= 0 or self.bucket_s <= 0:
            raise BadInputError("window_s and bucket_s must be positive")

    @property
    def name(self) -> str:
        return self.kind if self.kind == "steady" else f"{self.kind}@{self.at_s:g}s"


#: the engine the defaults describe: an 8B GQA model (Llama 3 8B: 32 layers, 8 KV heads of 128) on one H200
EIGHT_B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
#: what a token takes in vLLM's cache for that model (bf16 keys and values)
ENGINE_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: vLLM's KV cache on an H200: its 141 GB less the 16 GB of weights, activations and headroom
GPU_KV_BYTES = 100e9
#: kvwarm's node tier: 1 TB of the node's NVMe
NODE_BYTES = 1e12


def stored_bytes_per_token(block_tokens: int, precision: Precision | None = None) -> float:
    """What a token of the 8B geometry takes in kvwarm's store (default precision: FP8, layer 0 in bf16,
    fp32 scales), in blocks of ``block_tokens`` (the per-block scales make it depend on the block size)."""
    return kv_bytes_per_token(Layout(**EIGHT_B, block_size=block_tokens), precision or KvCacheConfig().precision())


@dataclass(frozen=True)
class Deployment:
    """What every policy runs on: the node's shape and the costs of its levels."""

    shape: NodeShape
    costs: TierCosts

    @classmethod
    def default(cls, block_tokens: int, *, gpu_kv_bytes: float = GPU_KV_BYTES, node_bytes: float = NODE_BYTES,
                write_back: bool = True, loader: LoaderConfig | None = None, prefill: PrefillCost | None = None,
                stored_per_token: float | None = None, s3_bytes_per_s: float = S3_LINK_BYTES_PER_S) -> Deployment:
        """The 8B model on an H200 with kvwarm's node tier and S3, at the calibrated costs.

        vLLM's cache holds ``gpu_kv_bytes`` of bf16 KV, the node tier ``node_bytes`` of
        stored blocks (``stored_per_token`` bytes a token, default the 8B geometry's in
        kvwarm's precision). The loader's settings (default: the config's ``loader``
        section) give the fetch mode, the plan prefetch's streams (``prefetch_streams``) and
        the background fetches' (``fetch_workers``); both share the node's S3 link of
        ``s3_bytes_per_s`` (default: the measured one, :data:`~forecasting.simulate.tiers.S3_LINK_BYTES_PER_S`).

        Raises:
            BadInputError: a capacity that holds no block.
        """
        loader = loader or LoaderConfig()
        per_token = stored_bytes_per_token(block_tokens) if stored_per_token is None else stored_per_token
        block_bytes = per_token * block_tokens
        gpu = int(gpu_kv_bytes // (block_tokens * ENGINE_KV_BYTES_PER_TOKEN))
        node = int(node_bytes // block_bytes)
        if gpu < 1 or node < 1:
            raise BadInputError(f"the engine's cache ({gpu_kv_bytes:g} bytes) and the node tier ({node_bytes:g} bytes) "
                                f"must each hold at least one block of {block_tokens} tokens")
        shape = NodeShape(gpu, node, write_back=write_back, fetch_mode=loader.fetch_mode,
                          sync_timeout_s=loader.sync_fetch_timeout_s)
        costs = TierCosts(prefill or PrefillCost(), NODE_TIER, S3_STREAM, block_bytes,
                          prefetch_streams=loader.prefetch_streams, fetch_streams=loader.fetch_workers,
                          s3_bytes_per_s=s3_bytes_per_s)
        return cls(shape, costs)


@dataclass(frozen=True)
class SimResult:
    """One scenario: a row per policy, and each policy's no-event reference (none for steady)."""

    scenario: Scenario
    window: tuple[float, float]
    rows: tuple[PolicyResult, ...]
    reference: dict[str, PolicyResult]

    def row(self, policy: str) -> PolicyResult:
        for r in self.rows:
            if r.policy == policy:
                return r
        raise KeyError(f"no row for policy {policy!r}; have {[r.policy for r in self.rows]}")

    def to_json(self) -> dict[str, Any]:
        return {"scenario": asdict(self.scenario), "window_s": list(self.window), "rows": [asdict(r) for r in self.rows],
                "reference": {k: asdict(v) for k, v in self.reference.items()}}

    def table(self) -> str:
        """A plain-text table, one line per policy (rates exclude each request's first block)."""
        head = (f"{'policy':<15}{'hit%':>6}{'excl0%':>7}{'vllm%':>6}{'node%':>6}{'s3%':>5}{'1st-min%':>9}"
                f"{'no-event':>9}{'TTFT ms':>8}{'p99 ms':>8}{'1st-min':>8}{'prefill s':>10}{'prec%':>6}{'rec%':>6}")
        lines = [head]
        for r in self.rows:
            ref = self.reference.get(r.policy)
            pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
            lines.append(
                f"{r.policy:<15}{100 * r.hit_rate:>6.1f}{100 * r.hit_rate_excl_root:>7.1f}"
                f"{100 * r.level_excl_root['gpu']:>6.1f}{100 * r.level_excl_root['node']:>6.1f}"
                f"{100 * r.level_excl_root['s3']:>5.1f}{100 * r.first_minute_hit_rate_excl_root:>9.1f}"
                f"{pct(ref.first_minute_hit_rate_excl_root if ref else None):>9}{1e3 * r.ttft_mean_s:>8.1f}"
                f"{1e3 * r.ttft_p99_s:>8.0f}{1e3 * r.first_minute_ttft_mean_s:>8.1f}{r.prefill_gpu_s:>10.1f}"
                f"{pct(r.warmup_precision):>6}{pct(r.warmup_recall):>6}")
        return "\n".join(lines)


def _window(index: BlockIndex, sc: Scenario) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows the node under test serves in the window, and (scale-out) the rows it would
    have served with its share from the start."""
    ts = index.trace.timestamps_s
    n = len(ts)
    if sc.kind == "steady":
        return np.arange(n, dtype=np.int64), None
    if not 0 <= sc.at_s <= (ts[-1] if n else 0):
        raise BadInputError(f"event time {sc.at_s:g} s is outside the trace (0 to {ts[-1] if n else 0:g} s)")
    a = int(np.searchsorted(ts, sc.at_s, side="left"))
    z = int(np.searchsorted(ts, sc.at_s + sc.window_s, side="left"))
    if sc.kind != "scale-out":
        return np.arange(a, z, dtype=np.int64), None
    routed = np.flatnonzero(np.random.default_rng(sc.seed).random(n) < sc.share)
    routed = routed[routed < z]
    return routed[routed >= a], routed


def simulate(index: BlockIndex, deployment: Deployment, scenarios: Sequence[Scenario],
             policies: Sequence[str] = POLICIES, *, planner: Planner | None = None, references: bool = True,
             ticks: Sequence[PlanTick] | None = None) -> list[SimResult]:
    """Run every policy through every scenario (see the module docstring).

    The node that serves the whole trace is run once per policy: it is the steady run
    and the no-event reference of restarts and replacements, and each restart forks it.
    ``references=False`` skips the no-event runs a replacement or scale-out does not need
    otherwise (tuning); ``ticks`` are kvwarm's plans when already made (:func:`kvwarm_plans`
    with the same planner), so several deployments can share them.

    Raises:
        BadInputError: an unknown policy or scenario, an event outside the trace, or
            ``kvwarm`` without a ``planner``.
    """
    for p in policies:
        if p not in POLICIES:
            raise BadInputError(f"unknown policy {p!r}; choose one of {', '.join(POLICIES)}")
    if "kvwarm" in policies and planner is None:
        raise BadInputError("the kvwarm policy needs the pipeline's planner (its plans at its cadence)")
    shape, costs = deployment.shape, deployment.costs
    ts = index.trace.timestamps_s
    windows = [_window(index, sc) for sc in scenarios]
    last = max((float(ts[int(w[-1])]) for w, _ in windows if len(w)), default=0.0)
    base = written_back(index) if shape.write_back else np.full(index.n_unique, len(ts) + 1, dtype=np.int64)
    stored, prefilled, done_s = base, np.zeros(0, dtype=np.int64), float("inf")
    plans: list[PlanTick] = []
    if "kvwarm" in policies:
        assert planner is not None
        prefilled, done_s = prefill_blocks(index, planner.base, planner.origin)
        stored_kv = stored_with_prefill(index, base, prefilled, done_s)
        plans = list(ticks) if ticks is not None else kvwarm_plans(index, planner, stored_kv, last)
    gpu_s = prefill_gpu_s(index, prefilled, base, done_s, planner.cost.prefill) if len(prefilled) else 0.0
    results: dict[tuple[int, str], PolicyResult] = {}
    refs: dict[tuple[int, str], PolicyResult] = {}
    for policy in policies:
        st = stored_with_prefill(index, base, prefilled, done_s) if policy == "kvwarm" else stored
        _run_policy(policy, index, shape, costs, st, plans, scenarios, windows, gpu_s if policy == "kvwarm" else 0.0,
                    results, refs, references)
    out = []
    for k, sc in enumerate(scenarios):
        window = (0.0, float(ts[-1])) if sc.kind == "steady" else (sc.at_s, sc.at_s + sc.window_s)
        out.append(SimResult(sc, window, tuple(results[(k, p)] for p in policies),
                             {p: refs[(k, p)] for p in policies if (k, p) in refs}))
    return out


def _run_policy(policy: str, index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
                ticks: list[PlanTick], scenarios: Sequence[Scenario], windows: list, gpu_s: float,
                results: dict, refs: dict, references: bool) -> None:
    ts = index.trace.timestamps_s
    n = len(ts)
    need_main = [k for k, sc in enumerate(scenarios)
                 if sc.kind in ("steady", "restart") or (references and sc.kind == "replacement")]
    forks: dict[int, NodeRun | AgentRun] = {}
    main_rows = np.arange(n, dtype=np.int64)
    main_served: list = []
    main_prefetched = 0
    if need_main:
        t0 = time.perf_counter()
        ends = [int(windows[k][0][-1]) + 1 if len(windows[k][0]) else 0 for k in need_main]
        upto = max(ends)
        main_rows = np.arange(upto, dtype=np.int64)
        run = make_node("reactive-store" if policy == "oracle" else policy, index, shape, costs, stored, main_rows,
                        ticks)
        cuts = sorted({int(windows[k][0][0]) for k, sc in enumerate(scenarios) if sc.kind == "restart"
                       and len(windows[k][0])})
        at = 0
        for cut in cuts + [upto]:
            main_served += run.serve(main_rows[at:cut])
            at = cut
            if cut in cuts:
                forks[cut] = run.fork()
        main_s = time.perf_counter() - t0
        main_prefetched = run.node.prefetcher.copied
    for k, sc in enumerate(scenarios):
        rows, routed = windows[k]
        t0 = time.perf_counter()
        spent = gpu_s  # the base plan's prefill job, run once before its window ends
        if sc.kind == "steady":
            results[(k, policy)] = measure(policy, index, rows, main_served[: len(rows)], start_s=0.0,
                                           bucket_s=sc.bucket_s, prefill_gpu_s=spent, seconds=main_s,
                                           prefetched_blocks=main_prefetched)
            continue
        if sc.kind == "restart":
            run = forks[int(rows[0])]
            run.node.restart()
        else:  # a new node: a replacement, or one that takes a share of the traffic
            # the fleet's other nodes: the replaced node served every row before the event; a
            # scale-out joins a fleet that served everything before it, and the rest after
            end = int(rows[-1]) + 1 if len(rows) else 0
            fleet = np.arange(int(rows[0]) if len(rows) else 0, dtype=np.int64) if sc.kind == "replacement" else \
                np.setdiff1d(np.arange(end, dtype=np.int64), rows)
            run = make_node(policy, index, shape, costs, stored, rows, ticks, fleet)
        before = run.node.prefetcher.copied
        warm, _ = start(policy, run, rows, sc.at_s)
        served = run.serve(rows)
        results[(k, policy)] = measure(policy, index, rows, served, start_s=sc.at_s, bucket_s=sc.bucket_s,
                                       warm=warm, stored_by=int(rows[0]) if len(rows) else None,
                                       prefill_gpu_s=spent, seconds=time.perf_counter() - t0,
                                       prefetched_blocks=run.node.prefetcher.copied - before)
        if not references:
            continue
        if sc.kind == "scale-out":
            ref_run = make_node("reactive-store" if policy == "oracle" else policy, index, shape, costs, stored,
                                routed, ticks)
            ref_served = ref_run.serve(routed)
            keep = routed >= (rows[0] if len(rows) else n)
            refs[(k, policy)] = measure(policy, index, routed[keep], [s for s, q in zip(ref_served, keep) if q],
                                        start_s=sc.at_s, bucket_s=sc.bucket_s)
        else:
            lo = int(rows[0]) if len(rows) else 0
            refs[(k, policy)] = measure(policy, index, rows, main_served[lo: lo + len(rows)], start_s=sc.at_s,
                                        bucket_s=sc.bucket_s)


def plot(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Per-minute hit rates (excluding the root block) of every policy, and kvwarm's no-event reference."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'kvwarm[pipeline]' (or matplotlib)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref = result.reference.get("kvwarm") or next(iter(result.reference.values()), None)
    if ref is not None and ref.per_bucket:
        xs, ys = zip(*ref.per_bucket)
        ax.plot(xs, [100 * y for y in ys], "k--", label=f"no event ({ref.policy})")
    for r in result.rows:
        if r.per_bucket:
            xs, ys = zip(*r.per_bucket)
            ax.plot(xs, [100 * y for y in ys], marker=".", label=r.policy)
    sc = result.scenario
    ax.set_xlabel("minutes since the start of the trace" if sc.kind == "steady" else f"minutes since the {sc.kind} "
                  f"at {sc.at_s:g} s")
    ax.set_ylabel("token hit rate excluding block 0 (%)")
    ax.set_title(title or sc.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
