"""The sharded prefill: the plan split over the GPU pool, one flow run of the prefill deployment per shard.

``prefill_plan`` with ``prefill.shards`` above 1 (or ``auto``) is the *parent*: it
tokenises the plan (the tokenizer only, no weights), splits it along its prefix tree
(:func:`prefill.shards.make_shards`, balanced by estimated GPU-seconds at the plan's
prefill rate), and runs each shard as its own flow run of ``prefill.shard_deployment``
with ``run_deployment``: the run's ``target``, the window's ``deadline`` and the
``shard``; the deployment's own ``prefill`` section (device, dtype) fills the rest. It
then waits for all of them and reports, per shard, its final state, tokens, GPU-seconds,
waits and what the deadline cut (``prefill.json``, from each shard's
``prefill-shard-<i>.json`` in the run directory). A shard that fails does not stop the
others; the parent then ends failed naming it and its reason. Rerunning the parent, or
one shard, computes only what is missing: every shard's job probes the store.

``auto`` counts the online workers of the deployment's work pool (one shard per
worker: start each GPU host's worker with ``--limit 1``).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.spec import PrefillSpec, RunTarget
from flows.tasks import (
    IO_RETRY_DELAY_S,
    FlowInputError,
    check_remote_tiers,
    read_run_plan,
    s3_reachable,
    save_json,
    transient,
)
from prefill.models import encode, load_tokenizer
from prefill.rundir import RunDir
from prefill.shards import Shard, balance, make_shards, prefixes_of
from store.config import KvwarmConfig
from store.cost import PrefillCost
from store.errors import OperationalError
from store.plan import Plan

#: the prefill rate shards are balanced at when the plan records none (only the shape matters)
DEFAULT_TOKENS_PER_S = 2000.0
#: how long after the deadline the parent still waits for a shard's final state
DEADLINE_GRACE_S = 600.0


class ShardsFailed(OperationalError):
    """One or more shards ended in a state other than COMPLETED; the message names each and why."""


def online_workers(pool: str, now: float | None = None) -> int:
    """Workers of ``pool`` online now: ONLINE, with a heartbeat within three of their intervals."""
    from prefect import get_client

    now = time.time() if now is None else now
    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    alive = 0
    for w in workers:
        beat = w.last_heartbeat_time.timestamp() if w.last_heartbeat_time else 0.0
        if str(w.status.value if hasattr(w.status, "value") else w.status).upper() == "ONLINE" and \
                now - beat <= 3 * (w.heartbeat_interval_seconds or 30):
            alive += 1
    return alive


def shard_count(prefill: PrefillSpec) -> int:
    """``prefill.shards``, with ``auto`` resolved to the online workers of the shard deployment's pool (at least 1)."""
    if prefill.shards != "auto":
        return int(prefill.shards)
    import httpx
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    log = get_run_logger()
    if not PREFECT_API_URL.value():
        log.info("shards: auto = 1: no Prefect server configured (PREFECT_API_URL unset), so no pool to count")
        return 1
    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(prefill.shard_deployment)
        pool = deployment.work_pool_name
        n = online_workers(pool) if pool else 0
    except (ObjectNotFound, httpx.HTTPError, OSError) as exc:
        log.warning("shards: auto = 1: cannot count the workers of %r's pool (%s: %s)", prefill.shard_deployment,
                    type(exc).__name__, exc)
        return 1
    log.info("shards: auto = %d, the online workers of pool %r", max(1, n), pool)
    return max(1, n)


def plan_shards(plan: Plan, model: str, n: int, block_size: int) -> list[Shard]:
    """Split ``plan``'s prefill entries (:meth:`store.plan.Plan.prefill_entries`; a shard's entry
    indices count those) into ``n`` shards, its texts tokenised by ``model``'s tokenizer, priced
    at the plan's rate."""
    tokenizer = load_tokenizer(model)
    prefixes = prefixes_of(plan.prefill_entries(), lambda text, chat: encode(tokenizer, text, chat=chat))
    rate = float((plan.extra.get("prefill_rate") or {}).get("tokens_per_s") or DEFAULT_TOKENS_PER_S)
    return make_shards(prefixes, n, block_size=block_size, cost=PrefillCost().scaled(rate))


