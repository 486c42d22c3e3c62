"""The scheduler role's counters: each request's lookup once, a hit only when the worker loaded it.

vLLM's calls are replayed in the orders vLLM 0.32 makes them (vllm/v1/core/sched/scheduler.py):
an answer overridden with 0 (``skip_reading_prefix_cache``), a preempted request asked and
allocated again, a request finished in the step its load ran (the worker's report comes after
``request_finished``), one aborted while it waited. After each, ``lookups == hits + misses``.
"""
from __future__ import annotations

import threading

from store.engines.vllm.audit import Check, CrossTenantAudit
from store.engines.vllm.metadata import LoadResult, WorkerReport
from store.engines.vllm.stats import Counters
from tests.store.engines.vllm.scheduler_fakes import EB, KB, Out, Req, role, store_prefix, tokens


def ask(r, req, computed=0):
    return r.get_num_new_matched_tokens(req, computed)


def loaded(r, req_id: str, tokens_loaded: int, planned: int, reason: str | None = None) -> None:
    r.update_output(WorkerReport([LoadResult(req_id, tokens_loaded, planned, reason=reason)]), None)


def balanced(stats: dict) -> bool:
    misses = sum(v for k, v in stats.items() if k.startswith("misses:"))
    return stats.get("lookups", 0) == stats.get("hits", 0) + misses


def stored(tmp_path, n_blocks: int = 2, seed: int = 0) -> list[int]:
    ids = tokens(n_blocks * KB + 1, seed=seed)
    store_prefix(tmp_path, ids)
    return ids


def test_a_hit_is_counted_when_the_worker_reports_the_load_not_when_answered(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req) == (2 * KB, False)
    r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    r.build_plan(Out())
    s = r.stats()
    assert s["tokens_matched"] == 2 * KB and "hits" not in s and "lookups" not in s
    loaded(r, "r", 2 * KB, 2 * KB)
    s = r.stats()
    assert (s["lookups"], s["hits"]) == (1, 1) and balanced(s)


def test_a_load_that_wrote_nothing_is_a_miss_under_the_workers_reason(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    req = Req("r", ids)
    ask(r, req)
    r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    loaded(r, "r", 0, 2 * KB, reason="corrupt")
    s = r.stats()
    assert s.get("hits", 0) == 0 and s["misses:corrupt"] == 1 and balanced(s)
    assert r.request_finished(req)["kvwarm"] == {"loaded_tokens": 0, "reason": "corrupt"}


def test_an_answer_vllm_overrides_with_0_is_no_hit(tmp_path, monkeypatch) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    probes = []
    monkeypatch.setattr(r.probe, "probe", lambda *a: probes.append(a))
    req = Req("r", ids, skip_reading_prefix_cache=True)  # prompt logprobs: vLLM computes every prompt token
    assert ask(r, req) == (0, False)
    r.update_state_after_alloc(req, list(range(5)), 0)  # what vLLM allocates after its override
    assert r.build_plan(Out()).loads == () and probes == []
    s = r.stats()
    assert s["misses:skip_reading_prefix_cache"] == 1 and s.get("hits", 0) == 0 and balanced(s)
    assert r.request_finished(req)["kvwarm"]["reason"] == "skip_reading_prefix_cache"


def test_a_preempted_request_that_reloads_is_counted_once(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    req = Req("r", ids)
    for _ in range(3):  # the first run, then two preemptions: asked from 0 again, allocated, loaded
        assert ask(r, req) == (2 * KB, False)
        r.update_state_after_alloc(req, list(range(5)), 2 * KB)
        (load,) = r.build_plan(Out()).loads
        loaded(r, "r", load.end - load.start, load.end - load.start)
    s = r.stats()
    assert (s["lookups"], s["hits"], s["tokens_matched"]) == (1, 1, 2 * KB) and balanced(s)


def test_a_request_finished_before_its_load_is_reported_is_counted_by_the_report(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    req = Req("r", ids)
    ask(r, req)
    r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    r.build_plan(Out())
    # max_tokens=1: vLLM finishes it in the step its load ran, and hands the connector that step's report after
    assert r.request_finished(req)["kvwarm"] == {"loaded_tokens": 2 * KB, "reason": None}
    assert "hits" not in r.stats()
    loaded(r, "r", 2 * KB, 2 * KB)
    s = r.stats()
    assert (s["lookups"], s["hits"]) == (1, 1) and balanced(s) and not r._finishing


def test_an_answer_vllm_took_none_of_is_engine_cached(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req, computed=EB) == (2 * KB - EB, False)
    r.update_state_after_alloc(req, list(range(5)), 0)  # vLLM kept its own partial block: nothing external
    s = r.stats()
    assert s["misses:engine_cached"] == 1 and balanced(s)


def test_a_request_aborted_while_it_waits_is_a_miss_and_one_never_asked_is_nothing(tmp_path) -> None:
    ids = stored(tmp_path)
    r = role(tmp_path)
    waited, never = Req("w", ids), Req("n", ids)
    ask(r, waited)  # answered; no free blocks, so never allocated; then the client goes away
    r.on_new_request(never)
    r.request_finished(waited)
    r.request_finished(never)
    s = r.stats()
    assert (s["lookups"], s["misses:aborted"]) == (1, 1) and balanced(s)


def test_lookups_are_hits_plus_misses_over_a_mix(tmp_path) -> None:
    theirs = tokens(2 * KB + 1, seed=11)
    store_prefix(tmp_path, theirs, namespace="bolt")
    ids = stored(tmp_path)
    r = role(tmp_path)
    reqs = [Req("hit", ids), Req("cold", tokens(2 * KB + 1, seed=12)), Req("theirs", theirs),
            Req("short", ids[:3]), Req("salt", ids, cache_salt="nope"), Req("lora", ids, lora_request=object())]
    for req in reqs:
        r.on_new_request(req)
        n, _ = ask(r, req)
        if n:
            r.update_state_after_alloc(req, list(range(5)), n)
            loaded(r, req.request_id, n, n)
        r.request_finished(req)
    s = r.stats()
    assert s["lookups"] == len(reqs) and s["hits"] == 1 and s["refused_cross_tenant"] == 1 and balanced(s)


class SlowProbe:
    """``held_by_others`` that waits until told to go (a check in flight)."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def held_by_others(self, tenant, head):
        self.go.wait(10)
        return ["bolt"] if head[0] == 1 else []


def test_a_check_that_does_not_fit_its_queue_is_counted_at_once_unchecked() -> None:
    probe, counters = SlowProbe(), Counters()
    audit = CrossTenantAudit(probe, counters, capacity=1)
    try:
        for i in range(4):  # one in the thread, one queued, the rest dropped
            audit.submit(Check(f"r{i}", "acme", (1, 2), "absent"))
        assert not audit.flush(0.05)
        dropped = counters.totals()
        assert dropped["cross_tenant_unchecked"] in (2, 3) and dropped["lookups"] == dropped["misses:absent"]
        probe.go.set()
        assert audit.flush(5)
        s = counters.totals()
        assert s["lookups"] == 4 and s["lookups"] == s["misses:absent"] + s.get("misses:tenant_refused", 0)
        assert s.get("refused_cross_tenant", 0) == s.get("misses:tenant_refused", 0) == 4 - dropped["lookups"]
    finally:
        audit.close()
