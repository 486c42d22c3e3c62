"""The kvwarm pipeline as Prefect flows: mine -> forecast -> plan -> prefill -> GC -> report.

One flow per stage, each runnable on its own (a deployment per stage) because every
stage reads its inputs from, and writes its results to, the run directory under the
store (``<local tier>/_flows/<run>/``, see :mod:`flows.tasks`); the parent
:func:`kvwarm_pipeline` runs them in order. Every knob is a flow parameter.

A stage whose input is bad fails with a :class:`flows.tasks.FlowInputError` (or the
package's typed error) naming what is wrong; the parent flow then ends failed with
that message. An S3 tier that does not answer fails prefill and GC, after their
retries, with :class:`flows.tasks.StoreUnreachable` ("S3 is unreachable ..."). Rerunning
a run is safe: prefill skips the blocks already stored.

Mining fans out over log partitions on the task runner its parameters name (threads
or Dask; :mod:`flows.partitions`) and mines their merged requests once.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import history, partitions
from flows import report as reports
from flows.scheduling import schedule_prefill_task
from flows.tasks import (
    FlowInputError,
    check_bucket,
    flow_config,
    forecast_task,
    gc_task,
    list_partitions_task,
    load_demand,
    load_model_task,
    mine_task,
    need,
    plan_task,
    prefill_task,
    publish_latest_plan,
    read_partition_task,
    run_dir,
    save_demand,
    save_frame,
    save_json,
    save_plan,
    save_quarantine,
    transient,
    window_task,
)
from prefill.models import kv_layout
from store.format.payload import kv_bytes_per_token
from store.plan import read_plan

DEFAULT_MODEL = "kvwarm-tiny"


def _default_run() -> str:
    return time.strftime("run-%Y%m%dT%H%M%S", time.gmtime())


@task(retries=2, retry_delay_seconds=1.0, retry_condition_fn=transient, cache_policy=NO_CACHE)
def _model_config(model: str) -> Any:
    from transformers import AutoConfig

    from prefill.models import resolve

    return AutoConfig.from_pretrained(str(resolve(model)))


@flow(name="mine-logs")
def mine_logs(logs: str, store: str, run: str, config_path: str | None = None, model: str = DEFAULT_MODEL,
              block_size: int | None = None, bucket: str = "1h", k: int = 3, start: str | None = None,
              end: str | None = None, similarity: float | None = None, quarantine: str | None = None,
              task_runner: str = "threads", dask_address: str | None = None, parallelism: int = 2,
              slices: int = 1) -> str:
    """Read the request logs in ``[start, end)``, mine reused prefixes, persist the demand tables.

    Fans out over log partitions (``flows.partitions``): each file of a directory, or
    ``slices`` time slices of one file, is read, validated and tokenised in a task
    submitted to the task runner named by ``task_runner``: ``threads`` (``parallelism``
    threads here) or ``dask`` (the cluster at ``dask_address``, else a temporary local
    cluster of ``parallelism`` worker processes). The partitions' requests are then
    merged and mined once, so the demand is exactly what one partition gives: candidate
    prefixes need every request's count, and the MinHash families need every prompt.

    Families group prompts at the MinHash LSH threshold ``similarity`` when given, else
    the last measured run's threshold adapted by its hit rate, else the config's
    (:mod:`flows.history`). Returns the demand directory. Malformed log rows go to
    ``quarantine`` (default ``<run>/quarantine.jsonl``); ``mine.json`` records each
    partition and where it ran, and the threshold with where it came from.
    """
    out = run_dir(store, run)
    config = flow_config(config_path, block_size)
    check_bucket(bucket)
    runner = partitions.task_runner(task_runner, address=dask_address, workers=parallelism)
    qpath = quarantine or str(out / "quarantine.jsonl")
    parts = list_partitions_task(logs, start, end, slices, qpath)
    loaded = load_model_task(model)
    with runner:
        futures = [runner.submit(read_partition_task, {"partition": p, "tokenizer": loaded.tokenizer}) for p in parts]
        reads = [f.result() for f in futures]
    merged = partitions.merge_reads(reads, qpath)
    save_quarantine(merged.entries, qpath)
    if merged.requests.empty:
        raise FlowInputError(f"the logs {logs!r} hold no usable request in [{start or 'first'}, {end or 'last'}): "
                             f"{merged.report.summary()}. Fix the rows listed in {qpath} (each with its reason) "
                             f"or widen start/end")
    choice = history.choose_threshold(out, config.kv_cache.similarity_threshold, similarity)
    get_run_logger().info(choice.describe())
    demand = mine_task(merged.requests, loaded, config, k=k, bucket=bucket, similarity=choice.threshold)
    path = save_demand(demand, out / "demand")
    report = merged.report
    save_json({"logs": logs, "start": start, "end": end, "read": report.summary(),
               "rows_used": report.rows_used, "rows_quarantined": report.rows_quarantined,
               "prefixes": int(len(demand.prefixes)), "families": int(demand.families["unique_id"].nunique()),
               "similarity": choice.as_dict(),
               "requests": float(demand.total["y"].sum()), "task_runner": task_runner,
               "partitions": [r.summary() for r in reads]}, out / "mine.json")
    get_run_logger().info("mined %d prefixes from %d requests in %d partition(s) on %s: %s", len(demand.prefixes),
                          report.rows_used, len(reads), task_runner, report.summary())
    return str(path)


@flow(name="forecast-demand")
def forecast_demand(store: str, run: str, horizon: int = 24, workers: int = 1, window_hours: float = 3.0,
                    offpeak_fraction: float = 0.6) -> str:
    """Forecast every prefix and the total load ``horizon`` buckets ahead; choose the off-peak window."""
    out = run_dir(store, run)
    demand = load_demand(out / "demand")
    bucket = str(demand.bucket)
    fc = forecast_task(demand.series, horizon, workers, bucket)
    total_fc = forecast_task(demand.total.assign(unique_id="total")[["unique_id", "ds", "y"]], horizon, 1, bucket)
    window = window_task(total_fc, window_hours, offpeak_fraction, bucket, total_history=demand.total)
    save_frame(fc, out / "forecast.parquet")
    save_frame(total_fc, out / "total_forecast.parquet")
    save_json(window, out / "window.json")
    get_run_logger().info("forecast %d series; prefill window %s to %s", fc["unique_id"].nunique(),
                          window["chosen"]["start"], window["chosen"]["end"])
    return str(out / "window.json")


@flow(name="plan-prewarm")
def plan_prewarm(store: str, run: str, config_path: str | None = None, model: str = DEFAULT_MODEL,
                 block_size: int | None = None, prefill_tokens_per_s: float | None = None,
                 budget_gpu_s: float = 3600.0, budget_store_bytes: float = float(1 << 30),
                 gpu_s_per_gib_hour: float = 0.5, schedule_prefill: str | None = None) -> str:
    """Choose what to prefill in the window; write ``plan.json``.

    GPU seconds are budgeted at ``prefill_tokens_per_s``, else the rate the store's most
    recent prefill of ``model`` measured, else 2,000 tokens/s (:func:`flows.history.
    choose_prefill_rate`); the plan's ``extra.prefill_rate`` says which.

    ``schedule_prefill``: a deployment name (``prefill-plan/NAME``) to schedule at the
    window's start with ``run_deployment`` (see :mod:`flows.scheduling`: once per run and
    window, with the window's end as the deadline; without a server or that deployment
    the deployment's cron schedule is the fallback and the plan flow still succeeds).
    """
    out = run_dir(store, run)
    config = flow_config(config_path, block_size)
    demand = load_demand(out / "demand")
    fc = pd.read_parquet(need(out / "forecast.parquet", "forecast_demand"))
    window = json.loads(need(out / "window.json", "forecast_demand").read_text())
    bpt = kv_bytes_per_token(kv_layout(_model_config(model), config.kv_cache.block_size), config.kv_cache.precision())
    rate = history.choose_prefill_rate(out, model, prefill_tokens_per_s)
    plan = plan_task(demand, fc, window, config, model=model, tokens_per_s=rate.tokens_per_s,
                     bytes_per_token=bpt, budget_gpu_s=budget_gpu_s, budget_store_bytes=budget_store_bytes,
                     gpu_s_per_gib_hour=gpu_s_per_gib_hour)
    plan = dataclasses.replace(plan, extra={**plan.extra, "prefill_rate": rate.as_dict()})
    path = save_plan(plan, out / "plan.json")
    publish_latest_plan(plan, store, config)
    get_run_logger().info("planned %d prefixes (%s)", len(plan.entries), plan.extra)
    if schedule_prefill:
        schedule_prefill_task(store, run, window, schedule_prefill,
                              parameters={"config_path": config_path, "model": model, "block_size": block_size})
    return str(path)


@flow(name="prefill-plan")
def prefill_plan(store: str, run: str, config_path: str | None = None, model: str = DEFAULT_MODEL,
                 block_size: int | None = None, deadline: float | None = None,
                 device: str | None = "cpu", dtype: str = "fp32") -> dict[str, Any]:
    """Prefill the run's plan into the store before ``deadline`` (Unix seconds); writes ``prefill.json``."""
    out = run_dir(store, run)
    config = flow_config(config_path, block_size)
    plan_path = need(out / "plan.json", "plan_prewarm")
    loaded = load_model_task(model, dtype, device)
    result = prefill_task(plan_path, loaded, store, config, deadline)
    save_json(result, out / "prefill.json")
    get_run_logger().info("prefill: %s", result)
    return result


