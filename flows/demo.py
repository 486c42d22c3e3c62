"""``python -m flows.demo --store file://DIR``: the whole pipeline on the bundled sample logs, then a replay.

1. Runs :func:`flows.pipeline.kvwarm_pipeline` (ephemeral Prefect, tiny model, local
   store) on every day of ``flows/data/sample_logs.jsonl.gz`` but the last: mine,
   forecast, choose the off-peak window of the last day, plan, prefill, GC, report.
2. Replays the requests the plan is for (from the end of the prefill window for the
   plan's longest TTL: the snapshots' lifetime) through :class:`store.loader.KVLoader`,
   as a serving node would, and prints the hit rate, the warm-up accuracy of the plan
   against what those requests actually used, the prefill saved (tokens, and seconds at
   the prefill rate measured by the run) and the paths of the plots.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pandas as pd  # noqa: E402

SAMPLE = Path(__file__).resolve().parent / "data" / "sample_logs.jsonl.gz"


def replay(requests: pd.DataFrame, *, store: str, config: Any, loaded: Any, model: str, pool_dir: Path) -> dict[str, Any]:
    """Look every request up in the store through a KVLoader per tenant; count hits and cached tokens."""
    from prefill.models import resolve
    from store.loader import KVLoader

    hits = lookups = cached = prompt_tokens = 0
    per_tenant: dict[str, dict[str, int]] = {}
    for tenant, rows in requests.groupby("tenant", sort=True):
        t = per_tenant.setdefault(str(tenant), {"requests": 0, "hits": 0, "cached_tokens": 0, "prompt_tokens": 0})
        with KVLoader(store, tenant=str(tenant), model=resolve(model), pool_bytes=256 << 20, config=config,
                      fetch_mode="sync", pool_dir=pool_dir / str(tenant)) as loader:
            for text in rows["prompt"]:
                ids = loaded.encode(text)
                hit = loader.lookup(ids)
                n = 0
                if hit is not None:
                    with hit:
                        n = int(hit.usable_tokens)
                lookups += 1
                hits += n > 0
                cached += n
                prompt_tokens += len(ids)
                t["requests"] += 1
                t["hits"] += n > 0
                t["cached_tokens"] += n
                t["prompt_tokens"] += len(ids)
    return {"requests": lookups, "requests_hit": hits, "request_hit_rate": hits / lookups if lookups else 0.0,
            "cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "token_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0, "per_tenant": per_tenant}


def run(store: str, *, logs: str = str(SAMPLE), run_name: str = "demo", block_size: int = 16,
        config_path: str | None = None, model: str = "kvwarm-tiny", window_hours: float = 3.0,
        workers: int = 1) -> dict[str, Any]:
    """Run the pipeline and the replay; print the report; return the figures."""
    from flows.pipeline import kvwarm_pipeline, report
    from flows.tasks import flow_config, load_model_task, mine_task, read_logs_task, run_dir
    from forecasting.accuracy import warmup_accuracy
    from store.plan import read_plan

    t0 = time.perf_counter()
    everything = read_logs_task.fn(logs, None, None, None).requests
    last_day = everything["timestamp"].max().floor("D")
    result = kvwarm_pipeline(logs, store, run=run_name, config_path=config_path, model=model, block_size=block_size,
                             train_end=str(last_day), window_hours=window_hours, workers=workers)
    out = run_dir(store, run_name)
    plan = read_plan(out / "plan.json")
    prefill = result.get("prefill", {})
    ws, we = pd.Timestamp(plan.window_start, unit="s"), pd.Timestamp(plan.window_end, unit="s")
    ttl = max((e.ttl_s or 0.0 for e in plan.entries), default=0.0) or 6 * 3600.0
    period_end = we + pd.Timedelta(seconds=ttl)

    config = flow_config(config_path, block_size)
    loaded = load_model_task.fn(model)
    test = everything[everything["timestamp"] >= last_day]
    target = test[(test["timestamp"] >= we) & (test["timestamp"] < period_end)]
    rep = replay(target, store=store, config=config, loaded=loaded, model=model, pool_dir=out / "pool")
    observed = mine_task.fn(test, loaded, config, k=1, bucket="1h")
    in_period = observed.series[(observed.series["ds"] >= we) & (observed.series["ds"] < period_end)]
    total_in_period = float(observed.total.loc[(observed.total["ds"] >= we) & (observed.total["ds"] < period_end), "y"].sum())
    acc = warmup_accuracy(plan, in_period, total_requests=total_in_period)
    rate = float(prefill.get("tokens_per_s") or 0.0)
    saved_s = rep["cached_tokens"] / rate if rate > 0 else float("nan")
    actual_prefix = {e.prefix_id: [[str(d), float(y)] for d, y in
                                   observed.series.loc[observed.series["unique_id"] == e.prefix_id, ["ds", "y"]].itertuples(index=False)]
                     for e in plan.entries}
    extra = {"replay": {k: v for k, v in rep.items() if k != "per_tenant"},
             "replay_period": {"start": str(we), "end": str(period_end)},
             "warmup_accuracy": acc.to_json(),
             "ttft_saved": {"prefill_tokens_saved": rep["cached_tokens"], "prefill_tokens_per_s": rate,
                            "seconds_saved": saved_s},
             "actual_prefix": actual_prefix}
    actual_total = [[str(d), float(y)] for d, y in observed.total[["ds", "y"]].itertuples(index=False)]
    summary = report(store, run_name, extra=extra, actual_total=actual_total)
    elapsed = time.perf_counter() - t0

    print()
    print(f"kvwarm demo: {len(everything)} requests over {everything['timestamp'].dt.floor('D').nunique()} days "
          f"from {logs}; trained on {len(everything) - len(test)} before {last_day:%Y-%m-%d}")
    print(f"  prefill window {ws:%Y-%m-%d %H:%M} to {we:%H:%M} UTC; plan: {len(plan.entries)} prefixes, "
          f"{prefill.get('blocks_written', 0)} blocks written ({prefill.get('tokens_computed', 0)} tokens at "
          f"{rate:.0f} tokens/s)")
    print(f"  replay {we:%m-%d %H:%M} to {period_end:%m-%d %H:%M} (the snapshots' TTL): {rep['requests']} requests")
    print(f"  hit rate: {rep['requests_hit']}/{rep['requests']} requests ({rep['request_hit_rate']:.1%}) got a hit; "
          f"{rep['cached_tokens']}/{rep['prompt_tokens']} prompt tokens served from cache ({rep['token_hit_rate']:.1%})")
    for tenant, t in rep["per_tenant"].items():
        print(f"    {tenant}: {t['hits']}/{t['requests']} requests hit, {t['cached_tokens']}/{t['prompt_tokens']} tokens")
    print(f"  warm-up accuracy: precision {acc.precision:.2f} (planned prefixes used), "
          f"recall {acc.recall:.2f} (requests that began with a planned prefix)")
    print(f"  TTFT saved: {rep['cached_tokens']} prefill tokens = {saved_s:.2f} s of prefill at the measured "
          f"{rate:.0f} tokens/s")
    print(f"  plots: {summary['plots']['forecast']}")
    print(f"         {summary['plots']['offpeak']}")
    print(f"  report: {out / 'report.json'} ({elapsed:.0f} s)")
    return {"plan_entries": len(plan.entries), "replay": rep, "accuracy": acc.to_json(), "seconds_saved": saved_s,
            "plots": summary["plots"], "prefill": prefill}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="file://./.kvwarm-demo", help="store URL (default: ./.kvwarm-demo)")
    p.add_argument("--logs", default=str(SAMPLE), help="request logs (default: the bundled sample)")
    p.add_argument("--run", default="demo", help="run name (results under <store>/_flows/<run>)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--config", help="kvwarm config file")
    p.add_argument("--model", default="kvwarm-tiny")
    p.add_argument("--window-hours", type=float, default=3.0)
    a = p.parse_args(argv)
    run(a.store, logs=a.logs, run_name=a.run, block_size=a.block_size, config_path=a.config, model=a.model,
        window_hours=a.window_hours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
