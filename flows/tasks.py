"""Prefect tasks: thin wrappers over the packages' functions, and the run directory they share.

Every stage persists what it produces in the run's directory under the store's first
(local) tier (:class:`prefill.rundir.RunDir` names it and every file in it), so that
each stage flow can run on its own (a deployment per stage) and a rerun reads what an
earlier stage wrote. The run directory is the pipeline's own: it holds the prompts (the
plan's, sealed per tenant where the tenant has an encryption key), while what serving
nodes read, the published plan, holds block keys only (:func:`publish_latest_plan`).

Retries are set only on tasks that do I/O (reading logs, loading the model, writing
files and the store); pure computations fail at once with the package's typed error.
An unreachable S3 tier ends the prefill and GC tasks, after their retries, with
:class:`StoreUnreachable`, whose message says so and what to check.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.partitions import Partition, PartitionRead, plan_partitions, where
from flows.spec import RunTarget
from forecasting.ingest.logs import Quarantined, RequestLog, read_logs
from forecasting.mining.demand import Demand, build_demand
from forecasting.mining.families import find_families
from forecasting.mining.prefix_tree import tokenize_requests
from forecasting.mining.request_tree import mine_requests
from forecasting.models.catalog import candidates
from forecasting.models.parallel import forecast_frame_parallel
from forecasting.planning.offpeak import load_predictors, lowest_window, offpeak_windows, pick_window
from forecasting.planning.planner import Budget, PlanCosts, PlanPolicy, make_plan
from prefill.rundir import DEMAND_TABLES, RunDir, RunDirError
from store.config import KvwarmConfig, load_config, parse_config
from store.cost import PrefillCost
from store.errors import BadInputError, OperationalError, StoreUnavailable
from store.plan import Plan, read_plan, write_plan
from store.plan_seal import config_keys, open_plan, seal_plan

IO_RETRIES = 2
IO_RETRY_DELAY_S = 1.0


class FlowInputError(BadInputError):
    """A flow parameter or a file a stage needs is missing or wrong; the message says which and what to do."""


class StoreUnreachable(OperationalError):
    """The store's S3 tier did not answer (retried: it may come back); the message names the endpoint."""


# ---------------------------------------------------------------- paths and config (pure)

def run_dir(target: RunTarget) -> RunDir:
    """Where ``target``'s run keeps its results (:meth:`prefill.rundir.RunDir.of`, which ``prefill report`` reads too).

    Raises:
        FlowInputError: the target names no run, or a store URL without a ``file://`` tier first.
    """
    if target.run is None:
        raise FlowInputError("target.run is not set: name the run whose files this stage reads and writes (every "
                             "stage of one run takes the same name)")
    try:
        return RunDir.of(target.store, target.run)
    except RunDirError as exc:
        raise FlowInputError(str(exc)) from None


def flow_config(target: RunTarget) -> KvwarmConfig:
    """The kvwarm config at ``target.config_path``, with ``kv_cache.block_size`` replaced when ``target`` sets one.

    Raises:
        ConfigError: the file is missing or has a bad value, or ``block_size`` is out of
            range (one line per bad key).
    """
    config = load_config(target.config_path)
    if target.block_size is None:
        return config
    data = config.model_dump()
    data["kv_cache"]["block_size"] = target.block_size
    return parse_config(data, source=f"{target.config_path or 'the defaults'} with target.block_size")


def need(path: Path, stage: str) -> Path:
    if not path.exists():
        raise FlowInputError(f"{path} does not exist: run the {stage} stage for this run first")
    return path


# ---------------------------------------------------------------- I/O tasks (retried)

def transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry I/O failures, never bad input (a retry cannot fix a wrong path or a bad plan)."""
    from forecasting.ingest.logs import LogError
    from prefill.runner import PrefillError
    from store.errors import ConfigError

    try:
        state.result()
    except (FlowInputError, LogError, ConfigError, ValueError, PrefillError):
        return False
    except Exception:  # noqa: BLE001 - anything else (OSError, S3 down) may pass
        return True
    return False

@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def read_logs_task(logs: str, quarantine: str | None, start: str | None, end: str | None) -> RequestLog:
    """Read the request logs in ``[start, end)`` (docs/reference/logs.md); malformed rows go to ``quarantine``."""
    if "://" not in logs and not Path(logs).exists():
        raise FlowInputError(f"logs path {logs!r} does not exist: pass the file or directory of request logs "
                             f"(JSONL or Parquet, docs/reference/logs.md)")
    return read_logs(logs, quarantine=quarantine, start=start, end=end)


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def list_partitions_task(logs: str, start: str | None, end: str | None, slices: int = 1,
                         skip: str | None = None) -> list[Partition]:
    """The log partitions to mine (``flows.partitions.plan_partitions``)."""
    return plan_partitions(logs, start=start, end=end, slices=slices, skip=skip)


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def read_partition_task(partition: Partition, tokenizer: Any) -> PartitionRead:
    """Read, validate and tokenise one partition's requests (runs on the flow's chosen task runner).

    Quarantine entries stay in the report (the flow writes one quarantine file for the run).
    """
    t0 = time.perf_counter()
    log = read_logs(partition.source, start=partition.start, end=partition.end)
    # A private copy: one fast tokenizer shared by threads can fail with "Already borrowed".
    requests = tokenize_requests(log.requests, copy.deepcopy(tokenizer))
    worker, pid = where()
    return PartitionRead(partition, requests, log.report, worker, pid, time.perf_counter() - t0)


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def save_quarantine(entries: tuple[Quarantined, ...], path: str) -> str:
    """Write the run's quarantine file (JSONL, one malformed row per line; empty when none), local or fsspec URL."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(p, "w", encoding="ascii") as fh:
        for entry in entries:
            fh.write(entry.to_json() + "\n")
    return path


def check_remote_tiers(store: Any) -> None:
    """Ask each remote tier of ``store`` one cheap question (a GET of a metadata name) before any work.

    A tier that is down then fails the task at once, instead of every probe and write
    of the job waiting out its own timeouts first. Raises :class:`StoreUnavailable`.
    """
    for tier in store.tiers:
        if tier is not store.local:
            tier.get_meta("reachable")


@contextlib.contextmanager
def s3_reachable(config: KvwarmConfig, what: str):
    """Turn the store's :class:`StoreUnavailable` into :class:`StoreUnreachable` with what to check."""
    try:
        yield
    except StoreUnavailable as exc:
        endpoint = config.store.s3.endpoint_url or "the AWS default endpoint"
        raise StoreUnreachable(
            f"S3 is unreachable ({what}): {exc}. Check store.s3.endpoint_url ({endpoint}), the network and the "
            f"credentials, then rerun this run: blocks already stored are skipped, nothing is lost") from exc


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def load_model_task(model: str, dtype: str = "fp32", device: str | None = "cpu") -> Any:
    """Load the model and tokenizer (``prefill.models.load_model``)."""
    from prefill.models import load_model

    return load_model(model, dtype=dtype, device=device)


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def save_demand(demand: Demand, run: RunDir) -> Path:
    """Persist a :class:`Demand` in the run's demand tables plus their ``meta.json``; returns their folder."""
    run.demand.mkdir(parents=True, exist_ok=True)
    prefixes = demand.prefixes.copy()
    prefixes["token_ids"] = [None if t is None else [int(x) for x in t] for t in prefixes["token_ids"]]
    frames = {"series": demand.series, "total": demand.total, "prefixes": prefixes, "families": demand.families}
    for name in DEMAND_TABLES:
        frames[name].to_parquet(run.demand_table(name), index=False)
    run.demand_meta.write_text(json.dumps({"bucket": str(demand.bucket)}))
    return run.demand