def _child_prefill(prefill: PrefillSpec, deployment: Any) -> dict[str, Any]:
    """The deployment's own prefill section (its device and dtype) with this run's batch size, wait and one shard."""
    own = dict((deployment.parameters or {}).get("prefill") or {})
    return {**own, "shards": 1, "wait_timeout_s": prefill.wait_timeout_s, "max_batch_tokens": prefill.max_batch_tokens}


@task(cache_policy=NO_CACHE)
def submit_shards(target: RunTarget, prefill: PrefillSpec, shards: Sequence[Shard],
                  deadline: float | None) -> list[str]:
    """One flow run of the shard deployment per shard; returns their ids in shard order."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(prefill.shard_deployment)
    child = _child_prefill(prefill, deployment)
    ids = []
    for s in shards:
        run = run_deployment(prefill.shard_deployment, timeout=0, as_subflow=False, tags=["kvwarm", "prefill-shard"],
                             flow_run_name=f"{target.run}-shard-{s.index}-of-{s.count}",
                             parameters={"target": target.model_dump(mode="json"), "prefill": child,
                                         "deadline": deadline, "shard": dataclasses.asdict(s)})
        get_run_logger().info("shard %d/%d: flow run %s (%d entries, %d shared prefix(es) first, %d wait(s), "
                              "~%.1f GPU-s)", s.index, s.count, run.id, len(s.entries), len(s.computes),
                              len(s.waits), s.est_gpu_s)
        ids.append(str(run.id))
    return ids


@task(cache_policy=NO_CACHE)
def wait_for_shards(ids: Sequence[str], deadline: float | None, poll_s: float = 1.0) -> list[dict[str, Any]]:
    """Poll the shards' flow runs until each is final (or the deadline plus a grace passed); their states."""
    from prefect import get_client

    give_up = None if deadline is None else deadline + DEADLINE_GRACE_S
    states: dict[str, dict[str, Any]] = {}
    with get_client(sync_client=True) as client:
        while True:
            for i in ids:
                if i in states:
                    continue
                run = client.read_flow_run(i)
                if run.state is not None and run.state.is_final():
                    states[i] = {"state": run.state.type.value, "message": run.state.message or ""}
                    get_run_logger().info("shard flow run %s ended %s %s", i, run.state.name, run.state.message or "")
            if len(states) == len(ids):
                break
            if give_up is not None and time.time() > give_up:
                for i in ids:
                    states.setdefault(i, {"state": "UNFINISHED", "message": f"no final state {DEADLINE_GRACE_S:.0f} s "
                                                                            f"after the deadline (its worker died?)"})
                break
            time.sleep(poll_s)
    return [states[i] for i in ids]


def summarise(out: RunDir, shards: Sequence[Shard], ids: Sequence[str], states: Sequence[dict[str, Any]]) -> dict:
    """``prefill.json`` of the parent: each shard's state and report, the totals, and which shards failed."""
    rows = []
    for s, run_id, st in zip(shards, ids, states):
        row: dict[str, Any] = {"shard": s.index, "flow_run": run_id, **st, "est_gpu_s": s.est_gpu_s,
                               "assignment": dataclasses.asdict(s)}
        path = out.shard_result(s.index)
        if path.exists():
            result = json.loads(path.read_text())
            if result.get("flow_run") == run_id:
                row.update({k: v for k, v in result.items() if k not in row})
        rows.append(row)
    total = lambda k: sum(r.get(k, 0) or 0 for r in rows)  # noqa: E731
    seconds = total("seconds")
    return {"shards": rows, "balance": balance(shards), "prefixes": sum(len(s.entries) for s in shards),
            "tokens_computed": total("tokens_computed"), "forward_tokens": total("forward_tokens"),
            "blocks_written": total("blocks_written"), "blocks_left": total("blocks_left"), "seconds": seconds,
            "tokens_per_s": round(total("tokens_computed") / seconds, 1) if seconds > 0 else 0.0,
            "stopped": "deadline" if any(r.get("stopped") for r in rows) else None,
            "cut": sorted(e for r in rows for e in r.get("cut", [])),
            "failed": [r["shard"] for r in rows if r["state"] != "COMPLETED"]}


