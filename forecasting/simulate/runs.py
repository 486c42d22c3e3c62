"""The replay's scenarios and how each policy's node is run through one (:func:`simulate`'s steps).

What S3 holds for the node under test (docs/guides/simulate.md, "S3 in a fleet"):

- the node's own write-back, as its uploads land (:mod:`forecasting.simulate.uploads`);
- for a **replacement**, what the node it replaces had uploaded by the event (its uploads
  still queued die with it);
- for a **scale-out**, the rest of the fleet: it served every request before the event and
  keeps serving the other share after it, and its write-back is in S3 from the request after
  each block's first full use among those requests (:func:`~forecasting.simulate.policies.written_back`);
- kvwarm's off-peak prefill, stored at its window's end.

A steady node, a restarted one and the node a replacement follows are alone: S3 has only
what they uploaded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from forecasting.simulate.live_node import AgentRun
from forecasting.simulate.metrics import PolicyResult, measure
from forecasting.simulate.oracle import oracle_served
from forecasting.simulate.policies import NodeRun, PlanTick, make_node, start, written_back
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import NodeShape, TierCosts
from store.errors import BadInputError

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


def window_rows(index: BlockIndex, sc: Scenario) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows the node under test serves in the window, and (scale-out) the rows it would
    have served with its share from the start.

    Raises:
        BadInputError: an event outside the trace.
    """
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


def _others(index: BlockIndex, own: np.ndarray, mine: np.ndarray, shape: NodeShape) -> np.ndarray:
    """``own`` (the node's S3 without any other node) with the rest of the fleet's write-back:
    every request but ``mine``."""
    if not shape.write_back:
        return own
    keep = np.ones(len(index.trace), dtype=bool)
    keep[mine] = False
    return np.minimum(own, written_back(index, np.flatnonzero(keep)))


def _main_upto(scenarios: Sequence[Scenario], windows: list) -> tuple[list[int], int]:
    need = [k for k, sc in enumerate(scenarios) if sc.kind in ("steady", "restart", "replacement")]
    ends = [int(windows[k][0][-1]) + 1 if len(windows[k][0]) else 0 for k in need]
    return need, max(ends, default=0)


def run_policy(policy: str, index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
               ticks: list[PlanTick], scenarios: Sequence[Scenario], windows: list, gpu_s: float,
               results: dict, refs: dict, references: bool, s3: dict[int, np.ndarray] | None = None) -> None:
    """Run ``policy`` through every scenario; its rows go in ``results`` and ``refs`` by
    ``(scenario index, policy)``. ``stored``: S3 without any node's write-back (kvwarm's prefill).
    ``s3`` (per scenario index) is lowered to what this policy's node under test found in S3 by
    the end of its window, per block (the oracle's S3 is the earliest of any policy's)."""
    s3 = {} if s3 is None else s3

    def seen(k: int, node_stored: np.ndarray) -> None:
        s3[k] = node_stored.copy() if k not in s3 else np.minimum(s3[k], node_stored)

    ts = index.trace.timestamps_s
    n = len(ts)
    need_main, upto = _main_upto(scenarios, windows)
    forks: dict[int, NodeRun | AgentRun] = {}
    main_served: list = []
    main_prefetched, main_s = 0, 0.0
    if need_main:
        t0 = time.perf_counter()
        main_rows = np.arange(upto, dtype=np.int64)
        run = make_node(policy, index, shape, costs, stored, main_rows, ticks)
        cuts = sorted({int(windows[k][0][0]) for k, sc in enumerate(scenarios)
                       if sc.kind in ("restart", "replacement") and len(windows[k][0])})
        at = 0
        for cut in cuts + [upto]:
            main_served += run.serve(main_rows[at:cut])
            at = cut
            if cut in cuts:
                forks[cut] = run.fork()
        main_s = time.perf_counter() - t0
        main_prefetched = run.node.prefetcher.copied
        main_stored = run.node.stored
    for k, sc in enumerate(scenarios):
        rows, routed = windows[k]
        t0 = time.perf_counter()
        spent = gpu_s  # the base plan's prefill job, run once before its window ends
        if sc.kind == "steady":
            results[(k, policy)] = measure(policy, index, rows, main_served[: len(rows)], start_s=0.0,
                                           bucket_s=sc.bucket_s, prefill_gpu_s=spent, seconds=main_s,
                                           prefetched_blocks=main_prefetched)
            if policy != "vllm":
                seen(k, main_stored)
            continue
        if sc.kind == "restart":
            run = forks[int(rows[0])].fork() if len(rows) else make_node(policy, index, shape, costs, stored, rows,
                                                                         ticks)
            run.node.land(sc.at_s)
            run.node.restart()
        elif sc.kind == "replacement":
            dead = forks[int(rows[0])].node.fork() if len(rows) else None
            if dead is not None:
                dead.land(sc.at_s)  # what its uploads landed by the event; the rest die with it
            # the replaced node served every request before the event: its records are the fleet's memory
            run = make_node(policy, index, shape, costs, dead.stored if dead is not None else stored, rows, ticks,
                            np.arange(int(rows[0]) if len(rows) else 0, dtype=np.int64))
        else:  # a scale-out: the rest of the fleet served every request before the event and the others after
            fleet = np.setdiff1d(np.arange(int(rows[-1]) + 1 if len(rows) else 0, dtype=np.int64), rows)
            run = make_node(policy, index, shape, costs, _others(index, stored, rows, shape), rows, ticks, fleet)
        before = run.node.prefetcher.copied
        warm, _ = start(policy, run, rows, sc.at_s)
        served = run.serve(rows)
        if policy != "vllm":
            seen(k, run.node.stored)
        results[(k, policy)] = measure(policy, index, rows, served, start_s=sc.at_s, bucket_s=sc.bucket_s,
                                       warm=warm, stored_by=int(rows[0]) if len(rows) else None,
                                       prefill_gpu_s=spent, seconds=time.perf_counter() - t0,
                                       prefetched_blocks=run.node.prefetcher.copied - before)
        if not references:
            continue
        if sc.kind == "scale-out":
            peers = np.setdiff1d(np.arange(int(routed[-1]) + 1 if len(routed) else 0, dtype=np.int64), routed)
            ref_run = make_node(policy, index, shape, costs, _others(index, stored, routed, shape), routed, ticks,
                                peers)
            ref_served = ref_run.serve(routed)
            keep = routed >= (rows[0] if len(rows) else n)
            refs[(k, policy)] = measure(policy, index, routed[keep], [s for s, q in zip(ref_served, keep) if q],
                                        start_s=sc.at_s, bucket_s=sc.bucket_s)
        else:
            lo = int(rows[0]) if len(rows) else 0
            refs[(k, policy)] = measure(policy, index, rows, main_served[lo: lo + len(rows)], start_s=sc.at_s,
                                        bucket_s=sc.bucket_s)


