"""The replay bench on traces nothing was tuned to: the suite of :mod:`bench.lib.trace_suite`.

Each trace (sparse 24-hour traffic with a night of silence, 32-token blocks, agent sessions)
is written by its deterministic generator and replayed as the Mooncake trace is: a restart,
a replacement and a scale-out at 30/50/70 % with the window after each (an event whose
window holds no request is left out and said so), and the steady state, at the default
deployment and S3 link, with the same policies and the same targets
(:func:`bench.lib.replay_analysis.targets`). On ``sparse-24h`` a replacement also comes as
the traffic returns after the longest idle period (``idle``: 6 hours or more), measured over
the hour after it: kvwarm must be no worse there than ``restore``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from bench.lib.replay_analysis import EVENTS, event_figures, rounded, summarise, targets
from bench.lib.trace_suite import TRACES, write_suite
from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import read_mooncake
from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
from forecasting.simulate.policies import POLICIES, kvwarm_plans, written_back
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import Deployment, Scenario, simulate

#: the idle event: at least this long a silence, and the window measured after it
IDLE_MIN_S, IDLE_WINDOW_S = 6 * 3600.0, 3600.0


def run_trace(path: Path, *, fractions: Sequence[float], window_s: float, share: float, cadence_s: float,
              idle: tuple[float, float] | None = None) -> dict[str, Any]:
    """One trace's events, summary and targets (the idle event and its target when ``idle`` is given)."""
    t0 = time.perf_counter()
    trace = read_mooncake(path)
    index = BlockIndex.build(trace)
    ts = trace.timestamps_s
    deployment = Deployment.default(trace.block_tokens)
    planner = planner_for(trace, requests_from_trace(trace), retain_spec(deployment), deployment, cadence_s=cadence_s)
    scs, skipped = [], []
    for f in fractions:
        for kind in EVENTS:
            sc = Scenario(kind, at_s=f * trace.duration_s, window_s=window_s, share=share)
            busy = ((ts >= sc.at_s) & (ts < sc.at_s + window_s)).sum()
            (scs if busy else skipped).append(sc)
    if idle is not None:
        scs.append(Scenario("replacement", at_s=idle[1] - 1.0, window_s=IDLE_WINDOW_S, share=share))
    scs.append(Scenario("steady"))
    ticks = kvwarm_plans(index, planner, written_back(index), trace.duration_s)
    events: dict[str, Any] = {}
    for sc, res in zip(scs, simulate(index, deployment, scs, POLICIES, planner=planner, ticks=ticks)):
        name = "idle" if idle is not None and sc.at_s == idle[1] - 1.0 and sc.kind == "replacement" else (
            "steady" if sc.kind == "steady" else f"{sc.kind}{round(100 * sc.at_s / trace.duration_s)}")
        events[name] = event_figures(res)
    kept = [f for f in fractions if all(f"{k}{int(100 * f)}" in events for k in EVENTS)]
    summary = summarise(events, kept) if kept else {"targets": targets(events, {}, [])}
    if idle is not None:
        got = events["idle"]["ttft_mean_ms"]
        worse = got["kvwarm"] - got["restore"]
        summary["targets"]["idle_ttft_above_restore_ms"] = {"value": rounded(worse), "target": 0.0,
                                                            "met": worse <= 0.0}
    return {"trace": str(path), "requests": len(trace), "block_tokens": trace.block_tokens,
            "duration_s": round(trace.duration_s, 1), "events": events,
            "skipped": [f"{sc.kind}@{sc.at_s:.0f}s (no request in its window)" for sc in skipped],
            "summary": {k: v for k, v in summary.items() if k != "targets"}, "targets": summary["targets"],
            "seconds": round(time.perf_counter() - t0, 1)}


def run_suite(out: Path, *, fractions: Sequence[float], window_s: float, share: float, cadence_s: float,
              names: Sequence[str] = TRACES) -> dict[str, Any]:
    """Write the suite under ``out`` and run every trace of ``names`` (see the module docstring)."""
    manifest = write_suite(out)
    got = {}
    for name in names:
        info = manifest["traces"][name]
        idle = info.get("longest_idle_s")
        idle = tuple(idle) if idle and name == "sparse-24h" and idle[1] - idle[0] >= IDLE_MIN_S else None
        got[name] = run_trace(out / info["file"], fractions=fractions, window_s=window_s, share=share,
                              cadence_s=cadence_s, idle=idle)
    return got