@flow(name="gc-store")
def gc_store(store: str, config_path: str | None = None, block_size: int | None = None,
             run: str | None = None) -> dict[str, Any]:
    """Collect the store's garbage (expired snapshots, temp files, over-cap eviction)."""
    config = flow_config(config_path, block_size)
    result = gc_task(store, config)
    if run:
        save_json(result, run_dir(store, run) / "gc.json")
    return result


@flow(name="report")
def report(store: str, run: str, extra: dict[str, Any] | None = None,
           actual_total: list[list[Any]] | None = None, gpu_price_per_hour: float | None = None,
           config_path: str | None = None) -> dict[str, Any]:
    """Summarise the run (``report.json``), draw the plots, publish markdown and table artifacts.

    ``extra``: sections to add (the demo's replay results); ``actual_total``: the held-out
    load as ``[[ds, y], ...]`` to draw against the forecast. The monitoring families
    (docs/monitoring.md) are priced at ``gpu_price_per_hour``, else the config's
    ``monitoring`` section, else ``$KVWARM_GPU_PRICE_PER_HOUR``.
    """
    out = run_dir(store, run)
    demand = load_demand(out / "demand")
    total_fc = pd.read_parquet(need(out / "total_forecast.parquet", "forecast_demand"))
    fc = pd.read_parquet(need(out / "forecast.parquet", "forecast_demand"))
    window = json.loads(need(out / "window.json", "forecast_demand").read_text())
    plan = read_plan(need(out / "plan.json", "plan_prewarm"))
    actual = None
    if actual_total:
        actual = pd.DataFrame(actual_total, columns=["ds", "y"]).assign(ds=lambda d: pd.to_datetime(d["ds"]))
    prefix = None
    if plan.entries:
        top = max(plan.entries, key=lambda e: e.expected_hits)
        hist = demand.series[demand.series["unique_id"] == top.prefix_id]
        pf = fc[fc["unique_id"] == top.prefix_id]
        act = None
        if extra and "actual_prefix" in extra:
            act = pd.DataFrame(extra["actual_prefix"].get(top.prefix_id, []), columns=["ds", "y"])
            act["ds"] = pd.to_datetime(act["ds"])
        prefix = (f"{top.tenant}/{top.prefix_id[:10]}", hist, pf, act)
    plots = {"forecast": str(reports.plot_forecast(demand.total, total_fc, out / "forecast.png", actual=actual,
                                                   prefix=prefix)),
             "offpeak": str(reports.plot_offpeak(demand.total, total_fc, window, out / "offpeak.png"))}
    summary: dict[str, Any] = {"run": run}
    for name in ("mine", "prefill", "gc"):
        p = out / f"{name}.json"
        if p.exists():
            summary[name] = json.loads(p.read_text())
    summary["window"] = window["chosen"]
    summary["plan"] = {"entries": len(plan.entries), **plan.extra,
                       "expected_hits": float(sum(e.expected_hits for e in plan.entries))}
    summary.update({k: v for k, v in (extra or {}).items() if k != "actual_prefix"})
    if "monitoring" not in summary:  # the demo passes its own, priced
        priced = flow_config(config_path, None).monitoring
        summary["monitoring"] = reports.monitoring_summary(
            out, summary, gpu_price_per_hour=priced.gpu_price_per_hour if gpu_price_per_hour is None else gpu_price_per_hour,
            prefill_tokens_per_s=priced.prefill_tokens_per_s)
    summary["plots"] = plots
    save_json(summary, out / "report.json")
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown=reports.markdown(summary), key=f"kvwarm-{run}".lower().replace("_", "-"),
                                 description="kvwarm run report")
        reports.publish_monitoring(summary["monitoring"], run)
    except Exception as e:  # noqa: BLE001 - an artifact is a convenience; the report file is the record
        get_run_logger().warning("could not publish the report artifact: %s", e)
    return summary