def run_oracle(index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
               scenarios: Sequence[Scenario], windows: list, results: dict, refs: dict, references: bool,
               s3: dict[int, np.ndarray] | None = None) -> None:
    """The oracle's rows (:mod:`forecasting.simulate.oracle`). Its S3 in scenario ``k`` is ``s3[k]``,
    the earliest any store policy's node found each block there (it had to be uploaded over a
    node's link, as theirs were), else ``stored``: the fleet's write-back the moment it is computed."""
    s3 = {} if s3 is None else s3
    need_main, upto = _main_upto(scenarios, windows)
    main_rows = np.arange(upto, dtype=np.int64)
    main: list = []
    if need_main:
        main = oracle_served(index, costs, shape.gpu_blocks, main_rows, history=main_rows, engine=main_rows,
                             stored=stored, start_s=0.0)
    for k, sc in enumerate(scenarios):
        rows, routed = windows[k]
        t0 = time.perf_counter()
        held = s3[k] if k in s3 else stored

        def bound(rows, history, engine, at, held=held):  # noqa: ANN001, ANN202
            return oracle_served(index, costs, shape.gpu_blocks, rows, history=history, engine=engine, stored=held,
                                 start_s=at)

        if sc.kind == "steady":
            served = bound(rows, rows, rows, 0.0) if k in s3 else main[: len(rows)]
            results[(k, "oracle")] = measure("oracle", index, rows, served, start_s=0.0, bucket_s=sc.bucket_s)
            continue
        lo = int(rows[0]) if len(rows) else 0
        if sc.kind == "restart":  # the tier kept all it had; the engine starts empty
            served = bound(rows, np.arange(lo + len(rows), dtype=np.int64), rows, 0.0)
        else:
            served = bound(rows, rows, rows, sc.at_s)
        results[(k, "oracle")] = measure("oracle", index, rows, served, start_s=sc.at_s, bucket_s=sc.bucket_s,
                                         seconds=time.perf_counter() - t0)
        if not references:
            continue
        if sc.kind == "scale-out":
            keep = routed >= (rows[0] if len(rows) else len(index.trace))
            ref = bound(routed, routed, routed, 0.0)
            refs[(k, "oracle")] = measure("oracle", index, routed[keep], [s for s, q in zip(ref, keep) if q],
                                          start_s=sc.at_s, bucket_s=sc.bucket_s)
        else:
            refs[(k, "oracle")] = measure("oracle", index, rows, main[lo: lo + len(rows)], start_s=sc.at_s,
                                          bucket_s=sc.bucket_s)
