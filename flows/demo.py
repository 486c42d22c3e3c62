"""``python -m flows.demo --store file:///DIR``: the whole pipeline on the bundled sample logs, then a replay.

1. Runs :func:`flows.pipeline.kvwarm_pipeline` (ephemeral Prefect, tiny model, local
   store) on every day of ``flows/data/sample_logs.jsonl.gz`` but the last: mine,
   forecast, choose the off-peak window of the last day, plan, prefill, GC, report.
2. Replays the requests the plan is for (from the end of the prefill window for the
   plan's longest TTL: the snapshots' lifetime) through :class:`store.serving.loader.KVLoader`,
   as a serving node would, and prints the hit rate, the warm-up accuracy of the plan
   against what those requests actually used, the prefill saved (tokens, and seconds at
   the prefill rate measured by the run) and the paths of the plots.
3. The same requests go through a loader on a store that starts cold and gets each
   request's KV written back after it (a reactive cache): the baseline of ``hitrate.png``,
   which draws, per bucket of the replayed window, both token hit rates and the plan's
   warm-up accuracy (from ``replay_outcomes.parquet``, one row per request).
4. Each prewarmed loader's ``stats()`` is saved under ``<run>/loader_stats/``; the four
   monitoring families (:mod:`prefill.monitoring`) are computed from them and the run's
   files, added to the report and printed (``prefill report`` prints the same table).
5. A what-if (:func:`flows.whatif.whatif`): the logs replayed by ``prefill simulate``'s
   deployment-shaped replay, with a restart and a replacement at the window's end:
   ``vllm`` against ``reactive-store`` against ``kvwarm`` (the cadence flow's plans), in
   the printed report and a plot per event; it prints the command that reruns the
   replacement on the logs (``--format logs``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# the temporary server's start waits 20 s by default, too short on a small or busy machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

import pandas as pd  # noqa: E402

SAMPLE = Path(__file__).resolve().parent / "data" / "sample_logs.jsonl.gz"
#: the GPU price per hour the demo's economics assume when none is configured
ASSUMED_GPU_PRICE = 2.0


def replay(requests: pd.DataFrame, *, store: str, config: Any, loaded: Any, model: str, pool_dir: Path,
           plan: Any = None, cold_store: str | None = None, stats_dir: Path | None = None) -> dict[str, Any]:
    """Look every request up, in time order, through a KVLoader per tenant; count hits and cached tokens.

    ``plan``: the plan whose prefixes each request is matched against (token prefix, same
    tenant), for the warm-up accuracy over time. ``cold_store``: a store URL that starts
    empty and gets each request's KV written back after it is served (a reactive cache
    without prewarming: the baseline). ``stats_dir``: where to save each prewarmed loader's
    ``stats()`` (plus ``elapsed_s``, the seconds spent in its calls, and ``prompt_tokens``).

    Returns the totals, ``per_tenant`` and ``outcomes`` (one row per request, the columns
    of :data:`flows.report.OUTCOME_COLUMNS`).
    """
    from prefill.models import resolve
    from store.serving.loader import KVLoader

    entries = [e for e in (plan.entries if plan is not None else []) if e.token_ids and e.prefix_id]
    identity = resolve(model)
    loaders: dict[str, Any] = {}
    cold: dict[str, Any] = {}
    elapsed: dict[str, float] = {}
    per_tenant: dict[str, dict[str, int]] = {}
    rows: list[dict[str, Any]] = []
    writer = _cold_writer(cold_store, config)
    try:
        for ts, tenant, text in requests.sort_values("timestamp")[["timestamp", "tenant", "prompt"]].itertuples(
                index=False):
            tenant = str(tenant)
            if tenant not in loaders:
                loaders[tenant] = KVLoader(store, tenant=tenant, model=identity, pool_bytes=256 << 20, config=config,
                                           fetch_mode="sync", pool_dir=pool_dir / tenant)
                if writer is not None:
                    cold[tenant] = KVLoader(str(cold_store), tenant=tenant, model=identity, pool_bytes=256 << 20,
                                            config=config, fetch_mode="sync", pool_dir=pool_dir / "cold" / tenant)
            ids = loaded.encode(text)
            t0 = time.perf_counter()
            n = _served(loaders[tenant], ids)
            elapsed[tenant] = elapsed.get(tenant, 0.0) + time.perf_counter() - t0
            c = 0
            if writer is not None:
                c = _served(cold[tenant], ids)
                _write_back(writer, tenant, ids, loaded, config)
            planned = [e.prefix_id for e in entries if e.tenant == tenant and len(ids) >= len(e.token_ids)
                       and tuple(ids[:len(e.token_ids)]) == e.token_ids]
            rows.append({"timestamp": ts, "tenant": tenant, "prompt_tokens": len(ids), "cached_tokens": n,
                         "cold_cached_tokens": c, "planned": ",".join(planned)})
            t = per_tenant.setdefault(tenant, {"requests": 0, "hits": 0, "cached_tokens": 0, "prompt_tokens": 0})
            t["requests"] += 1
            t["hits"] += n > 0
            t["cached_tokens"] += n
            t["prompt_tokens"] += len(ids)
        if stats_dir is not None:
            _dump_stats(stats_dir, loaders, elapsed, per_tenant)
    finally:
        for loader in [*loaders.values(), *cold.values()]:
            loader.close()
        if writer is not None:
            writer.close()
    outcomes = pd.DataFrame(rows, columns=["timestamp", "tenant", "prompt_tokens", "cached_tokens",
                                           "cold_cached_tokens", "planned"])
    lookups, hits = len(outcomes), int((outcomes["cached_tokens"] > 0).sum())
    cached, prompt_tokens = int(outcomes["cached_tokens"].sum()), int(outcomes["prompt_tokens"].sum())
    return {"requests": lookups, "requests_hit": hits, "request_hit_rate": hits / lookups if lookups else 0.0,
            "cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "token_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
            "cold_cached_tokens": int(outcomes["cold_cached_tokens"].sum()),
            "cold_token_hit_rate": int(outcomes["cold_cached_tokens"].sum()) / prompt_tokens if prompt_tokens else 0.0,
            "per_tenant": per_tenant, "outcomes": outcomes}


def _served(loader: Any, ids: list[int]) -> int:
    """Prompt tokens the loader serves from cache for ``ids`` (0 on a miss)."""
    hit = loader.lookup(ids)
    if hit is None:
        return 0
    with hit:
        return int(hit.usable_tokens)


def _cold_writer(url: str | None, config: Any) -> Any:
    if url is None:
        return None
    from store.tiers.store import Store

    return Store.open(url, config)


def _write_back(store: Any, tenant: str, ids: list[int], loaded: Any, config: Any) -> None:
    """Store the KV of the request's whole blocks, as a serving node writing back what it computed would."""
    from prefill.warm import warm
    from store.plan import PlanEntry

    if len(ids) < config.kv_cache.block_size:
        return  # not one whole block: nothing to store
    warm([PlanEntry(tenant=tenant, token_ids=tuple(ids))], loaded=loaded, store=store, config=config)


