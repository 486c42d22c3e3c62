"""The replay bench's analyses: the shortfall diagnostic, the tuning grid and the ceiling curves.

Split out of :mod:`bench.replay_bench` (its ``--tune`` and ``--ceiling`` modes and the
per-restart diagnostic); the figure helpers here are shared with its evaluation.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench.lib import ceiling as calibration
from forecasting.simulate.prewarm import first_use_order, kvwarm_prewarm, oracle_prewarm, ranked_prewarm
from forecasting.simulate.replay import BlockIndex, LRUCache, PredictorConfig, replay
from forecasting.simulate.simulation import Scenario, SimResult, simulate

TUNE_FRACTIONS = (0.2, 0.4, 0.6, 0.8)  # --tune: other restart times
TUNE_STEADY = (2048, 8192)  # --tune: other capacities for the steady state
TUNE_GRID = tuple(PredictorConfig(horizon_s=h, tau_s=t, refresh_s=r)
                  for h in (120.0, 300.0, 600.0) for t in (150.0, 300.0, 600.0) for r in (15.0, 60.0))
TARGETS = {"prewarm": 0.70, "retention": 0.30}
NOISE_SDS = (1.0, 2.0, 3.0, 4.0)  # --ceiling: per-request error of the degraded oracle ranking
USED_WITHIN_S = 300.0  # --ceiling: a prewarmed block counts as useful if used this soon


def excl_root_rate(index: BlockIndex, rows: np.ndarray, hits: np.ndarray) -> float:
    """Token hit rate without each request's first block (``PolicyResult.hit_rate_excl_root``)."""
    tr = index.trace
    cum = np.concatenate([[0], np.cumsum(index.tokens)])
    a = tr.offsets[rows]
    root = np.where(tr.offsets[rows + 1] > a, index.tokens[np.minimum(a, len(index.tokens) - 1)], 0)
    hit = cum[a + hits] - cum[a] - np.where(hits > 0, root, 0)
    return float(hit.sum() / max((tr.input_tokens[rows] - root).sum(), 1))


def diagnose(index: BlockIndex, result: SimResult, capacity: int, predictor: PredictorConfig) -> dict[str, float]:
    """Split kvwarm's prewarm shortfall into its set and its order (reads the future: a diagnostic).

    Replays LRU prewarmed with kvwarm's blocks in the oracle's order (first use), and
    with the oracle's blocks in kvwarm's order; returns their hit rates excluding block 0.
    """
    ts = index.trace.timestamps_s
    start = int(np.searchsorted(ts, result.window[0], side="left"))
    served = np.arange(start, int(np.searchsorted(ts, result.window[1], side="left")), dtype=np.int64)
    ranked, _ = kvwarm_prewarm(index, start, index.n_unique, predictor)  # every block seen, least valuable first
    oracle = oracle_prewarm(index, start, served, capacity)
    loads = {"kvwarm_set_oracle_order": first_use_order(index, ranked[-capacity:], served),
             "oracle_set_kvwarm_order": ranked[np.isin(ranked, oracle)][-capacity:]}
    rates = {}
    for name, blocks in loads.items():
        cache = LRUCache(capacity)
        cache.load(blocks.tolist())
        rates[name] = excl_root_rate(index, served, replay(index, cache, served))
    return rates


def ratio(num: float, den: float) -> float | None:
    """``num / den``, or None when ``den`` is 0 (e.g. a short trace with no hit in the first minute)."""
    return num / den if den else None


def gap(value: float, low: float, high: float) -> float | None:
    return ratio(value - low, high - low)


def rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def fmt(x: float | None) -> str:
    """A fraction as a percentage for the printed lines ('n/a' when undefined)."""
    return "n/a" if x is None else f"{100 * x:.1f}"


