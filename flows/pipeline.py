"""The kvwarm pipeline as Prefect flows: mine -> forecast -> plan -> prefill -> GC (and audit) -> report.

One flow per stage, each runnable on its own (a deployment per stage) because every
stage reads its inputs from, and writes its results to, the run directory under the
store (:class:`prefill.rundir.RunDir`); the parent :func:`kvwarm_pipeline` runs them in
order. Every knob is a flow parameter, in the sections of :mod:`flows.spec`: each stage
takes the run's ``target`` and its own section(s), the parent one :class:`flows.spec.RunSpec`
and passes them down. Prefect validates them before the run starts, so a bad value
fails the run at once with the field named.

A stage whose input is bad fails with a :class:`flows.tasks.FlowInputError` (or the
package's typed error) naming what is wrong; the parent flow then ends failed with
that message. An S3 tier that does not answer fails prefill and GC, after their
retries, with :class:`flows.tasks.StoreUnreachable` ("S3 is unreachable ..."). Rerunning
a run is safe: prefill skips the blocks already stored.

Mining fans out over log partitions on the task runner its ``runner`` section names
(threads or Dask; :mod:`flows.partitions`) and mines their merged requests once.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import history, partitions
from flows import report as reports
from flows.audit import audit_task, publish_audit
from flows.cadence import plan_cadence
from flows.scheduling import schedule_prefill_task
from flows.shards import prefill_in_shards, shard_count, shard_task
from flows.spec import (
    AuditSpec,
    ForecastSpec,
    MiningSpec,
    MonitoringSpec,
    PlanSpec,
    PrefillSpec,
    RunnerSpec,
    RunSpec,
    RunTarget,
    default_run_name,
)
from flows.tasks import (
    FlowInputError,
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
from prefill.shards import Shard
from store.format.payload import kv_bytes_per_token
from store.plan import read_plan


@task(retries=2, retry_delay_seconds=1.0, retry_condition_fn=transient, cache_policy=NO_CACHE)
def _model_config(model: str) -> Any:
    from transformers import AutoConfig

    from prefill.models import resolve

    return AutoConfig.from_pretrained(str(resolve(model)))


@flow(name="mine-logs")
def mine_logs(target: RunTarget, mining: MiningSpec, runner: RunnerSpec = RunnerSpec()) -> str:
    """Read the request logs in ``[mining.start, mining.end)``, mine reused prefixes, persist the demand tables.

    Fans out over log partitions (``flows.partitions``): each file of a directory, or
    ``mining.slices`` time slices of one file, is read, validated and tokenised in a
    task submitted to the task runner ``runner`` names: ``threads`` (``parallelism``
    threads here) or ``dask`` (the cluster at ``dask_address``, else a temporary local
    cluster of ``parallelism`` worker processes). The partitions' requests are then
    merged and mined once, so the demand is exactly what one partition gives: candidate
    prefixes need every request's count, and the MinHash families need every prompt.

    Families group prompts at the MinHash LSH threshold ``mining.similarity`` when
    given, else the last measured run's threshold adapted by its hit rate, else the
    config's (:mod:`flows.history`). Returns the demand directory. Malformed log rows go
    to ``mining.quarantine`` (default the run's ``quarantine.jsonl``); ``mine.json``
    records each partition and where it ran, and the threshold with where it came from.
    """
    out = run_dir(target)
    config = flow_config(target)
    pool = partitions.task_runner(runner.task_runner, address=runner.dask_address, workers=runner.parallelism)
    logs, start, end = mining.logs, mining.start, mining.end
    qpath = mining.quarantine or str(out.quarantine)
    parts = list_partitions_task(logs, start, end, mining.slices, qpath)
    loaded = load_model_task(target.model)
    with pool:
        futures = [pool.submit(read_partition_task, {"partition": p, "tokenizer": loaded.tokenizer}) for p in parts]
        reads = [f.result() for f in futures]
    merged = partitions.merge_reads(reads, qpath)
    save_quarantine(merged.entries, qpath)
    if merged.requests.empty:
        raise FlowInputError(f"the logs {logs!r} hold no usable request in [{start or 'first'}, {end or 'last'}): "
                             f"{merged.report.summary()}. Fix the rows listed in {qpath} (each with its reason) "
                             f"or widen mining.start/mining.end")
    choice = history.choose_threshold(out, config.kv_cache.similarity_threshold, mining.similarity)
    get_run_logger().info(choice.describe())
    demand = mine_task(merged.requests, loaded, config, k=mining.k, bucket=mining.bucket, similarity=choice.threshold)
    path = save_demand(demand, out)
    report = merged.report
    save_json({"logs": logs, "start": start, "end": end, "read": report.summary(),
               "rows_used": report.rows_used, "rows_quarantined": report.rows_quarantined,
               "prefixes": int(len(demand.prefixes)), "families": int(demand.families["unique_id"].nunique()),
               "similarity": choice.as_dict(),
               "requests": float(demand.total["y"].sum()), "task_runner": runner.task_runner,
               "partitions": [r.summary() for r in reads]}, out.mine)
    get_run_logger().info("mined %d prefixes from %d requests in %d partition(s) on %s: %s", len(demand.prefixes),
                          report.rows_used, len(reads), runner.task_runner, report.summary())
    return str(path)


@flow(name="forecast-demand")
def forecast_demand(target: RunTarget, forecast: ForecastSpec = ForecastSpec()) -> str:
    """Forecast every prefix and the total load ``forecast.horizon`` buckets ahead; choose the off-peak window."""
    out = run_dir(target)
    demand = load_demand(out)
    bucket = str(demand.bucket)
    fc = forecast_task(demand.series, forecast.horizon, forecast.workers, bucket)
    total_fc = forecast_task(demand.total.assign(unique_id="total")[["unique_id", "ds", "y"]], forecast.horizon, 1,
                             bucket)
    window = window_task(total_fc, forecast.window_hours, forecast.offpeak_fraction, bucket,
                         total_history=demand.total)
    save_frame(fc, out.forecast)
    save_frame(total_fc, out.total_forecast)
    save_json(window, out.window)
    get_run_logger().info("forecast %d series; prefill window %s to %s", fc["unique_id"].nunique(),
                          window["chosen"]["start"], window["chosen"]["end"])
    return str(out.window)


@flow(name="plan-prewarm")
def plan_prewarm(target: RunTarget, plan: PlanSpec = PlanSpec()) -> str:
    """Choose what to prefill in the window under ``plan``'s budgets; write ``plan.json``.

    GPU seconds are budgeted at ``plan.prefill_tokens_per_s``, else the rate the store's
    most recent prefill of the model measured, else 2,000 tokens/s
    (:func:`flows.history.choose_prefill_rate`); the plan's ``extra.prefill_rate`` says which.

    ``plan.schedule_prefill``: a deployment name (``prefill-plan/NAME``) to schedule at
    the window's start with ``run_deployment`` (see :mod:`flows.scheduling`: once per run
    and window, with ``target`` and the window's end as the deadline; without a server or
    that deployment the deployment's cron schedule is the fallback and the plan flow
    still succeeds).
    """
    out = run_dir(target)
    config = flow_config(target)
    demand = load_demand(out)
    fc = pd.read_parquet(need(out.forecast, "forecast_demand"))
    window = json.loads(need(out.window, "forecast_demand").read_text())
    bpt = kv_bytes_per_token(kv_layout(_model_config(target.model), config.kv_cache.block_size),
                             config.kv_cache.precision())
    rate = history.choose_prefill_rate(out, target.model, plan.prefill_tokens_per_s)
    made = plan_task(demand, fc, window, config, model=target.model, tokens_per_s=rate.tokens_per_s,
                     bytes_per_token=bpt, budget_gpu_s=plan.budget_gpu_s, budget_store_bytes=plan.budget_store_bytes,
                     gpu_s_per_gib_hour=plan.gpu_s_per_gib_hour)
    made = dataclasses.replace(made, extra={**made.extra, "prefill_rate": rate.as_dict()})
    path = save_plan(made, out.plan, config)
    publish_latest_plan(made, target.store, config, target.model)
    get_run_logger().info("planned %d prefixes (%s)", len(made.entries), made.extra)
    if plan.schedule_prefill:
        schedule_prefill_task(target, window, plan.schedule_prefill)
    return str(path)


@flow(name="prefill-plan")
def prefill_plan(target: RunTarget, prefill: PrefillSpec = PrefillSpec(), deadline: float | None = None,
                 shard: Optional[Shard] = None) -> dict[str, Any]:
    """Prefill the run's plan into the store before ``deadline`` (Unix seconds); writes ``prefill.json``.

    ``deadline`` belongs to one window, not to the deployment: the plan stage sets it
    when it schedules this flow (:mod:`flows.scheduling`). With ``prefill.shards`` above
    1 (or ``auto``) this run is the parent of a sharded prefill (:mod:`flows.shards`):
    it runs each shard as a flow run of ``prefill.shard_deployment``, waits for all and
    fails, after all have ended, naming any shard that failed. ``shard`` (set by that
    parent) makes this run one shard: it writes ``prefill-shard-<i>.json``.
    """
    out = run_dir(target)
    config = flow_config(target)
    plan_path = need(out.plan, "plan_prewarm")
    if shard is not None:
        loaded = load_model_task(target.model, prefill.dtype, prefill.device)
        result = shard_task(plan_path, shard, loaded, target.store, config, deadline, prefill)
        save_json(result, out.shard_result(shard.index))
        get_run_logger().info("prefill shard %d/%d: %s", shard.index, shard.count, result)
        return result
    n = 1 if prefill.shards == 1 else shard_count(prefill)
    if n > 1:
        return prefill_in_shards(target, prefill, deadline, n, out, config, plan_path)
    loaded = load_model_task(target.model, prefill.dtype, prefill.device)
    result = prefill_task(plan_path, loaded, target.store, config, deadline, prefill.max_batch_tokens)
    save_json(result, out.prefill)
    get_run_logger().info("prefill: %s", result)
    return result


@flow(name="gc-store")
def gc_store(target: RunTarget, audit: AuditSpec = AuditSpec()) -> dict[str, Any]:
    """The store's maintenance: collect its garbage (expired snapshots, temp files, over-cap eviction), then,
    when ``audit.budget_gpu_s`` is above 0, audit its KV against ``target.model`` within that many compute
    seconds (:mod:`flows.audit`: copies that differ are quarantined; the counts go to the ``kvwarm-audit``
    table artifact and under ``audit`` in the result). Writes ``gc.json`` (and ``audit.json``) when a run is named.
    """
    config = flow_config(target)
    result = gc_task(target.store, config)
    if target.run is not None:
        save_json(result, run_dir(target).gc)
    if audit.budget_gpu_s > 0:
        loaded = load_model_task(target.model, audit.dtype, audit.device)
        result = {**result, "audit": audit_task(target.store, loaded, config, audit)}
        try:
            publish_audit(result["audit"])
        except Exception as e:  # noqa: BLE001 - an artifact is a convenience; the result and audit.json are the record
            get_run_logger().warning("could not publish the audit artifact: %s", e)
        if target.run is not None:
            save_json(result["audit"], run_dir(target).audit)
    return result


@flow(name="report")
def report(target: RunTarget, monitoring: MonitoringSpec = MonitoringSpec(), extra: dict[str, Any] | None = None,
           actual_total: list[list[Any]] | None = None) -> dict[str, Any]:
    """Summarise the run (``report.json``), draw the plots, publish markdown and table artifacts.

    ``extra``: sections to add (the demo's replay results); ``actual_total``: the held-out
    load as ``[[ds, y], ...]`` to draw against the forecast. The monitoring families
    (docs/guides/monitoring.md) are priced at ``monitoring.gpu_price_per_hour``, else the
    config's ``monitoring`` section, else ``$KVWARM_GPU_PRICE_PER_HOUR``.
    """
    out = run_dir(target)
    demand = load_demand(out)
    total_fc = pd.read_parquet(need(out.total_forecast, "forecast_demand"))
    fc = pd.read_parquet(need(out.forecast, "forecast_demand"))
    window = json.loads(need(out.window, "forecast_demand").read_text())
    plan = read_plan(need(out.plan, "plan_prewarm"))
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
    plots = {"forecast": str(reports.plot_forecast(demand.total, total_fc, out.forecast_plot, actual=actual,
                                                   prefix=prefix)),
             "offpeak": str(reports.plot_offpeak(demand.total, total_fc, window, out.offpeak_plot))}
    summary: dict[str, Any] = {"run": out.name}
    for name in ("mine", "prefill", "gc", "audit"):
        p = out.result(name)
        if p.exists():
            summary[name] = json.loads(p.read_text())
    summary["window"] = window["chosen"]
    summary["plan"] = {"entries": len(plan.entries), **plan.extra,
                       "expected_hits": float(sum(e.expected_hits for e in plan.entries))}
    summary.update({k: v for k, v in (extra or {}).items() if k != "actual_prefix"})
    if "monitoring" not in summary:  # the demo passes its own, priced
        priced = flow_config(target).monitoring
        price = monitoring.gpu_price_per_hour
        summary["monitoring"] = reports.monitoring_summary(
            out, summary, gpu_price_per_hour=priced.gpu_price_per_hour if price is None else price,
            prefill_tokens_per_s=priced.prefill_tokens_per_s)
    summary["plots"] = plots
    save_json(summary, out.report)
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown=reports.markdown(summary), key=f"kvwarm-{out.name}".lower().replace("_", "-"),
                                 description="kvwarm run report")
        reports.publish_monitoring(summary["monitoring"], out.name)
    except Exception as e:  # noqa: BLE001 - an artifact is a convenience; the report file is the record
        get_run_logger().warning("could not publish the report artifact: %s", e)
    return summary


@flow(name="kvwarm-pipeline")
def kvwarm_pipeline(spec: RunSpec) -> dict[str, Any]:
    """Mine the logs up to ``spec.mining.end``, forecast, plan the off-peak prefill, prefill, GC (and audit), report.

    With ``spec.stages.cadence`` it also makes one short plan at ``spec.mining.end``
    (:func:`flows.cadence.plan_cadence`) after the off-peak one.

    Each stage gets ``spec.target`` (named ``run-<UTC time>`` when it names no run) and
    its own sections of ``spec``. Returns ``run``, the run directory and the path of
    each stage's result.
    """
    target = spec.target if spec.target.run is not None else spec.target.with_run(default_run_name())
    out = run_dir(target)
    logs = spec.mining.logs
    if "://" not in logs and not Path(logs).exists():
        raise FlowInputError(f"logs path {logs!r} does not exist: pass the file or directory of request logs "
                             f"(JSONL or Parquet, docs/reference/logs.md)")
    result: dict[str, Any] = {"run": out.name, "dir": str(out.path)}
    result["demand"] = mine_logs(target, spec.mining, spec.runner)
    result["window"] = forecast_demand(target, spec.forecast)
    result["plan"] = plan_prewarm(target, spec.plan)
    if spec.stages.cadence:
        result["cadence_plan"] = plan_cadence(target, spec.mining, spec.cadence, as_of=spec.mining.end)
    if spec.stages.prefill:
        result["prefill"] = prefill_plan(target, spec.prefill)
    if spec.stages.gc:
        result["gc"] = gc_store(target, spec.audit)
    result["report"] = str(out.report)
    report(target, spec.monitoring)
    return result