@flow(name="kvwarm-pipeline")
def kvwarm_pipeline(logs: str, store: str, run: str | None = None, config_path: str | None = None,
                    model: str = DEFAULT_MODEL, block_size: int | None = None, bucket: str = "1h", k: int = 3,
                    start: str | None = None, train_end: str | None = None, horizon: int = 24, workers: int = 1,
                    window_hours: float = 3.0, offpeak_fraction: float = 0.6, prefill_tokens_per_s: float | None = None,
                    budget_gpu_s: float = 3600.0, budget_store_bytes: float = float(1 << 30),
                    gpu_s_per_gib_hour: float = 0.5, prefill: bool = True, gc: bool = True,
                    report_extra: dict[str, Any] | None = None, task_runner: str = "threads",
                    dask_address: str | None = None, gpu_price_per_hour: float | None = None) -> dict[str, Any]:
    """Mine the logs up to ``train_end``, forecast, plan the off-peak prefill, prefill, GC, report.

    ``task_runner``/``dask_address``: where mining's partition tasks run (see :func:`mine_logs`).
    ``gpu_price_per_hour``: for the report's economics (default: the config's ``monitoring`` section).
    Returns ``run``, the run directory and the path of each stage's result.
    """
    run = run or _default_run()
    out = run_dir(store, run)
    if "://" not in logs and not Path(logs).exists():
        raise FlowInputError(f"logs path {logs!r} does not exist: pass the file or directory of request logs "
                             f"(JSONL or Parquet, docs/logs.md)")
    result: dict[str, Any] = {"run": run, "dir": str(out)}
    result["demand"] = mine_logs(logs, store, run, config_path, model, block_size, bucket, k, start, train_end,
                                 task_runner=task_runner, dask_address=dask_address)
    result["window"] = forecast_demand(store, run, horizon, workers, window_hours, offpeak_fraction)
    result["plan"] = plan_prewarm(store, run, config_path, model, block_size, prefill_tokens_per_s, budget_gpu_s,
                                  budget_store_bytes, gpu_s_per_gib_hour)
    if prefill:
        result["prefill"] = prefill_plan(store, run, config_path, model, block_size)
    if gc:
        result["gc"] = gc_store(store, config_path, block_size, run)
    result["report"] = str(out / "report.json")
    report(store, run, report_extra, gpu_price_per_hour=gpu_price_per_hour, config_path=config_path)
    return result