def mean_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def tune(index: BlockIndex, args: argparse.Namespace) -> dict[str, object]:
    """Score each predictor setting on decision points outside the evaluation; pick one.

    Restarts at :data:`TUNE_FRACTIONS` (gap closed by ``lru+kvwarm`` and
    ``retention+kvwarm``) and the steady state at :data:`TUNE_STEADY` blocks (gap
    closed by retention). The choice maximises the mean, over the two unmet targets, of
    figure / target (prewarm with LRU, steady retention).
    """
    duration = index.trace.duration_s
    fractions = TUNE_FRACTIONS[1:2] if args.quick else TUNE_FRACTIONS
    steadies = TUNE_STEADY[:1] if args.quick else TUNE_STEADY
    grid = (PredictorConfig(), PredictorConfig(horizon_s=600.0, tau_s=600.0)) if args.quick else TUNE_GRID
    restarts = {f: Scenario("restart", at_s=f * duration, window_s=args.window) for f in fractions}
    base = {f: simulate(index, args.capacity, sc, ["lru", "lru+oracle"]) for f, sc in restarts.items()}
    steady_base = {c: simulate(index, c, Scenario("steady"), ["lru", "belady"]) for c in steadies}
    print(f"tuning on restarts at {', '.join(f'{int(f * 100)} %' for f in fractions)} and steady state at "
          f"{', '.join(map(str, steadies))} blocks (the evaluation uses 30/50/70 % and 4096 blocks)")
    print(f"{'horizon_s':>9}{'tau_s':>7}{'refresh_s':>10}{'lru+kvwarm':>12}{'ret+kvwarm':>12}{'retention':>11}"
          f"{'score':>8}")
    rows = []
    for cfg in grid:
        pre, both = [], []
        for f, sc in restarts.items():
            r = simulate(index, args.capacity, sc, ["lru+kvwarm", "retention+kvwarm"], predictor=cfg)
            cold, best = (base[f].row(p).hit_rate_excl_root for p in ("lru", "lru+oracle"))
            pre.append(gap(r.row("lru+kvwarm").hit_rate_excl_root, cold, best))
            both.append(gap(r.row("retention+kvwarm").hit_rate_excl_root, cold, best))
        ret = []
        for c in steadies:
            r = simulate(index, c, Scenario("steady"), ["retention"], predictor=cfg)
            lru, bel = (steady_base[c].row(p).hit_rate_excl_root for p in ("lru", "belady"))
            ret.append(gap(r.row("retention").hit_rate_excl_root, lru, bel))
        row = {"horizon_s": cfg.horizon_s, "tau_s": cfg.tau_s, "refresh_s": cfg.refresh_s,
               "prewarm_gap_closed.lru+kvwarm": mean_of(pre), "prewarm_gap_closed.retention+kvwarm": mean_of(both),
               "retention_gap_closed": mean_of(ret)}
        pre_m, ret_m = row["prewarm_gap_closed.lru+kvwarm"], row["retention_gap_closed"]
        row["score"] = mean_of([None if pre_m is None else pre_m / TARGETS["prewarm"],
                              None if ret_m is None else ret_m / TARGETS["retention"]])
        rows.append(row)
        score = "n/a" if row["score"] is None else f"{row['score']:.3f}"
        print(f"{cfg.horizon_s:>9g}{cfg.tau_s:>7g}{cfg.refresh_s:>10g}{fmt(pre_m):>11}%"
              f"{fmt(row['prewarm_gap_closed.retention+kvwarm']):>11}%{fmt(ret_m):>10}%{score:>8}")
    chosen = max(rows, key=lambda r: -float("inf") if r["score"] is None else r["score"])
    default = PredictorConfig()
    keys = ("horizon_s", "tau_s", "refresh_s")
    is_default = all(chosen[k] == getattr(default, k) for k in keys)
    print("chosen: " + ", ".join(f"{k}={chosen[k]:g}" for k in keys)
          + (f"{' (the default PredictorConfig)' if is_default else ' (differs from the default PredictorConfig)'}"))
    return {"fractions": list(fractions), "steady_capacities": list(steadies), "grid": [
        {k: rounded(v, 4) for k, v in r.items()} for r in rows], "chosen": {k: rounded(v, 4) for k, v in chosen.items()},
        "chosen_is_default": is_default}


