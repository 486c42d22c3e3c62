"""Soak (done-when 5): memory stays bounded over 10,000 lookups of distinct prompts and a day of plans.

A real engine would take about an hour on two cores to serve 10,000 prompts, so these
tests drive, in this process, the objects the connector serves through: its scheduler
role (:class:`store.engines.vllm.scheduler.SchedulerRole`, fed vLLM-shaped requests and
steps from ``scheduler_fakes``: every call vLLM makes for a request, from its arrival to
its end), and the :class:`KVLoader` its worker role holds (the lookup each load makes,
and the node agent that follows the published plan). Memory is
Python's own allocations (``tracemalloc``), measured after a warm-up and again at the
end: what the work keeps for ever grows with the number of prompts or plans, what it
bounds does not. The bounds are a fraction of what one kept entry per prompt or plan
entry would hold.
"""
from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest

import store
from store.config import FleetMemoryConfig
from store.engines.vllm.metadata import LoadResult, WorkerReport
from store.plan import Plan, PlanEntry
from store.published_plan import PublishedPlan, key_plan, publish_plan
from store.serving.agent import AgentSettings, NodeAgent, StorePlans
from store.serving.loader import KVLoader
from store.serving.loader_node import LoaderNode
from store.tiers.store import Store
from tests.store.engines.vllm import scheduler_fakes as fakes
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16
#: kvwarm's serving package: the allocations a soak measures
PRODUCT = str(Path(store.__file__).resolve().parent)
PLANS_PER_DAY = 24 * 60 // 5  # a plan re-prefetched every five minutes


def traced() -> int:
    """Bytes that kvwarm's own code (``store/``) allocated and Python still holds.

    Allocations are counted where they were made, so what other code allocates is left out:
    pathlib's interned path parts (the interpreter's table, which doubles now and then
    whatever kvwarm keeps), and in a full suite the threads and caches that earlier tests
    left running (Prefect, logging). A map kvwarm keeps growing is counted where it grows.
    """
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"{PRODUCT}{os.sep}*")])
    return sum(stat.size for stat in snap.statistics("filename"))


def growth(step: Callable[[int], None], n: int, warmup: int, settle: Callable[[], object] = lambda: None) -> int:
    """Run ``step(0 .. n - 1)`` under ``tracemalloc``; bytes :func:`traced` grew from after step ``warmup`` to the end.

    ``settle`` runs before each measurement: work queued to a background thread (bounded by its queue)
    is done then, so what is measured is what stays, not how far the thread lagged at that moment."""
    tracemalloc.start()
    try:
        for i in range(n):
            step(i)
            if i == warmup:
                settle()
                after_warmup = traced()
        settle()
        return traced() - after_warmup
    finally:
        tracemalloc.stop()


@pytest.fixture
def loader(tmp_path):
    cfg = config(BS, "bf16")
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    recurring = [prompt(2 * BS, seed=s) for s in range(8)]
    for i, ids in enumerate(recurring):
        synthetic_prefix(store, cfg, ids, layers=2, heads=2, head_dim=16, seed=i)
    store.close()
    with KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=64 << 20, config=cfg,
                  pool_dir=tmp_path / "pool") as ld:
        yield ld, recurring


def a_plan(n: int, recurring: list[list[int]], ld: KVLoader) -> PublishedPlan:
    """Plan ``n`` of the day: the recurring prefixes (stored), then 40 prefixes no earlier plan named;
    published as the pipeline publishes it (keyed under the loader's root)."""
    fresh = [prompt(2 * BS, seed=100_000 + 40 * n + i) for i in range(40)]
    entries = [PlanEntry(tenant=ACME.name, token_ids=tuple(ids), score=1.0 + (n + i) % 7)
               for i, ids in enumerate(recurring + fresh)]
    return key_plan(Plan(entries=tuple(entries), created_at=1_000_000.0 + 300 * n), lambda tenant, chat: ld.root)


