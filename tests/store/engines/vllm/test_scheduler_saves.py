"""The scheduler role's side of the block-validity rule: what each step computes goes to the worker,
and a save the worker refused is planned again once the engine recomputes it."""
from __future__ import annotations

from dataclasses import dataclass, field

from store.engines.vllm.metadata import WorkerReport
from store.engines.vllm.validity import Compute
from tests.store.engines.vllm.scheduler_fakes import KB, Cached, NewReq, Out, Req, role, tokens


@dataclass
class FullOut(Out):
    """A step that also ends requests and copies blocks (vLLM 0.32's SchedulerOutput fields)."""

    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_cache_block_copies: list[tuple[int, int]] = field(default_factory=list)


def test_every_scheduled_request_goes_to_the_worker_tracked_or_not(tmp_path) -> None:
    r = role(tmp_path)
    ids = tokens(KB + 1)
    r.on_new_request(Req("a", ids))
    plan = r.build_plan(FullOut([NewReq("a", ids, ([1, 2, 3],), 0), NewReq("stranger", ids, ([7, 8],), 8)],
                                Cached(["old", "back"], [([9],), ([4, 5],)], [40, 0], {"back"}),
                                num_scheduled_tokens={"a": 17, "stranger": 4, "old": 1, "back": 12},
                                finished_req_ids={"gone"}, preempted_req_ids={"bumped"},
                                kv_cache_block_copies=[(3, 6)]))
    assert plan.computes == (Compute("a", 0, 17, (1, 2, 3), True), Compute("stranger", 8, 4, (7, 8), True),
                             Compute("old", 40, 1, (9,), False), Compute("back", 0, 12, (4, 5), True))
    assert plan.copies == ((3, 6),) and plan.ended == ("bumped", "gone")


def test_a_step_the_role_cannot_read_tells_the_worker_so(tmp_path) -> None:
    plan = role(tmp_path).build_plan(object())  # no field vLLM's SchedulerOutput has
    assert plan.computes is None


def test_a_refused_save_is_planned_again_when_the_engine_recomputes_prompt_tokens(tmp_path) -> None:
    ids = tokens(3 * KB + 3)
    r = role(tmp_path)
    req = Req("r", ids)
    assert r.get_num_new_matched_tokens(req, 0) == (0, False)
    table = list(range(40, 47))
    plan = r.build_plan(Out([NewReq("r", ids, (table,), 0)], num_scheduled_tokens={"r": 3 * KB}))
    assert [(s.first, len(s.block_ids)) for s in plan.saves] == [(0, 6)]
    r.update_output(WorkerReport(refused={"r": 1}), None)  # block 1 on was computed over a failed load
    # a decode step computes no prompt token: nothing is planned (it would be refused again)
    decode = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [None], [3 * KB + 3]),
                              num_scheduled_tokens={"r": 1}))
    assert decode.saves == ()
    # vLLM rewound the request to block 1; recomputing it, the blocks from 1 on are planned again
    plan = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [None], [KB]), num_scheduled_tokens={"r": 2 * KB}))
    assert [(s.first, s.block_ids) for s in plan.saves] == [(1, tuple(table[2:6]))]
    r.update_output(WorkerReport(refused={"r": 2}), None)
    assert r.tracker.get("r").save_from == 2  # a later refusal only moves it back, never forward
    r.update_output(WorkerReport(refused={"r": 3}), None)
    assert r.tracker.get("r").save_from == 2


def test_with_async_loads_a_request_waits_for_its_load(tmp_path) -> None:
    from tests.store.engines.vllm.scheduler_fakes import store_prefix

    ids = tokens(2 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path, async_loads=True)
    req = Req("r", ids)
    assert r.get_num_new_matched_tokens(req, 0) == (2 * KB, True)  # vLLM holds it until the worker reports
    r.update_state_after_alloc(req, [1, 2, 3, 4], 2 * KB)
    (load,) = r.build_plan(Out()).loads
    assert load.deferred and load.block_ids == (1, 2, 3, 4)