def ceiling(index: BlockIndex, args: argparse.Namespace) -> dict[str, object]:
    """What ranking quality the targets need, on the tuning points (reads the future).

    Prewarm: gap closed and AUC ("used within :data:`USED_WITHIN_S`") of kvwarm's
    ranking and of the oracle's degraded by a per-request error (:data:`NOISE_SDS`).
    Retention: Belady's and retention's hits split into first and later reuses, and how
    well the classes predict a new block's reuse within 180 s (in-sample AUC).
    """
    fractions = TUNE_FRACTIONS[1:2] if args.quick else TUNE_FRACTIONS
    curves: dict[str, list[tuple[float, float | None]]] = {"kvwarm": []}
    for f in fractions:
        res = simulate(index, args.capacity, Scenario("restart", at_s=f * index.trace.duration_s,
                                                      window_s=args.window), ["lru", "lru+kvwarm", "lru+oracle"])
        ts = index.trace.timestamps_s
        start = int(np.searchsorted(ts, res.window[0], side="left"))
        served = np.arange(start, int(np.searchsorted(ts, res.window[1], side="left")), dtype=np.int64)
        cold, best = (res.row(p).hit_rate_excl_root for p in ("lru", "lru+oracle"))
        useful = calibration.first_use_delay(index, start, served) <= USED_WITHIN_S
        ranked, closed = kvwarm_prewarm(index, start, index.n_unique)
        curves["kvwarm"].append((calibration.ranking_auc(closed, useful[ranked]),
                                 gap(res.row("lru+kvwarm").hit_rate_excl_root, cold, best)))
        for sd in NOISE_SDS:
            blocks, closed = ranked_prewarm(index, start, calibration.noisy_oracle_scores(index, start, served, sd),
                                            index.n_unique)
            cache = LRUCache(args.capacity)
            cache.load(blocks[-args.capacity:].tolist())
            rate = excl_root_rate(index, served, replay(index, cache, served))
            curves.setdefault(f"oracle_error_sd{sd:g}", []).append((calibration.ranking_auc(closed, useful[blocks]),
                                                                   gap(rate, cold, best)))
    prewarm = {k: {"auc": rounded(mean_of([a for a, _ in v])), "gap_closed": rounded(mean_of([g for _, g in v]))}
               for k, v in curves.items()}
    noisy = sorted((v["gap_closed"], v["auc"]) for k, v in prewarm.items() if k != "kvwarm" and v["gap_closed"])
    needed = float(np.interp(TARGETS["prewarm"], *zip(*noisy))) if noisy else float("nan")
    print(f"prewarm ranking quality (AUC of 'used within {USED_WITHIN_S:g} s') against gap closed, restarts at "
          f"{', '.join(f'{int(f * 100)} %' for f in fractions)}; {TARGETS['prewarm']:.0%} needs AUC {needed:.3f}:")
    for k, v in prewarm.items():
        print(f"  {k:<22} AUC {v['auc']:.3f}  gap closed {fmt(v['gap_closed'])} %")
    retention = {}
    for c in TUNE_STEADY[:1] if args.quick else TUNE_STEADY:
        retention[str(c)] = split = calibration.steady_reuse_split(index, c)
        print(f"steady {c} blocks, hit blocks on a first / a later reuse: " + "; ".join(
            f"{k} {v['first_reuse']:,} / {v['later_reuse']:,}" for k, v in split.items()))
    auc_new = calibration.first_use_auc(index, 180.0)
    print(f"a new block's reuse within 180 s from its class (in-sample): AUC {auc_new:.3f}")
    return {"fractions": list(fractions), "prewarm": prewarm, "auc_needed_for_target": rounded(needed) if noisy
            else None, "retention_hits": retention, "first_use_auc_180s": rounded(auc_new)}
