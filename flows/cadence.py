"""The short-cadence plan flow: every few minutes, what serving nodes should prefetch and retain.

``plan_cadence`` reads the logs of the ``cadence.lookback_minutes`` before its time
``as_of`` (default now; nothing at or after it), and makes the plan
:func:`forecasting.planning.cadence.plan_now` makes: the stored prefixes the reuse model
expects to be used within the next ``cadence.minutes``, ranked by the planner's one value
model under the retain budgets, joined with the prefill entries of the run's off-peak plan
(``plan.json``, when the plan stage wrote one). It writes the run's ``cadence_plan.json``
and publishes the plan as the store's latest, so an engine started with ``plan: latest``
prefetches a plan at most one cadence old. The ``plan-5min`` deployment (prefect.yaml)
runs it every ``cadence.minutes``; ``bench/replay_bench.py`` and ``prefill simulate``
measure the same call.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import history
from flows.spec import CadenceSpec, MiningSpec, RunTarget
from flows.tasks import (
    flow_config,
    load_model_task,
    publish_latest_plan,
    read_logs_task,
    read_run_plan,
    run_dir,
    save_plan,
)
from forecasting.planning import cadence as short
from forecasting.planning.planner import PlanCosts
from forecasting.planning.retain import RetainBudget
from forecasting.planning.reuse import ReuseConfig
from prefill.models import kv_layout
from store.config import KvwarmConfig
from store.cost import PrefillCost
from store.format.payload import kv_bytes_per_token
from store.plan import Plan


def plan_time(as_of: str | None) -> pd.Timestamp:
    """The plan's time: ``as_of`` (tz-naive UTC), or now."""
    ts = pd.Timestamp.now(tz="UTC") if as_of is None else pd.Timestamp(as_of)
    return ts.tz_convert("UTC").tz_localize(None) if ts.tzinfo is not None else ts


@task(cache_policy=NO_CACHE)
def cadence_plan_task(requests: pd.DataFrame, loaded: Any, config: KvwarmConfig, as_of: pd.Timestamp,
                      spec: CadenceSpec, *, tokens_per_s: float, base: Plan | None) -> Plan:
    """:func:`forecasting.planning.cadence.plan_now` at ``as_of``, keyed as mining keys the logs."""
    precision = config.kv_cache.precision()
    block = config.kv_cache.block_size
    roots = {t: loaded.key_root(precision, block, config.tenant(t).salt) for t in requests["tenant"].unique()}
    cost = PlanCosts(prefill=PrefillCost().scaled(tokens_per_s),
                     bytes_per_token=kv_bytes_per_token(kv_layout(loaded.config, block), precision))
    store_bytes = float("inf") if spec.store_bytes is None else spec.store_bytes
    plan_spec = short.CadenceSpec(RetainBudget(node_bytes=spec.node_bytes, store_bytes=store_bytes),
                                  ReuseConfig(horizon_s=60.0 * spec.minutes), lookback_s=60.0 * spec.lookback_minutes)
    model = str(requests["model"].iloc[0]) if len(requests) and requests["model"].nunique() == 1 else loaded.name
    return short.plan_now(requests, as_of, cost=cost, spec=plan_spec, block_size=block, roots=roots,
                          tokenizer=loaded.tokenizer, model=model, base=base)


@flow(name="plan-cadence")
def plan_cadence(target: RunTarget, mining: MiningSpec, cadence: CadenceSpec = CadenceSpec(),
                 as_of: str | None = None) -> str:
    """Make the short plan at ``as_of`` (default now) from the logs before it; publish it as the latest.

    ``mining.logs`` (and ``mining.quarantine``) say where the logs are; the period is the
    ``cadence.lookback_minutes`` before ``as_of``. Returns the path of ``cadence_plan.json``.
    """
    out = run_dir(target)
    config = flow_config(target)
    now = plan_time(as_of)
    start = now - pd.Timedelta(minutes=cadence.lookback_minutes)
    log = read_logs_task(mining.logs, mining.quarantine or str(out.quarantine), str(start), str(now))
    loaded = load_model_task(target.model)
    base = read_run_plan(out.plan, config) if out.plan.exists() else None
    rate = history.choose_prefill_rate(out, target.model, cadence.prefill_tokens_per_s)
    made = cadence_plan_task(log.requests, loaded, config, now, cadence, tokens_per_s=rate.tokens_per_s, base=base)
    path = save_plan(made, out.cadence_plan, config)
    publish_latest_plan(made, target.store, config, loaded)
    get_run_logger().info("short plan at %s: %d entries (%s)", now, len(made.entries), made.extra)
    return str(path)
