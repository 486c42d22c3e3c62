"""The live replay's plan and simulation (bench/live_replay.py): the product planner's plan at the
event, published as the pipeline publishes it, and the simulator on the same slice with the
run's measured costs.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench.lib.live_figures import BLOCK, ORIGIN, S3_ENV, SIM_POLICY, TENANT


def cadence_spec(node_bytes: float) -> Any:
    """The plans' budget, as the simulator's kvwarm rows get it (``retain_spec``: a share of the node tier)."""
    from forecasting.planning.cadence import CadenceSpec
    from forecasting.planning.retain import RetainBudget
    from forecasting.simulate.kvwarm_policy import RETAIN_FRACTION

    return CadenceSpec(RetainBudget(node_bytes=RETAIN_FRACTION * node_bytes))


def make_live_plan(rows: pd.DataFrame, event_s: float, *, model_dir: Path, config_path: Path, prefill: Any,
                   per_token: float, node_bytes: float) -> Any:
    """The product planner's plan at the event, from the requests before it, keyed for the real model.

    The plan is for the model the rows were logged with (the served one, as the cadence flow
    takes the log's model): the planner reads only that model's rows.
    """
    from forecasting.planning.cadence import plan_now
    from forecasting.planning.planner import PlanCosts
    from store.config import load_config
    from store.identity.fingerprint import identity_from_dir

    cfg = load_config(config_path)
    precision = cfg.kv_cache.precision()
    root = identity_from_dir(model_dir).key_root(precision, BLOCK, cfg.tenant(TENANT).salt)
    (model,) = rows["model"].unique()
    return plan_now(rows, ORIGIN + pd.Timedelta(seconds=event_s), cost=PlanCosts(prefill, bytes_per_token=per_token),
                    spec=cadence_spec(node_bytes), block_size=BLOCK, roots={TENANT: root}, model=str(model))


def publish(plan: Any, config_path: Path, model_dir: Path) -> None:
    """Publish ``plan`` to the config's S3 tier, as the pipeline's flow does (``plans/latest``): keyed
    for the model in ``model_dir`` (block keys under the tenant's salt, no token ids)."""
    from prefill.plan_keys import published
    from store.config import load_config
    from store.published_plan import publish_plan
    from store.tiers.registry import tiers_from_url
    from tests.store.engines.vllm.harness import environment

    cfg = load_config(config_path)
    plan = published(plan, str(model_dir), cfg)
    with environment(S3_ENV):
        tiers = [t for t in tiers_from_url(cfg.store.url, cfg.store) if "s3" in type(t).__name__.lower()]
        try:
            publish_plan(plan, tiers)
        finally:
            for t in tiers:
                t.close()


def simulated_plan(rows: pd.DataFrame, event_s: float, index: Any, deployment: Any,
                   node_bytes: float) -> tuple[Any, list[Any]]:
    """The simulator's kvwarm planner for the slice and its one plan, at the event (the live run's):
    the product planner on the same rows, the blocks written back before the event present.

    ``index`` is the slice's :class:`~forecasting.simulate.replay.BlockIndex` (its trace at
    :data:`BLOCK`-token blocks, time 0 at the first row), ``deployment`` the simulator's.
    """
    from forecasting.ingest.traces import simulation_root
    from forecasting.simulate.kvwarm_policy import planner_for
    from forecasting.simulate.policies import kvwarm_plans, stored_with_prefill, written_back

    roots = {TENANT: simulation_root(TENANT, BLOCK)}
    planner = planner_for(index.trace, rows, cadence_spec(node_bytes), deployment, cadence_s=event_s, roots=roots)
    stored = stored_with_prefill(index, written_back(index), np.zeros(0, dtype=np.int64), float("inf"))
    return planner, kvwarm_plans(index, planner, stored, event_s)


def simulate_slice(rows: pd.DataFrame, event_s: float, *, prefill: Any, per_token: float, engine_per_token: int,
                   kv_capacity_tokens: int, node_bytes: float, node_load: Any, lmcache: dict[str, Any] | None,
                   policies: Sequence[str]) -> dict[str, Any]:
    """The simulator on the same slice (token-id log rows at 256-token blocks), replacement at the event."""
    from forecasting.ingest.log_trace import trace_from_requests
    from forecasting.simulate.replay import BlockIndex
    from forecasting.simulate.runs import Scenario
    from forecasting.simulate.simulation import ENGINE_KV_BYTES_PER_TOKEN, Deployment, simulate
    from forecasting.simulate.tiers import HOST_S3_LINK_BYTES_PER_S, HOST_S3_STREAM
    from store.cost import LoadCost

    trace = trace_from_requests(rows, block_size=BLOCK, source="the live slice")
    index = BlockIndex.build(trace)
    dep = Deployment.default(BLOCK, gpu_kv_bytes=kv_capacity_tokens * ENGINE_KV_BYTES_PER_TOKEN, node_bytes=node_bytes,
                             prefill=prefill, stored_per_token=per_token, s3_bytes_per_s=HOST_S3_LINK_BYTES_PER_S,
                             s3_stream=HOST_S3_STREAM)
    dep = dataclasses.replace(dep, costs=dataclasses.replace(dep.costs, local=node_load,
                                                             save_block_bytes=BLOCK * engine_per_token))
    duration = float(trace.timestamps_s[-1])
    scenario = Scenario("replacement", event_s, max(duration - event_s + 1.0, 1.0))
    out: dict[str, Any] = {"deployment": {"gpu_blocks": dep.shape.gpu_blocks, "node_blocks": dep.shape.node_blocks,
                                          "block_bytes": dep.costs.block_bytes, "copy_s": dep.costs.copy_s,
                                          "node_load_bytes_per_s": node_load.bytes_per_s,
                                          "s_per_token": prefill.s_per_token,
                                          "s_per_token_pair": prefill.s_per_token_pair}}
    sim_pols = [SIM_POLICY[p] for p in policies if p != "lmcache"]
    planner = None
    ticks = None
    if "kvwarm" in sim_pols:
        planner, ticks = simulated_plan(rows, event_s, index, dep, node_bytes)
        out["plan_entries"] = len(ticks[0].plan.entries) if ticks else 0
    rows_out: dict[str, Any] = {}
    res = simulate(index, dep, [scenario], sim_pols, planner=planner, references=False, ticks=ticks)[0]
    for p in sim_pols:
        rows_out[p] = dataclasses.asdict(res.row(p))
    if "lmcache" in policies and lmcache and lmcache.get("l2_s_per_chunk"):
        # reactive-store at LMCache's measured costs: a chunk from its S3 L2 in l2_s_per_chunk, one
        # fetch at a time (its lookup waits for them), and its L1 copy into vLLM at l1_s_per_token
        bb = dep.costs.block_bytes
        remote = LoadCost(bytes_per_s=bb / max(lmcache["l2_s_per_chunk"], 1e-9))
        l1 = lmcache.get("l1_s_per_token")
        local = LoadCost(bytes_per_s=bb / max(l1 * BLOCK, 1e-9)) if l1 else node_load
        lmc = dataclasses.replace(dep, costs=dataclasses.replace(dep.costs, remote=remote, local=local, fetch_streams=1,
                                                                 prefetch_streams=1, s3_bytes_per_s=math.inf))
        lres = simulate(index, lmc, [scenario], ["vllm", "reactive-store"], references=False)[0]
        rows_out["reactive-store"] = dataclasses.asdict(lres.row("reactive-store"))
        out["lmcache_deployment"] = {"copy_s": lmc.costs.copy_s, "l1_load_bytes_per_s": local.bytes_per_s}
    for r in rows_out.values():
        r.pop("per_bucket", None)
    out["rows"] = rows_out
    return out


# ---------------------------------------------------------------- the bench