def test_a_day_of_plans_followed_by_the_node_agent_keeps_memory_and_threads_bounded(loader):
    """The node agent as the connector runs it, on a clock of its own: a plan published to the
    store every five minutes, the agent polling every 30 s, each new plan applied (priorities,
    copies, the last prefetch superseded), for a day."""
    ld, recurring = loader
    clock = [1_000_000.0]
    node = LoaderNode(ld, on_result=lambda r: results.append(r))
    agent = NodeAgent(node, StorePlans(ld.store.tiers), AgentSettings(poll_s=30.0), clock=lambda: clock[0])
    results: list = []
    threads = []

    def five_minutes(n: int) -> None:
        publish_plan(a_plan(n, recurring, ld), ld.store.tiers)
        for _ in range(10):  # ten polls, one of which finds the new version
            clock[0] += 30.0
            agent.tick()
        ld.prefetcher.wait_idle(60)
        # this loader's threads: its prefetch streams and fetch workers (the pools' own sets)
        threads.append(len(ld.prefetcher._executor._threads) + len(ld._executor._threads))

    grown = growth(five_minutes, PLANS_PER_DAY, PLANS_PER_DAY // 6)
    assert agent.figures.plans_applied == PLANS_PER_DAY and agent.figures.polls == 10 * PLANS_PER_DAY  # the first is the start
    assert all(r.present >= 2 * len(recurring) for r in results)  # the stored prefixes are found every time
    # ~240 plans x 40 new entries x 2 blocks: one kept name per block would be > 2 MiB
    assert grown < 512 << 10, f"memory grew by {grown / 1024:.0f} KiB over {PLANS_PER_DAY} plans"
    # the prefetch streams and the fetch workers, made once and reused: none per plan
    assert max(threads) <= ld.prefetcher.streams + ld.config.loader.fetch_workers, f"threads grew: {max(threads)}"
    assert threads[-1] == threads[PLANS_PER_DAY // 6]
    hit = ld.lookup(recurring[0] + [1])
    assert hit is not None and hit.tokens == 2 * BS  # and the plans still serve
    hit.release()


def test_ten_thousand_lookups_of_distinct_prompts_keep_memory_bounded(loader):
    ld, recurring = loader

    def lookup(i: int) -> None:
        ids = prompt(3 * BS + i % BS, seed=1_000_000 + i)
        if i % 10 == 0:  # one in ten shares a stored prefix: hits are pinned and released
            ids = recurring[i % len(recurring)] + ids[: BS + 1]
        hit = ld.lookup(ids)
        if hit is not None:
            hit.release()

    grown = growth(lookup, 10_000, 2_000)
    stats = ld.stats()
    assert stats["lookups"] == 10_000 and stats["hits"] == 1_000
    # one kept entry per prompt (a key, a tracker row) would be > 1 MiB over 8,000 prompts
    assert grown < 256 << 10, f"memory grew by {grown / 1024:.0f} KiB over 8,000 lookups"


def test_ten_thousand_requests_through_the_connectors_scheduler_role_keep_memory_bounded(tmp_path):
    """Each request as vLLM drives it: arrival, the lookup (asked twice, as while it waits), the
    allocation, the step plan, the worker's report, the end. One in ten hits a stored prefix."""
    stored = [fakes.tokens(3 * fakes.KB, seed=s) for s in range(8)]
    for ids in stored:
        fakes.store_prefix(tmp_path, ids)
    # the fleet's memory is bounded by fleet_memory.max_names: small here, so the soak passes the bound
    cfg = fakes.config().model_copy(update={"fleet_memory": FleetMemoryConfig(max_names=500, flush_s=0.05)})
    role = fakes.role(tmp_path, rate=100.0, cfg=cfg)

    def request(i: int) -> None:
        ids = fakes.tokens(2 * fakes.KB + 3, seed=1_000_000 + i)
        if i % 10 == 0:
            ids = stored[i % len(stored)] + ids[:5]
        # every third a salted tenant's (bolt's, storing nothing); the stored prefixes are the default tenant's
        req = fakes.Req(f"r{i}", ids, cache_salt=fakes.BOLT_SALT if i % 3 == 1 and i % 10 else None)
        role.on_new_request(req)
        role.get_num_new_matched_tokens(req, 0)
        n, _ = role.get_num_new_matched_tokens(req, 0)
        table = list(range(1, len(ids) // fakes.EB + 2))
        role.update_state_after_alloc(req, table, n or 0)
        plan = role.build_plan(fakes.Out([fakes.NewReq(req.request_id, ids, (table,), n or 0)],
                                         num_scheduled_tokens={req.request_id: len(ids) - (n or 0)}))
        role.update_output(WorkerReport([LoadResult(s.req_id, s.end - s.start, s.end - s.start, nbytes=1 << 20,
                                                    seconds=1e-4) for s in plan.loads]), None)
        assert role.request_finished(req)["kvwarm"]["loaded_tokens"] == (n or 0)

    # the cross-tenant checks of bolt's misses, and the fleet records, queue to background threads (bounded):
    # on a busy machine they lag, and their queues are not what this test bounds
    grown = growth(request, 10_000, 2_000, settle=lambda: (role.audit.flush(60), role.memory.flush(60)))
    stats = role.stats()
    kept = max(len(d) for d in role.memory.recorder._names.values())  # max_names bounds each namespace
    role.close()
    assert stats["lookups"] == 10_000 and stats["hits"] == 1_000 and stats["requests_tracked"] == 0
    assert kept <= 500 and role.memory.recorder.stats.as_dict().get("files_written", 0) > 0
    assert grown < 256 << 10, f"memory grew by {grown / 1024:.0f} KiB over 8,000 requests"