def failure(summary: dict[str, Any]) -> ShardsFailed:
    """The parent's error: each failed shard, its flow run and reason, and what to do."""
    bad = [r for r in summary["shards"] if r["state"] != "COMPLETED"]
    n = len(summary["shards"])
    what = "; ".join(f"shard {r['shard']}/{n} (flow run {r['flow_run']}) ended {r['state']}: {r['message'].rstrip('.') or '?'}"
                     for r in bad)
    return ShardsFailed(f"{what}. The other shard(s) ran to their end. Rerun this prefill (or the failed shard's "
                        f"flow run): blocks already stored are skipped, only the missing ones are computed")


def check_plan_fits(plan: Plan, block_size: int, path: Any) -> None:
    if plan.block_size is not None and plan.block_size != block_size:
        raise FlowInputError(f"plan {path} was made for block size {plan.block_size}, the config says {block_size}: "
                             f"pass the same block_size to every stage")


@task(retries=1, retry_delay_seconds=IO_RETRY_DELAY_S, retry_condition_fn=transient, cache_policy=NO_CACHE)
def shard_task(plan_path: Path, shard: Shard, loaded: Any, store_url: str, config: KvwarmConfig,
               deadline: float | None, prefill: PrefillSpec) -> dict[str, Any]:
    """Run one shard of the plan (``prefill.shard_job.run_shard``); its report, with this flow run's id."""
    from prefect.runtime import flow_run

    from prefill.numa import pin_to_device
    from prefill.shard_job import ShardOptions, run_shard
    from store.tiers.store import Store

    plan = read_run_plan(plan_path, config)
    check_plan_fits(plan, config.kv_cache.block_size, plan_path)
    entries = plan.prefill_entries()  # retain entries are the loaders' to prefetch
    if any(i >= len(entries) for i in shard.entries):
        raise FlowInputError(f"shard {shard.index} names plan entries the plan {plan_path} does not have: the plan "
                             f"changed since it was sharded; rerun the parent prefill")
    pin_to_device(loaded.device)
    store = Store.open(store_url, config)
    try:
        with s3_reachable(config, "prefill"):
            check_remote_tiers(store)
            report = run_shard(shard, entries, loaded=loaded, store=store, config=config,
                               precision=config.kv_cache.precision(), deadline=deadline,
                               options=ShardOptions(wait_timeout_s=prefill.wait_timeout_s,
                                                    max_batch_tokens=prefill.max_batch_tokens),
                               log=get_run_logger())
    finally:
        store.close()
    return {**report.as_dict(), "flow_run": str(flow_run.id) if flow_run.id else None}


def prefill_in_shards(target: RunTarget, prefill: PrefillSpec, deadline: float | None, n: int, out: RunDir,
                      config: KvwarmConfig, plan_path: Path) -> dict[str, Any]:
    """The parent's steps (see the module doc); raises :class:`ShardsFailed` after writing ``prefill.json``."""
    plan = read_run_plan(plan_path, config)
    check_plan_fits(plan, config.kv_cache.block_size, plan_path)
    shards = plan_shards(plan, target.model, n, config.kv_cache.block_size)
    b = balance(shards)
    get_run_logger().info("plan of %d entries in %d shards: largest %.2f GPU-s, mean %.2f (x%.3f)", len(plan.prefill_entries()),
                          n, b["max_gpu_s"], b["mean_gpu_s"], b["max_over_mean"])
    ids = submit_shards(target, prefill, shards, deadline)
    states = wait_for_shards(ids, deadline)
    summary = summarise(out, shards, ids, states)
    save_json(summary, out.prefill)
    for r in summary["shards"]:
        get_run_logger().info("shard %d: %s, %s tokens, %.2f GPU-s, stopped %s, cut %d entr(ies)", r["shard"],
                              r["state"], r.get("tokens_computed", "?"), r.get("seconds", 0.0), r.get("stopped"),
                              len(r.get("cut", [])))
    if summary["failed"]:
        raise failure(summary)
    return summary