def load_demand(run: RunDir) -> Demand:
    """Read back what :func:`save_demand` wrote."""
    meta = json.loads(need(run.demand_meta, "mine_logs").read_text())
    frames = {n: pd.read_parquet(run.demand_table(n)) for n in DEMAND_TABLES}
    p = frames["prefixes"]
    p["token_ids"] = [None if t is None else [int(x) for x in t] for t in p["token_ids"]]
    for col in ("parent", "family", "text"):
        if col in p:
            p[col] = p[col].astype(object).where(p[col].notna(), None)
    return Demand(frames["series"], frames["total"], pd.Timedelta(meta["bucket"]), p, frames["families"])


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def save_json(obj: Any, path: Path) -> Path:
    """Write ``obj`` as JSON atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)
    return path


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def save_frame(frame: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def save_plan(plan: Plan, path: Path, config: KvwarmConfig) -> Path:
    """Write ``plan`` into the run directory, each entry of a tenant with an encryption key
    sealed with it (:func:`store.plan_seal.seal_plan`); :func:`read_run_plan` reads it back."""
    return write_plan(seal_plan(plan, config_keys(config)), path)


def read_run_plan(path: Path, config: KvwarmConfig) -> Plan:
    """A plan :func:`save_plan` wrote, its sealed entries opened with the tenants' keys.

    Raises:
        PlanError: not a valid plan, or a sealed entry whose tenant's key is not here.
    """
    return open_plan(read_plan(path), config_keys(config))


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def publish_latest_plan(plan: Plan, store_url: str, config: KvwarmConfig, model: Any) -> int:
    """Make ``plan`` the store's latest, keyed for ``model`` (a name or a loaded model): serving
    engines started with ``plan: latest`` prefetch it. What is published names each prefix by
    its salted block keys, never its text or token ids (:func:`prefill.plan_keys.published`,
    :func:`store.published_plan.publish_plan`). Returns the tiers written."""
    from prefill.plan_keys import published
    from store.published_plan import publish_plan
    from store.tiers.store import Store

    keyed = published(plan, model, config)
    store = Store.open(store_url, config)
    try:
        return publish_plan(keyed, store.tiers)
    finally:
        store.close()


@task(retries=1, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def prefill_task(plan_path: Path, loaded: Any, store_url: str, config: KvwarmConfig,
                 deadline: float | None = None, max_batch_tokens: int = 8192) -> dict[str, Any]:
    """Prefill the plan's entries into the store (``prefill.warm.warm``); blocks already stored are skipped,
    so a retry or a rerun writes only what is missing."""
    from prefill.warm import warm
    from store.tiers.store import Store

    plan = read_run_plan(need(plan_path, "plan_prewarm"), config)
    if plan.block_size is not None and plan.block_size != config.kv_cache.block_size:
        raise FlowInputError(f"plan {plan_path} was made for block size {plan.block_size}, the config says "
                             f"{config.kv_cache.block_size}: pass the same block_size to every stage")
    entries = plan.prefill_entries()  # retain entries are the loaders' to prefetch
    if not entries:
        return {"prefixes": 0, "blocks_written": 0, "blocks_total": 0, "tokens_computed": 0, "seconds": 0.0,
                "tokens_per_s": 0.0}
    store = Store.open(store_url, config)
    try:
        with s3_reachable(config, "prefill"):
            check_remote_tiers(store)
            report = warm(entries, loaded=loaded, store=store, config=config, deadline=deadline,
                          max_batch_tokens=max_batch_tokens)
    finally:
        store.close()
    return report.as_dict()


@task(retries=IO_RETRIES, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def gc_task(store_url: str, config: KvwarmConfig, now: float | None = None) -> dict[str, Any]:
    """Collect the store's garbage (``store.tiers.maintenance.gc``) with the config's TTL bound."""
    from store.tiers.maintenance import gc
    from store.tiers.store import Store

    store = Store.open(store_url, config)
    try:
        with s3_reachable(config, "gc"):
            check_remote_tiers(store)
            return gc(store, now=now, ttl_max_s=config.kv_cache.ttl_max_s).as_dict()
    finally:
        store.close()


# ---------------------------------------------------------------- pure tasks (no retries)

@task(cache_policy=NO_CACHE)
def mine_task(requests: pd.DataFrame, loaded: Any, config: KvwarmConfig, *, k: int, bucket: str,
              similarity: float | None = None, start: str | None = None, end: str | None = None) -> Demand:
    """Mine the requests into a demand table: prefix trees, families, per-bucket counts.

    Logs that name prompts by hash ids only (the Mooncake format) are mined from the ids,
    each standing for ``block_size`` tokens (:func:`forecasting.mining.request_tree.mine_requests`)."""
    if requests.empty:
        raise FlowInputError("the logs hold no usable request in the chosen period: check the path and start/end")
    precision = config.kv_cache.precision()
    block = config.kv_cache.block_size
    roots = {t: loaded.key_root(precision, block, config.tenant(t).salt) for t in requests["tenant"].unique()}
    model = requests["model"].iloc[0] if requests["model"].nunique() == 1 else loaded.name
    tree = mine_requests(requests, block_size=block, tokenizer=loaded.tokenizer, roots=roots, model=model)
    threshold = config.kv_cache.similarity_threshold if similarity is None else similarity
    families = find_families(tree, threshold=threshold)
    return build_demand(tree, k=k, bucket=bucket, families=families, start=start, end=end,
                        decode=lambda ids: loaded.tokenizer.decode(list(ids)))


@task(cache_policy=NO_CACHE)
def forecast_task(series: pd.DataFrame, horizon: int, workers: int, bucket: str) -> pd.DataFrame:
    """Per-series forecast ``horizon`` buckets ahead (model chosen per series by backtest)."""
    if series.empty:
        return pd.DataFrame(columns=["unique_id", "ds", "y_hat", "lower", "upper", "p_any", "model", "fallback"])
    return forecast_frame_parallel(series, candidates, horizon, workers=workers, freq=pd.Timedelta(bucket))


@task(cache_policy=NO_CACHE)
def window_task(total_forecast: pd.DataFrame, hours: float, fraction: float, bucket: str,
                total_history: pd.DataFrame | None = None) -> dict[str, Any]:
    """The off-peak window: the quietest ``hours`` ahead, and the windows under ``fraction`` of peak.

    With ``total_history`` (``ds``, ``y``) spanning at least three days, the quietest
    window is found on the path of whichever load predictor (the forecast, the multi-day
    profile, Holt-Winters on log counts) had the least regret on the past week
    (:func:`forecasting.planning.offpeak.pick_window`): the daily trough moves, and on real traffic
    the profile picks quieter windows than the forecast does (docs/guides/forecasting.md).
    With less history, the forecast's quietest window.
    """
    step = pd.Timedelta(bucket)
    load = total_forecast.set_index("ds")["y_hat"]
    length = pd.Timedelta(hours=hours)
    period = int(pd.Timedelta(days=1) / step)
    source: dict[str, Any] = {"name": "forecast", "regrets": {}}
    best = None
    if total_history is not None and period >= 1 and len(total_history) >= 3 * period:
        try:
            best, choice = pick_window(total_history[["ds", "y"]], load_predictors(period), length=int(length / step),
                                       period=period, horizon=len(load), bucket=step)
            source = {"name": choice.name, "regrets": {k: (v if math.isfinite(v) else None)
                                                       for k, v in choice.regrets.items()}}
        except ValueError as exc:  # a gap or a window longer than the horizon: the forecast alone
            get_run_logger().warning("off-peak choice fell back to the forecast: %s", exc)
    if best is None:
        best = lowest_window(load, length, bucket=step)
    under = offpeak_windows(load, fraction=fraction, min_length=length, bucket=step)
    as_json = lambda w: {"start": str(w.start), "end": str(w.end), "mean_load": float(w.mean_load),  # noqa: E731
                         "max_load": float(w.max_load)}
    return {"chosen": as_json(best), "offpeak": [as_json(w) for w in under], "fraction": fraction, "source": source}


@task(cache_policy=NO_CACHE)
def plan_task(demand: Demand, forecast: pd.DataFrame, window: dict[str, Any], config: KvwarmConfig, *,
              model: str, tokens_per_s: float, bytes_per_token: float, budget_gpu_s: float,
              budget_store_bytes: float, gpu_s_per_gib_hour: float) -> Plan:
    """The prewarm plan for the chosen window (``forecasting.planning.planner.make_plan``): prefill
    priced by the default model's shape at ``tokens_per_s`` (:meth:`store.cost.PrefillCost.scaled`)."""
    cost = PlanCosts(prefill=PrefillCost().scaled(tokens_per_s), bytes_per_token=bytes_per_token,
                     gpu_s_per_gib_hour=gpu_s_per_gib_hour)
    return make_plan(demand, forecast, cost=cost, budget=Budget(gpu_s=budget_gpu_s, store_bytes=budget_store_bytes),
                     window_start=pd.Timestamp(window["chosen"]["start"]),
                     window_end=pd.Timestamp(window["chosen"]["end"]), bucket=demand.bucket,
                     policy=PlanPolicy(kv_cache=config.kv_cache), model=model,
                     block_size=config.kv_cache.block_size)
