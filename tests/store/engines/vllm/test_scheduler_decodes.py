"""The scheduler role's steady decodes, told in bulk: the same plans as when every decode is looked at.

The role passes over a decode whose request is known to plan nothing past its prompt. The oracle is
the same role with that knowledge dropped before every step (so that each decode goes through
``SavePlanner.step``, as all of them did before): random steps of new requests, chunks, decodes,
rewinds, grown tables, refused saves, failed loads and finished requests give both the same plans.
"""
from __future__ import annotations

import random

import pytest

from store.engines.vllm.decodes import Decodes
from store.engines.vllm.metadata import LoadResult, StepPlan, WorkerReport
from store.engines.vllm.planning import computes_of
from store.engines.vllm.validity import Compute
from tests.store.engines.vllm.scheduler_fakes import EB, KB, Cached, NewReq, Out, Req, role, tokens


def _steps(g: random.Random, steps: int):
    """Each step: what is scheduled (an ``Out``), then the worker's report and the requests finished."""
    prompts = {f"r{i}": tokens(g.randrange(1, 5) * KB + g.randrange(KB), seed=i) for i in range(6)}
    done: dict[str, int] = {}  # request -> tokens computed
    size: dict[str, int] = {}  # request -> engine blocks in its table
    for step in range(steps):
        new, ids, news, starts, scheduled = [], [], [], [], {}
        for req, prompt in prompts.items():
            if req not in done:
                if g.random() < 0.5:
                    size[req] = len(prompt) // EB + 3
                    done[req] = 0
                    n = g.randrange(1, len(prompt) + 1)
                    new.append(NewReq(req, prompt, (list(range(100 * step, 100 * step + size[req])),), 0))
                    scheduled[req] = n
                continue
            start = done[req]
            if g.random() < 0.1:
                start = g.randrange(0, start + 1)  # a rewind (a failed load of it, or of a block it shares)
            n = 1 if start >= len(prompt) else g.randrange(1, len(prompt) - start + 1)
            grow = g.random() < 0.15
            ids.append(req)
            news.append(([10_000 + 100 * step + len(ids)],) if grow else None)
            starts.append(start)
            scheduled[req] = n
            size[req] += grow
        for nr in new:
            done[nr.req_id] = scheduled[nr.req_id]
        for req, start in zip(ids, starts):
            done[req] = start + scheduled[req]
        report = WorkerReport()
        for req in g.sample(sorted(done), min(2, len(done))):
            if g.random() < 0.2:
                report.refused[req] = g.randrange(0, len(prompts[req]) // KB + 1)
            elif g.random() < 0.1:
                report.loads.append(LoadResult(req, loaded=0, planned=KB, reason="corrupt"))
        finished = [req for req in done if g.random() < 0.05]
        yield Out(new, Cached(ids, news, starts), scheduled), report, [Req(r, prompts[r]) for r in finished]
        for req in finished:
            del done[req], prompts[req]


def _plain(plan: StepPlan):
    return plan.saves, plan.prompt_tokens, plan.other_tokens


@pytest.mark.parametrize("seed", range(12))
def test_decodes_passed_over_in_bulk_plan_what_each_looked_at_plans(tmp_path, seed: int) -> None:
    r, oracle = role(tmp_path), role(tmp_path)
    g = random.Random(seed)
    quiet = saves = 0
    for out, report, finished in _steps(g, 40):
        for nr in out.scheduled_new_reqs:
            for x in (r, oracle):
                x.on_new_request(Req(nr.req_id, nr.prompt_token_ids))
        oracle.saves._quiet.clear()
        quiet += sum(d in r.saves._quiet for d in out.scheduled_cached_reqs.req_ids)
        plan = _plain(r.build_plan(out))
        assert plan == _plain(oracle.build_plan(out))
        saves += len(plan[0])
        for x in (r, oracle):
            x.update_output(report, None)
            for req in finished:
                x.request_finished(req)
        for req in r.tracker._states:
            a, b = r.tracker.get(req), oracle.tracker.get(req)
            assert (a.save_from, a.save_wait, a.block_table) == (b.save_from, b.save_wait, b.block_table)
    assert quiet and saves  # the bulk path was taken, and saves were planned


def test_steady_decodes_go_apart_column_by_column_after_the_other_requests() -> None:
    out = Out([NewReq("n", [1] * 9, ([5, 6],), 0)],
              Cached(["a", "grown", "b", "back"], [None, ([7],), None, ([8, 9],)], [17, 9, 30, 0], {"back"}),
              num_scheduled_tokens={"n": 9, "a": 1, "grown": 2, "b": 3, "back": 12})
    computes, decodes, copies, ended = computes_of(out)
    assert computes == (Compute("n", 0, 9, (5, 6), True), Compute("grown", 9, 2, (7,), False),
                        Compute("back", 0, 12, (8, 9), True))
    assert decodes == Decodes(("a", "b"), (17, 30), (1, 3)) and copies == () and ended == ()
    only = computes_of(Out(scheduled_cached_reqs=Cached(["a"], [None], [17]), num_scheduled_tokens={"a": 1}))
    assert only[:2] == ((), Decodes(("a",), (17,), (1,)))
