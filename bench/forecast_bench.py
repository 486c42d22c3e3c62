"""Forecast quality and off-peak choice on real traffic: ServeGen m-large (issue 5, done-when 2, 3, 5).

Each ServeGen client stands for a prefix family; hourly counts = rate x 600 summed
per hour. Train on days 1-11, test on days 12-14, forecasting 24 h ahead from each
test day's start (the history grows by a day each time). Clients with steady traffic
in training (at least half the hours non-zero and at least 10 requests an hour) are
scored by MASE, scaled by the in-sample daily seasonal naive error over days 1-11.

Side by side in one run: our per-series choice (forecasting.models.selection.forecast_series
with forecasting.models.catalog.candidates), seasonal naive (daily) and statsforecast's
AutoETS, on raw and on log1p counts (bench only; the package never imports
statsforecast). Then the off-peak check: each test day's contiguous 3-hour window of
lowest predicted total load against the day's true quietest 3 hours. Then the scale
check: 10,000 prefix series (clients split into prefixes) forecast on 2 processes.

    .venv/bin/python bench/forecast_bench.py            # full run
    .venv/bin/python bench/forecast_bench.py --quick    # smoke run, a few minutes

The last line printed is one JSON object with the figures, the targets and whether
each is met; it is also written to ``bench/results/forecast.json`` (``forecast-quick.json``
for --quick). Without statsforecast (the ``bench`` extra: ``make bench`` installs it)
the AutoETS rows are skipped with a note, and their check is left undecided.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.hierarchy import historical_shares, top_down  # noqa: E402
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.servegen import load_servegen  # noqa: E402
from forecasting.models.catalog import candidates, is_dense, sparse_models  # noqa: E402
from forecasting.models.parallel import forecast_frame_parallel  # noqa: E402
from forecasting.models.seasonal import SeasonalNaive  # noqa: E402
from forecasting.models.selection import forecast_series, mase_scale  # noqa: E402
from forecasting.planning.offpeak import load_predictors, pick_window, profile_path, regret  # noqa: E402

DAY = 24
TRAIN_DAYS = 11
TEST_DAYS = (11, 12, 13)  # 0-based: days 12, 13, 14 are forecast from histories of 11, 12, 13 days
VALID_DAYS = (8, 9, 10)  # a check inside the training period (days 9-11), not a target
OFFPEAK_VALID_DAYS = tuple(range(4, 11))  # days 5-11: the off-peak choice's settings were made here


def steady_mask(y: np.ndarray, train: int) -> np.ndarray:
    tr = y[:, :train]
    return ((tr > 0).mean(axis=1) >= 0.5) & (tr.mean(axis=1) >= 10)


def ours(h: np.ndarray) -> np.ndarray:
    return forecast_series(h, candidates, DAY).forecast.mean


def snaive(h: np.ndarray) -> np.ndarray:
    return SeasonalNaive(DAY).fit(h).forecast(DAY).mean


def autoets(log: bool):
    from statsforecast.models import AutoETS

    def f(h: np.ndarray) -> np.ndarray:
        x = np.log1p(h) if log else h.astype(np.float64)
        out = np.asarray(AutoETS(season_length=DAY).forecast(y=x, h=DAY)["mean"], dtype=np.float64)
        return np.clip(np.expm1(out) if log else out, 0.0, None)
    return f


def score(method, series: np.ndarray, days: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """MASE per series over ``days`` and seconds per fit (each fit timed)."""
    mases, times = [], []
    for y in series:
        scale = mase_scale(y[:days[0] * DAY], DAY)
        errs = []
        for d in days:
            t = time.perf_counter()
            fc = method(y[:d * DAY])
            times.append(time.perf_counter() - t)
            errs.append(np.abs(y[d * DAY:(d + 1) * DAY] - fc))
        mases.append(float(np.mean(errs)) / scale)
    return mases, times


def offpeak(total: np.ndarray, days: tuple[int, ...], length: int = 3) -> dict:
    """Regret of the window picked on each predictor, per test day; and the best any fixed
    daily schedule could do (one start hour for every test day, chosen knowing their loads)."""
    sources = load_predictors(DAY)
    static = profile_path(total[:TRAIN_DAYS * DAY], DAY, days=TRAIN_DAYS, quantile=0.5)
    res: dict[str, list[float]] = {"ours": [], "static_profile": [], "snaive": [], **{k: [] for k in sources}}
    chosen = []
    for d in days:
        hist, actual = total[:d * DAY], total[d * DAY:(d + 1) * DAY]
        s = pd.Series(hist, index=pd.date_range("2025-01-06", periods=hist.size, freq="h"))
        window, choice = pick_window(s, sources, length=length, period=DAY)
        j = (window.start - (s.index[-1] + pd.Timedelta(hours=1))) // pd.Timedelta(hours=1)
        best = np.convolve(actual, np.ones(length), "valid")
        res["ours"].append(float(best[j] / best.min() - 1))
        chosen.append(choice.name)
        res["static_profile"].append(regret(static, actual, length))
        res["snaive"].append(regret(hist[-DAY:], actual, length))
        for name, f in sources.items():
            res[name].append(regret(f(hist, DAY), actual, length))
    out = {k: {"mean": float(np.mean(v)), "per_day": [round(x, 4) for x in v]} for k, v in res.items()}
    out["ours"]["chosen_sources"] = chosen
    sums = np.array([np.convolve(total[d * DAY:(d + 1) * DAY], np.ones(length), "valid") for d in days])
    fixed = (sums / sums.min(axis=1, keepdims=True) - 1).mean(axis=0)
    out["hindsight_fixed_schedule"] = {"mean": float(fixed.min()), "start_hour": int(fixed.argmin())}
    return out


def print_offpeak(off: dict) -> None:
    for k, v in off.items():
        if "per_day" in v:
            print(f"  {k:16s} mean {v['mean'] * 100:5.1f} %  per day {[round(x * 100, 1) for x in v['per_day']]}",
                  flush=True)
    h = off["hindsight_fixed_schedule"]
    print(f"  best fixed daily schedule, chosen knowing these days (a ceiling for any schedule that does not"
          f" move): {h['mean'] * 100:.1f} % (start {h['start_hour']:02d}:00)", flush=True)


def split_into_prefixes(y: np.ndarray, ids: list[str], n_prefixes: int, seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """Each client's requests split among its prefixes by Zipf-like shares (binomial thinning, real arrivals)."""
    rng = np.random.default_rng(seed)
    per = max(1, -(-n_prefixes // len(ids)))
    counts = np.round(y).astype(np.int64)
    rows, mapping = [], {}
    ds = pd.date_range("2025-01-06", periods=y.shape[1], freq="h")
    for i, cid in enumerate(ids):
        shares = 1.0 / np.arange(1, per + 1) ** 1.2
        shares /= shares.sum()
        left = counts[i]
        rest = 1.0
        for k in range(per):
            p = min(shares[k] / rest, 1.0) if rest > 0 else 1.0
            part = rng.binomial(left, p) if k < per - 1 else left
            left = left - part
            rest -= shares[k]
            uid = f"{cid}/p{k}"
            mapping[uid] = cid
            rows.append(pd.DataFrame({"unique_id": uid, "ds": ds, "y": part.astype(np.float64)}))
    return pd.concat(rows, ignore_index=True), mapping


def scale_check(y: np.ndarray, ids: list[str], n_prefixes: int, workers: int, direct_dense: bool) -> dict:
    """``n_prefixes`` prefix series forecast a day ahead: directly, and as family forecasts split top-down."""
    train = (TRAIN_DAYS + 2) * DAY  # forecast the last day
    prefixes, mapping = split_into_prefixes(y, ids, n_prefixes)
    hist = prefixes[prefixes["ds"] < prefixes["ds"].min() + pd.Timedelta(hours=train)]
    actual = prefixes[prefixes["ds"] >= prefixes["ds"].min() + pd.Timedelta(hours=train)]
    act = actual.set_index(["unique_id", "ds"])["y"]

    def mae(fc: pd.DataFrame) -> float:
        f = fc.set_index(["unique_id", "ds"])["y_hat"].reindex(act.index)
        return float(np.mean(np.abs(f.to_numpy() - act.to_numpy())))

    out: dict = {"series": int(prefixes["unique_id"].nunique()), "families": len(ids), "workers": workers,
                 "dense_series": int(sum(is_dense(g["y"].to_numpy()) for _, g in hist.groupby("unique_id")))}
    t = time.perf_counter()
    direct = forecast_frame_parallel(hist, sparse_models(DAY), DAY, workers=workers, chunk=256)
    out["direct_numpy_s"], out["direct_numpy_mae"] = round(time.perf_counter() - t, 2), mae(direct)
    t = time.perf_counter()
    fam = hist.assign(unique_id=hist["unique_id"].map(mapping)).groupby(["unique_id", "ds"], as_index=False)["y"].sum()
    fam_fc = forecast_frame_parallel(fam, candidates, DAY, workers=workers, chunk=8)
    split = top_down(fam_fc, historical_shares(hist, mapping, window=7 * DAY))
    out["top_down_s"], out["top_down_mae"] = round(time.perf_counter() - t, 2), mae(split)
    if direct_dense:
        t = time.perf_counter()
        dense = forecast_frame_parallel(hist, candidates, DAY, workers=workers, chunk=128)
        out["direct_candidates_s"], out["direct_candidates_mae"] = round(time.perf_counter() - t, 2), mae(dense)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="the shared data folder")
    ap.add_argument("--quick", action="store_true", help="15 series, no validation period, 1,000-series scale check")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefixes", type=int, default=10_000, help="series in the scale check")
    ap.add_argument("--direct-dense", action="store_true",
                    help="also forecast every prefix directly with the statsmodels candidates (slow: ~12 min)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("forecast", __file__, sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore")
    t0 = time.time()
    load0 = os.getloadavg()[0]
    df = load_servegen(Path(args.data) / "traces" / "servegen-m-large")
    wide = df.pivot(index="unique_id", columns="ds", values="y")
    ids, y = list(wide.index), wide.to_numpy()
    mask = steady_mask(y, TRAIN_DAYS * DAY)
    series = y[mask]
    if args.quick:
        series = series[:15]
    print(f"ServeGen m-large: {len(ids)} clients, {y.shape[1] // DAY} days; steady clients scored: {len(series)}"
          f" (of {int(mask.sum())})", flush=True)

    methods = {"ours": ours, "seasonal_naive": snaive}
    has_statsforecast = importlib.util.find_spec("statsforecast") is not None
    if has_statsforecast:
        methods.update(autoets=autoets(False), autoets_log1p=autoets(True))
    else:
        print("statsforecast is not installed: the AutoETS comparison is skipped "
              "(`.venv/bin/pip install -e '.[bench]'` or `make bench` installs it)", flush=True)
    results: dict[str, dict] = {}
    for name, f in methods.items():
        m, t = score(f, series, TEST_DAYS)
        results[name] = {"median_mase": float(np.median(m)), "mean_mase": float(np.mean(m)),
                         "s_per_fit_median": float(np.median(t)), "s_per_fit_mean": float(np.mean(t))}
        print(f"  {name:16s} median MASE {results[name]['median_mase']:.3f}  mean {results[name]['mean_mase']:.3f}"
              f"  {results[name]['s_per_fit_median'] * 1000:7.1f} ms/fit (median)", flush=True)
    valid = {}
    if not args.quick:
        print("validation inside training (days 9-11 from days 1-8, 1-9, 1-10; not a target):", flush=True)
        for name in ("ours", "seasonal_naive"):
            m, _ = score(methods[name], series, VALID_DAYS)
            valid[name] = float(np.median(m))
            print(f"  {name:16s} median MASE {valid[name]:.3f}", flush=True)

    sn = results["seasonal_naive"]["median_mase"]
    ets = (min(results["autoets"]["median_mase"], results["autoets_log1p"]["median_mase"])
           if has_statsforecast else None)
    ours_m = results["ours"]["median_mase"]
    print("off-peak: each test day's 3-hour window of lowest predicted total load (regret = actual / best - 1):",
          flush=True)
    off = offpeak(y.sum(axis=0), TEST_DAYS)
    print_offpeak(off)
    off_valid = None
    if not args.quick:
        print("off-peak on days 5-11 (inside training; where PROFILE_DAYS and CHOICE_DAYS were chosen):", flush=True)
        off_valid = offpeak(y.sum(axis=0), OFFPEAK_VALID_DAYS)
        print_offpeak(off_valid)

    n_prefixes = 1000 if args.quick else args.prefixes
    print(f"scale: {n_prefixes} prefix series (clients split by Zipf shares), {args.workers} workers ...", flush=True)
    scale = scale_check(y, ids, n_prefixes, args.workers, args.direct_dense)
    print(f"  {scale['series']} series, {scale['dense_series']} dense, the rest sparse", flush=True)
    print(f"  direct, numpy models (naive, profiles, TSB, mean): {scale['direct_numpy_s']:.1f} s,"
          f" MAE {scale['direct_numpy_mae']:.2f}", flush=True)
    print(f"  family totals (all candidates) split top-down:      {scale['top_down_s']:.1f} s,"
          f" MAE {scale['top_down_mae']:.2f}", flush=True)
    if "direct_candidates_s" in scale:
        print(f"  direct, all candidates (statsmodels for dense):    {scale['direct_candidates_s']:.1f} s,"
              f" MAE {scale['direct_candidates_mae']:.2f}", flush=True)

    checks = {
        "mase_at_most_0.85x_seasonal_naive": ours_m <= 0.85 * sn,
        "mase_below_autoets": ours_m < ets if ets is not None else None,
        "under_1s_per_series_fit": results["ours"]["s_per_fit_median"] < 1.0,
        "offpeak_within_10pct": off["ours"]["mean"] <= 0.10,
        "10k_series_in_minutes": (max(scale["direct_numpy_s"], scale["top_down_s"]) < 600
                                  if scale["series"] >= 10_000 else None),
    }
    summary = {
        "bench": "forecast", "quick": args.quick, "series_scored": len(series), "test_days": [12, 13, 14],
        "mase": results, "autoets_skipped": not has_statsforecast,
        "statsforecast": importlib.metadata.version("statsforecast") if has_statsforecast else None, "ratio_to_seasonal_naive": ours_m / sn, "validation_median_mase": valid,
        "offpeak_regret": off, "offpeak_regret_days_5_11": off_valid, "scale": scale,
        "targets": {"mase_ratio_to_seasonal_naive": 0.85, "mase_below": "min(AutoETS raw, AutoETS log1p)",
                    "s_per_fit": 1.0, "offpeak_regret_mean": 0.10, "series": 10_000, "within_s": 600},
        "checks": checks, "all_pass": all(v for v in checks.values() if v is not None),
        "loadavg_start": load0, "loadavg_end": os.getloadavg()[0], "wall_s": round(time.time() - t0, 1),
    }
    against = f"AutoETS {ets:.3f}" if ets is not None else "AutoETS skipped"
    print(f"ours/seasonal naive = {ours_m / sn:.3f} (target <= 0.85); ours {ours_m:.3f} vs {against};"
          f" off-peak {off['ours']['mean'] * 100:.1f} % (target <= 10 %)")
    run.finish(summary, args.results, variant_of(args, partial=args.prefixes != 10_000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
