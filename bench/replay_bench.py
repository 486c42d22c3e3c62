"""Replay benchmark: every cache policy on the full Mooncake conversation trace, side by side.

For restarts at 30 %, 50 % and 70 % of the trace (16k-block cache, the next 10 minutes)
and for the steady state at 4k blocks, it replays the trace under reactive LRU, LRU
prewarmed naively (the blocks with most requests in the 30 minutes before), LRU
prewarmed by kvwarm, LRU with the best possible prewarm (oracle), kvwarm's
forecast-informed retention (cold, and prewarmed by kvwarm) and Belady's offline
optimum, and prints token hit rates excluding block 0 (which every request shares),
first-minute hit rates, minutes to recover and warm-up precision/recall. A scale-out
(a new replica taking 25 % of the traffic at mid-trace) is informational.

It first checks that the figures already known for this trace (issue 7: cold LRU
19.7 %, naive prewarm 23.7 %, best prewarm 28.4 %, no restart 24.0 %, first minute
2.5 % / 23.0 %, steady 4k LRU 4.9 %, Belady 30.1 %) are reproduced within 0.3 points.

Targets (judged on the mean over the three restart times):

* kvwarm's prewarm closes >= 70 % of the gap between cold LRU and the best prewarm;
  judged for the prewarm alone (LRU eviction after it, ``lru+kvwarm``) and for the
  product (prewarm plus retention, ``retention+kvwarm``), reported separately;
* its first-minute hit rate is >= 95 % of the no-restart one;
* at 4k blocks, retention closes >= 30 % of the gap between LRU and Belady.

A diagnostic per restart (it reads the future, so it is no policy) splits kvwarm's
shortfall into its set and its order: LRU prewarmed with kvwarm's blocks in the
oracle's order (first use), and with the oracle's blocks in kvwarm's order.

Honesty: the restarts at 30/50/70 % and the 4k steady state are the evaluation. The
predictor's settings are chosen with ``--tune``, which scores a grid of
:class:`~forecasting.simulate.replay.PredictorConfig` on restarts at 20/40/60/80 % and on the
steady state at 2k and 8k blocks only, and prints its choice; the evaluation then runs
with ``PredictorConfig()`` (the chosen setting).

Hit rates are deterministic; timings are medians over ``--repeats`` runs. The last
line printed is one JSON object with every figure and whether each target is met
(``--tune``: the grid and the choice; ``--ceiling``: what ranking quality the targets
need, from :mod:`bench.lib.ceiling`, on the tuning points; it reads the future).

Usage::

    .venv/bin/python bench/replay_bench.py            # 20-40 s on 2 cores
    .venv/bin/python bench/replay_bench.py --quick    # one restart, one repeat
    .venv/bin/python bench/replay_bench.py --tune     # choose the settings (about 1 min)
    .venv/bin/python bench/replay_bench.py --ceiling  # how good a ranking the targets need (10 s)
    .venv/bin/python bench/replay_bench.py --data /path/to/shared/data --plots
    .venv/bin/python bench/replay_bench.py --trace other_mooncake.jsonl --out /tmp/replay
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.replay_analysis import (  # noqa: E402
    ceiling,
    diagnose,
    fmt,
    gap,
    mean_of,
    ratio,
    rounded,
    tune,
)
from bench.lib.timing import timed_median  # noqa: E402
from forecasting.ingest.traces import read_mooncake  # noqa: E402
from forecasting.simulate.replay import BlockIndex, PredictorConfig  # noqa: E402
from forecasting.simulate.simulation import STEADY_POLICIES, WARMUP_POLICIES, Scenario, SimResult, plot, simulate  # noqa: E402
from store.cost import PrefillCost  # noqa: E402

KNOWN = {  # issue 7, mid-trace restart, 16k blocks, 10 minutes; steady state at 4k blocks
    "restart50.lru": 19.7, "restart50.lru+naive": 23.7, "restart50.lru+oracle": 28.4, "restart50.no-event": 24.0,
    "restart50.first_min.lru": 2.5, "restart50.first_min.lru+naive": 23.0,
    "steady4k.lru": 4.9, "steady4k.belady": 30.1,
}


EVAL_FRACTIONS = (0.3, 0.5, 0.7)  # the evaluation: never used to choose a setting



def _pct(x: float) -> float:
    return round(100 * x, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="shared data directory")
    ap.add_argument("--trace", default=None, help="a Mooncake trace file (default: DATA/traces/mooncake/"
                    "conversation_trace.jsonl)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"), help="output directory (default bench/out)")
    ap.add_argument("--quick", action="store_true", help="the mid-trace restart only, one repeat")
    ap.add_argument("--tune", action="store_true", help="score predictor settings on restarts at 20/40/60/80 %% "
                    "and steady state at 2k/8k blocks (never the evaluation points) and print the choice")
    ap.add_argument("--ceiling", action="store_true", help="what ranking quality the targets need, on the tuning "
                    "points (reads the future)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions of each scenario (default 3)")
    ap.add_argument("--capacity", type=int, default=16384, help="cache blocks for the restarts (default 16384)")
    ap.add_argument("--steady-capacity", type=int, default=4096, help="cache blocks for steady state (default 4096)")
    ap.add_argument("--window", type=float, default=600.0, help="evaluation window after a restart, s")
    ap.add_argument("--plots", action="store_true", help="write PNGs under bench/out/ (needs matplotlib)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else max(1, args.repeats)
    path = Path(args.trace) if args.trace else Path(args.data) / "traces" / "mooncake" / "conversation_trace.jsonl"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    trace = read_mooncake(path)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = BlockIndex.build(trace)
    t_index = time.perf_counter() - t0
    print(f"trace: {path}: {len(trace)} requests, {trace.n_blocks} blocks, {trace.duration_s:.0f} s; "
          f"read {t_read:.2f} s, indexed {t_index:.2f} s")
    if args.tune:
        tuned = tune(index, args)
        print(json.dumps({"bench": "replay", "mode": "tune", "quick": args.quick, "trace": str(path),
                          "capacity_blocks": args.capacity, "window_s": args.window, **tuned},
                         separators=(",", ":")))
        return 0
    if args.ceiling:
        print(json.dumps({"bench": "replay", "mode": "ceiling", "quick": args.quick, "trace": str(path),
                          "capacity_blocks": args.capacity, **ceiling(index, args)}, separators=(",", ":")))
        return 0
    predictor = PredictorConfig()  # settings chosen by --tune (see docs/simulate.md)
    figures: dict[str, float] = {}
    results: dict[str, object] = {}
    timings: dict[str, float] = {}
    fractions = (0.5,) if args.quick else EVAL_FRACTIONS
    restarts: dict[float, SimResult] = {}
    diagnostics: dict[str, dict[str, float]] = {}
    for frac in fractions:
        scenario = Scenario("restart", at_s=frac * trace.duration_s, window_s=args.window)
        secs, result = timed_median(lambda: simulate(index, args.capacity, scenario, WARMUP_POLICIES,
                                                     predictor=predictor), repeats)
        restarts[frac] = result
        name = f"restart{int(frac * 100)}"
        timings[name] = round(secs, 3)
        print(f"\n== restart at {int(frac * 100)} % ({scenario.at_s:.0f} s), {args.capacity} blocks, "
              f"next {args.window / 60:g} min: {secs:.2f} s for {len(result.rows) + 1} replays (median)")
        print(result.table())
        for r in (result.reference, *result.rows):
            key = "no-event" if r is result.reference else r.policy
            figures[f"{name}.{key}"] = _pct(r.hit_rate_excl_root)
            figures[f"{name}.first_min.{key}"] = _pct(r.first_bucket_hit_rate_excl_root)
        results[name] = result.to_json()
        cold, best = (result.row(p).hit_rate_excl_root for p in ("lru", "lru+oracle"))
        diag = diagnose(index, result, args.capacity, predictor)
        diagnostics[name] = {k: rounded(gap(v, cold, best)) for k, v in diag.items()}
        print("diagnostic (reads the future): LRU + " + "; ".join(
            f"{k.replace('_', ' ')} {100 * v:.1f} % ({fmt(gap(v, cold, best))} % of the gap)"
            for k, v in diag.items()))
        if args.plots:
            plot(result, out_dir / f"replay-{name}.png")

    secs, steady = timed_median(lambda: simulate(index, args.steady_capacity, Scenario("steady"), STEADY_POLICIES,
                                                 predictor=predictor), repeats)
    timings["steady4k"] = round(secs, 3)
    print(f"\n== steady state, {args.steady_capacity} blocks, whole trace: {secs:.2f} s for 3 replays (median)")
    print(steady.table())
    for r in steady.rows:
        figures[f"steady4k.{r.policy}"] = _pct(r.hit_rate_excl_root)
    results["steady4k"] = steady.to_json()
    if args.plots:
        plot(steady, out_dir / "replay-steady4k.png")

    if not args.quick:
        scenario = Scenario("scale-out", at_s=0.5 * trace.duration_s, window_s=args.window, share=0.25)
        secs, scale = timed_median(lambda: simulate(index, args.capacity, scenario, WARMUP_POLICIES,
                                                    predictor=predictor), repeats)
        timings["scaleout50"] = round(secs, 3)
        print(f"\n== scale-out at 50 %: a new replica takes 25 % of requests (random routing), "
              f"{args.capacity} blocks, next {args.window / 60:g} min (informational)")
        print(scale.table())
        for r in (scale.reference, *scale.rows):
            key = "no-event" if r is scale.reference else r.policy
            figures[f"scaleout50.{key}"] = _pct(r.hit_rate_excl_root)
        results["scaleout50"] = scale.to_json()

    print("\n== known figures (issue 7) against this run")
    known = {}
    for key, want in KNOWN.items():
        got = figures.get(key)
        ok = got is not None and abs(got - want) <= 0.3
        known[key] = {"known": want, "ours": got, "reproduced": ok}
        print(f"{key:<34}known {want:5.1f}  ours {got if got is not None else float('nan'):5.1f}  "
              f"{'ok' if ok else 'DIFFERS'}")

    def gap_closed(policy: str) -> float | None:
        return mean_of([gap(res.row(policy).hit_rate_excl_root, res.row("lru").hit_rate_excl_root,
                           res.row("lru+oracle").hit_rate_excl_root) for res in restarts.values()])

    def first_min_ratio(policy: str) -> float | None:
        return mean_of([ratio(res.row(policy).first_bucket_hit_rate_excl_root,
                             res.reference.first_bucket_hit_rate_excl_root) for res in restarts.values()])

    # TTFT the prewarm saves per request in the window, over cold LRU (store.cost.PrefillCost: fitted to the H200 prefill bench).
    ttft_ms = {p: rounded(1e3 * mean_of([(res.row(p).ttft_saved_s - res.row("lru").ttft_saved_s) / max(res.row(p).requests, 1)
                                      for res in restarts.values()]), 1)
               for p in ("lru+naive", "lru+kvwarm", "retention+kvwarm", "lru+oracle")}
    full_ms = rounded(1e3 * float(PrefillCost().seconds(trace.input_tokens).mean()), 1)
    print("\n== TTFT saved per request in the window over cold LRU, mean of the restarts (8B on an H200: "
          "docs/simulate.md): " + ", ".join(f"{p} {v} ms" for p, v in ttft_ms.items())
          + f"; a request's whole prefill averages {full_ms} ms")
    # The write-up claims P99 latency -31 %: the modelled P99 TTFT, against cold LRU after a restart.
    p99 = {p: rounded(mean_of([res.row(p).ttft_p99_s for res in restarts.values()]), 3)
           for p in ("lru", "lru+naive", "lru+kvwarm", "retention+kvwarm", "lru+oracle")}
    p99["no-event"] = rounded(mean_of([res.reference.ttft_p99_s for res in restarts.values()]), 3)
    p99_change = {p: rounded(v / p99["lru"] - 1, 3) for p, v in p99.items() if p != "lru" and p99["lru"]}
    print("P99 TTFT in the window (model, mean of the restarts): " + ", ".join(f"{p} {v} s" for p, v in p99.items())
          + "; against cold LRU " + ", ".join(f"{p} {100 * v:+.1f} %" for p, v in p99_change.items()))
    lru4, bel4, ret4 = (steady.row(p).hit_rate_excl_root for p in ("lru", "belady", "retention"))
    targets = {
        "prewarm_gap_closed.lru+kvwarm": (gap_closed("lru+kvwarm"), 0.70),
        "prewarm_gap_closed.retention+kvwarm": (gap_closed("retention+kvwarm"), 0.70),
        "prewarm_gap_closed.lru+naive": (gap_closed("lru+naive"), None),
        "first_min_vs_no_restart.lru+kvwarm": (first_min_ratio("lru+kvwarm"), 0.95),
        "first_min_vs_no_restart.retention+kvwarm": (first_min_ratio("retention+kvwarm"), 0.95),
        "first_min_vs_no_restart.lru+naive": (first_min_ratio("lru+naive"), None),
        "retention_gap_closed_4k": (gap(ret4, lru4, bel4), 0.30),
    }
    print(f"\n== targets (mean over restarts at {', '.join(f'{int(f * 100)} %' for f in fractions)})")
    checks = {}
    for key, (value, target) in targets.items():
        met = None if target is None or value is None else value >= target
        checks[key] = {"value": rounded(value), "target": target, "met": met}
        verdict = ("informational" if target is None else "UNDEFINED" if value is None
                   else "MET" if met else "NOT MET")
        print(f"{key:<44}{fmt(value):>6} %   target {'-' if target is None else f'>= {100 * target:.0f} %':<9}"
              f" {verdict}")
    timings.update(read_s=round(t_read, 3), index_s=round(t_index, 3))
    total = sum(v for k, v in timings.items() if k not in ("read_s", "index_s"))
    diag_mean = {k: rounded(mean_of([d[k] for d in diagnostics.values()])) for k in next(iter(diagnostics.values()))}
    print(f"diagnostic, gap closed by LRU prewarmed with kvwarm's set in the oracle's order "
          f"{fmt(diag_mean['kvwarm_set_oracle_order'])} %, the oracle's set in kvwarm's order "
          f"{fmt(diag_mean['oracle_set_kvwarm_order'])} %")
    print(f"\nreplay time, every scenario and policy (medians summed): {total:.1f} s")
    (out_dir / "replay_bench.json").write_text(json.dumps(results, indent=1))
    summary = {"bench": "replay", "quick": args.quick, "trace": str(path), "requests": len(trace),
               "blocks": trace.n_blocks, "capacity_blocks": args.capacity, "steady_capacity_blocks":
               args.steady_capacity, "window_s": args.window, "repeats": repeats, "hit_rate_excl_block0_pct": figures,
               "known": known, "targets": checks, "ttft_saved_per_request_vs_cold_ms": ttft_ms,
               "prefill_per_request_mean_ms": full_ms, "ttft_p99_s": p99, "ttft_p99_vs_cold": p99_change,
               "predictor": asdict(predictor), "tuned_on": "restarts at 20/40/60/80 %, steady 2k/8k blocks (--tune)",
               "diagnostics_gap_closed": {"mean": diag_mean, **diagnostics}, "timings_s": timings,
               "replay_total_s": round(total, 2)}
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