def _dump_stats(directory: Path, loaders: dict[str, Any], elapsed: dict[str, float],
                per_tenant: dict[str, dict[str, int]]) -> None:
    """One ``<tenant>.json`` per loader: ``stats()`` plus ``elapsed_s`` and ``prompt_tokens`` (docs/guides/monitoring.md)."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.json"):
        old.unlink()
    for tenant, loader in loaders.items():
        dump = {**loader.stats(), "elapsed_s": elapsed[tenant], "prompt_tokens": per_tenant[tenant]["prompt_tokens"]}
        (directory / f"{tenant}.json").write_text(json.dumps(dump, indent=2, default=str))


def run(store: str, *, logs: str = str(SAMPLE), run_name: str = "demo", block_size: int = 16,
        config_path: str | None = None, model: str = "kvwarm-tiny", window_hours: float = 3.0,
        workers: int = 1, replay_bucket: str = "30min", gpu_price_per_hour: float | None = None) -> dict[str, Any]:
    """Run the pipeline and the replay; print the report; return the figures.

    ``replay_bucket``: the bucket of the hit-rate-over-time plot. ``gpu_price_per_hour``:
    for the economics (default ``$KVWARM_GPU_PRICE_PER_HOUR``, else an assumed 2.0).
    """
    from flows import report as reports
    from flows.pipeline import kvwarm_pipeline, report
    from flows.spec import ForecastSpec, MiningSpec, RunSpec, RunTarget
    from flows.tasks import flow_config, load_model_task, mine_task, read_logs_task, run_dir
    from flows.whatif import whatif
    from forecasting.planning.accuracy import warmup_accuracy
    from prefill.monitoring import PRICE_ENV, Prices, compute
    from prefill.report_cli import format_table
    from prefill.run_results import read_loader_stats, read_run
    from store.cost import PrefillCost
    from store.plan import read_plan

    t0 = time.perf_counter()
    everything = read_logs_task.fn(logs, None, None, None).requests
    last_day = everything["timestamp"].max().floor("D")
    target = RunTarget(store=store, run=run_name, config_path=config_path, model=model, block_size=block_size)
    result = kvwarm_pipeline(RunSpec(target=target, mining=MiningSpec(logs=logs, end=str(last_day)),
                                     forecast=ForecastSpec(window_hours=window_hours, workers=workers)))
    out = run_dir(target)
    plan = read_plan(out.plan)
    prefill = result.get("prefill", {})
    ws, we = pd.Timestamp(plan.window_start, unit="s"), pd.Timestamp(plan.window_end, unit="s")
    config = flow_config(target)
    # the replay runs as long as the longest-lived snapshot the prefill wrote (the policy's longest, if none)
    kv = config.kv_cache
    ttl = max((kv.clamp_ttl(e.ttl_s) for e in plan.entries), default=kv.ttl_max_s)
    period_end = we + pd.Timedelta(seconds=ttl)

    loaded = load_model_task.fn(model)
    test = everything[everything["timestamp"] >= last_day]
    replayed = test[(test["timestamp"] >= we) & (test["timestamp"] < period_end)]
    shutil.rmtree(out.cold_store, ignore_errors=True)  # the baseline starts cold on every run
    rep = replay(replayed, store=store, config=config, loaded=loaded, model=model, pool_dir=out.pool, plan=plan,
                 cold_store=f"file://{out.cold_store}", stats_dir=out.loader_stats)
    outcomes = rep.pop("outcomes")
    outcomes.to_parquet(out.replay_outcomes, index=False)
    buckets = reports.replay_buckets(outcomes, replay_bucket, [e.prefix_id for e in plan.entries if e.prefix_id],
                                     start=we, end=period_end)
    hitrate_png = reports.plot_replay(buckets, out.hitrate_plot, bucket=replay_bucket,
                                      cold_label="cold store, each request's KV written back after it (reactive)")
    observed = mine_task.fn(test, loaded, config, k=1, bucket="1h")
    in_period = observed.series[(observed.series["ds"] >= we) & (observed.series["ds"] < period_end)]
    total_in_period = float(observed.total.loc[(observed.total["ds"] >= we) & (observed.total["ds"] < period_end), "y"].sum())
    acc = warmup_accuracy(plan, in_period, total_requests=total_in_period)
    rate, rate_from = float(prefill.get("tokens_per_s") or 0.0), "measured"
    budget = plan.extra.get("prefill_rate", {})
    if rate <= 0 and budget.get("source") == "measured":  # everything was stored already: nothing to time
        rate, rate_from = float(budget["tokens_per_s"]), f"run {budget['from_run']}'s measured"
    saved_s = PrefillCost.from_rate(rate).seconds(rep["cached_tokens"]) if rate > 0 else float("nan")
    actual_prefix = {e.prefix_id: [[str(d), float(y)] for d, y in
                                   observed.series.loc[observed.series["unique_id"] == e.prefix_id, ["ds", "y"]].itertuples(index=False)]
                     for e in plan.entries}
    what = whatif(everything, loaded.tokenizer, out.plan, logs=logs, block_size=config.kv_cache.block_size,
                  start=we, end=period_end, plot_dir=out.path)
    extra = {"replay": {k: v for k, v in rep.items() if k != "per_tenant"},
             "whatif": what,
             "replay_period": {"start": str(we), "end": str(period_end)},
             "warmup_accuracy": acc.to_json(),
             "ttft_saved": {"prefill_tokens_saved": rep["cached_tokens"], "prefill_tokens_per_s": rate,
                            "seconds_saved": saved_s},
             "actual_prefix": actual_prefix,
             "replay_plots": {"hitrate": str(hitrate_png)}}
    if gpu_price_per_hour is None and not os.environ.get(PRICE_ENV):
        gpu_price_per_hour = ASSUMED_GPU_PRICE
    dumps = read_loader_stats(out.loader_stats_files())
    monitoring = compute(run_name, read_run(out), dumps, Prices.from_env(gpu_price_per_hour))
    extra["monitoring"] = monitoring.as_dict()
    actual_total = [[str(d), float(y)] for d, y in observed.total[["ds", "y"]].itertuples(index=False)]
    summary = report(target, extra=extra, actual_total=actual_total)
    elapsed = time.perf_counter() - t0

    print()
    print(f"kvwarm demo: {len(everything)} requests over {everything['timestamp'].dt.floor('D').nunique()} days "
          f"from {logs}; trained on {len(everything) - len(test)} before {last_day:%Y-%m-%d}")
    print(f"  prefill window {ws:%Y-%m-%d %H:%M} to {we:%H:%M} UTC; plan: {len(plan.entries)} prefixes, "
          f"{prefill.get('blocks_written', 0)} blocks written ({prefill.get('tokens_computed', 0)} tokens at "
          f"{rate:.0f} tokens/s)")
    mined = json.loads(out.mine.read_text()).get("similarity", {})
    print(f"  families at LSH threshold {mined.get('threshold', float('nan')):.3g} ({mined.get('source', '?')}"
          f"{', from run ' + mined['from_run'] if mined.get('from_run') else ''}); GPU budget at "
          f"{budget.get('tokens_per_s', float('nan')):.0f} prefill tokens/s ({budget.get('source', '?')}"
          f"{', from run ' + budget['from_run'] if budget.get('from_run') else ''})")
    print(f"  replay {we:%m-%d %H:%M} to {period_end:%m-%d %H:%M} (the snapshots' TTL): {rep['requests']} requests")
    print(f"  hit rate: {rep['requests_hit']}/{rep['requests']} requests ({rep['request_hit_rate']:.1%}) got a hit; "
          f"{rep['cached_tokens']}/{rep['prompt_tokens']} prompt tokens served from cache ({rep['token_hit_rate']:.1%}); "
          f"a cold store with write-back: {rep['cold_cached_tokens']}/{rep['prompt_tokens']} "
          f"({rep['cold_token_hit_rate']:.1%})")
    for tenant, t in rep["per_tenant"].items():
        print(f"    {tenant}: {t['hits']}/{t['requests']} requests hit, {t['cached_tokens']}/{t['prompt_tokens']} tokens")
    print(f"  warm-up accuracy: precision {acc.precision:.2f} (planned prefixes used), "
          f"recall {acc.recall:.2f} (requests that began with a planned prefix)")
    print(f"  TTFT saved: {rep['cached_tokens']} prefill tokens = {saved_s:.2f} s of prefill at the {rate_from} "
          f"{rate:.0f} tokens/s")
    print(f"  what-if at {we:%H:%M} (prefill simulate: a {what['gpu_blocks']}-block vLLM cache over a "
          f"{what['node_blocks']}-block node tier over S3; kvwarm plans every {what['cadence_s'] / 60:g} min):")
    for kind in ("restart", "replacement"):
        got = what[kind]
        print(f"    {kind:<12}" + "; ".join(f"{p} {got[p]['hit_rate']:.1%} of tokens, TTFT {got[p]['ttft_mean_ms']:.1f} ms"
                                          for p in ("vllm", "reactive-store", "restore", "kvwarm"))
              + f" (no {kind}: {got['no-event']['hit_rate']:.1%})")
    live, restore = what["replacement"]["kvwarm"], what["replacement"]["restore"]
    print(f"    the live node after the replacement (the node agent, as the connector runs it): "
          f"{live['warmup_blocks'] or 0} blocks wanted from the latest plan and the fleet's memory, "
          f"{live['prefetched_blocks']} copied in the window, first-bucket hit rate "
          f"{live['first_bucket_hit_rate']:.1%} (restore: {restore['first_bucket_hit_rate']:.1%})")
    print(f"    rerun: {what['command']}")
    plots = {**summary["plots"], "hitrate": str(hitrate_png)}
    print(f"  plots: {plots['forecast']}")
    print(f"         {plots['offpeak']}")
    print(f"         {plots['hitrate']}")
    for kind, path in what["plots"].items():
        print(f"         {path}")
    print(f"  report: {out.report} ({elapsed:.0f} s)")
    print()
    print(format_table(monitoring))
    print(f"  (GPU price {monitoring.economics.gpu_price_per_hour} per hour: --gpu-price-per-hour or ${PRICE_ENV}; "
          f"the same table: prefill report --store {store} --run {run_name})")
    return {"plan_entries": len(plan.entries), "replay": rep, "whatif": what, "accuracy": acc.to_json(), "seconds_saved": saved_s,
            "plots": plots, "prefill": prefill, "monitoring": monitoring.as_dict(), "buckets": buckets}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="store URL (default: ./.kvwarm-demo, in the current directory)")
    p.add_argument("--logs", default=str(SAMPLE), help="request logs (default: the bundled sample)")
    p.add_argument("--run", default="demo", help="run name (results under <store>/_flows/<run>)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per block (default 16: the sample logs' prompts are short); replaces the "
                        "config's kv_cache.block_size")
    p.add_argument("--config", help="kvwarm config file")
    p.add_argument("--model", default="kvwarm-tiny")
    p.add_argument("--window-hours", type=float, default=3.0)
    p.add_argument("--replay-bucket", default="30min", help="bucket of the hit-rate-over-time plot (default 30min)")
    p.add_argument("--gpu-price-per-hour", type=float, default=None,
                   help=f"GPU price for the economics (default $KVWARM_GPU_PRICE_PER_HOUR, else {ASSUMED_GPU_PRICE})")
    a = p.parse_args(argv)
    store = a.store or f"file://{Path('.kvwarm-demo').resolve()}"  # a store URL names its directory absolutely
    run(store, logs=a.logs, run_name=a.run, block_size=a.block_size, config_path=a.config, model=a.model,
        window_hours=a.window_hours, replay_bucket=a.replay_bucket, gpu_price_per_hour=a.gpu_price_per_hour)
    return 0


if __name__ == "__main__":
    sys.exit(main())
