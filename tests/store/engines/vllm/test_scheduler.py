"""The scheduler role against vLLM-shaped request and step objects, over a real local store.

What vLLM's scheduler does with the answers is not simulated here (the engine tests run vLLM);
these pin the connector's side of the contract: the numbers it answers, the loads and saves it
plans, what it counts, and that none of it raises.
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from store.engines.vllm.fetches import Pending
from store.engines.vllm.metadata import LoadResult, WorkerReport
from tests.store.engines.vllm.scheduler_fakes import (
    BOLT_SALT,
    EB,
    KB,
    Cached,
    NewReq,
    Out,
    Req,
    config,
    role,
    store_prefix,
    tokens,
)


def ask(r, req, computed=0):
    return r.get_num_new_matched_tokens(req, computed)


def test_a_stored_prefix_is_answered_in_engine_blocks_leaving_one_token(tmp_path) -> None:
    ids = tokens(3 * KB + 5)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    req = Req("r1", ids)
    r.on_new_request(req)
    assert ask(r, req) == (3 * KB, False)
    table = list(range(100, 107))  # 7 engine blocks for 53 tokens
    r.update_state_after_alloc(req, table, 3 * KB)
    plan = r.build_plan(Out([NewReq("r1", ids, (table,), 3 * KB)], num_scheduled_tokens={"r1": 5}))
    (load,) = plan.loads
    assert (load.start, load.end, load.block_ids, load.tenant, load.chat) == (0, 48, tuple(table[:6]), "acme", False)
    assert load.token_ids == tuple(ids[:48])
    assert plan.prompt_tokens == 5 and plan.saves == ()  # everything full is stored already
    assert r.build_plan(Out()).loads == ()  # a load is sent once


def test_a_fully_stored_prompt_still_leaves_its_last_token_to_the_engine(tmp_path) -> None:
    ids = tokens(3 * KB)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    assert ask(r, Req("r", ids)) == (3 * KB - EB, False)  # 40: the last engine block is computed


def test_vllms_own_hit_is_not_loaded_again_and_the_second_half_of_a_block_is(tmp_path) -> None:
    ids = tokens(3 * KB + 5)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req, computed=3 * EB) == (3 * KB - 3 * EB, False)  # from the middle of kvwarm block 1
    table = list(range(20, 27))
    r.update_state_after_alloc(req, table, 3 * KB - 3 * EB)
    (load,) = r.build_plan(Out()).loads
    assert (load.start, load.end, load.block_ids) == (24, 48, (23, 24, 25))
    assert load.token_ids == tuple(ids[:48])  # the chain from its root
    r.update_output(WorkerReport([LoadResult("r", loaded=24, planned=24)]), None)
    assert ask(r, req, computed=3 * KB) == (0, False)  # preempted, then asked again: vLLM's cache has it all
    assert "misses:engine_cached" not in r.stats()  # the request was counted once, as a hit
    assert (r.stats()["lookups"], r.stats()["hits"]) == (1, 1)


def test_repeated_asks_probe_once_and_count_once(tmp_path, monkeypatch) -> None:
    ids = tokens(2 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    calls = []
    real = r.probe.probe
    monkeypatch.setattr(r.probe, "probe", lambda *a: calls.append(a) or real(*a))
    req = Req("r", ids)
    for _ in range(17):  # a request waiting for free blocks is asked at every step
        assert ask(r, req) == (2 * KB, False)
    assert len(calls) == 1 and "lookups" not in r.stats()  # counted with its outcome: the worker's report
    r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    r.update_output(WorkerReport([LoadResult("r", loaded=2 * KB, planned=2 * KB)]), None)
    assert (r.stats()["lookups"], r.stats()["hits"]) == (1, 1)


@pytest.mark.parametrize("case, reason", [
    ("absent", "absent"), ("short", "short_prompt"), ("cached", "engine_cached"),
    ("salt", "tenant_unknown"), ("claim", "tenant_refused"), ("name", "tenant_unverified"), ("lora", "unsupported"),
    ("image", "unsupported"),
])
def test_misses_are_counted_under_their_reason(tmp_path, case: str, reason: str) -> None:
    ids = tokens(2 * KB + 3)
    if case == "cached":
        store_prefix(tmp_path, ids)
    r = role(tmp_path)
    req = {"absent": Req("r", ids), "short": Req("r", ids[: KB - 1]), "cached": Req("r", ids),
           "salt": Req("r", ids, cache_salt="not-mapped"),
           "claim": Req("r", ids, cache_salt=BOLT_SALT, kv_transfer_params={"kvwarm_tenant": "acme"}),
           "name": Req("r", ids, kv_transfer_params={"kvwarm_tenant": "mallory"})}.get(case) or Req("r", ids)
    if case == "lora":
        req.lora_request = object()
    if case == "image":
        req.mm_features = [object()]
    r.on_new_request(req)
    assert ask(r, req, computed=2 * KB if case == "cached" else 0) == (0, False)
    s = r.stats()
    assert s["lookups"] == 1 and s[f"misses:{reason}"] == 1 and s.get("hits", 0) == 0
    # the client is told no tenancy reason (test_scheduler_tenancy.py)
    assert r.request_finished(req)["kvwarm"]["reason"] == ("absent" if reason.startswith("tenant_") else reason)


def test_another_tenants_prefix_is_refused_and_counted_and_public_serves_both(tmp_path) -> None:
    theirs, shared = tokens(2 * KB + 1, seed=1), tokens(2 * KB + 1, seed=2)
    store_prefix(tmp_path, theirs, namespace="bolt")
    store_prefix(tmp_path, shared, namespace="public")
    r = role(tmp_path)
    a = Req("a", theirs)  # acme: the default tenant
    assert ask(r, a) == (0, False)
    s = r.stats()
    assert s["refused_cross_tenant"] == 1 and s["misses:tenant_refused"] == 1
    b = Req("b", theirs, cache_salt=BOLT_SALT)
    assert ask(r, b) == (2 * KB, False)
    for i, salt in enumerate([BOLT_SALT, None]):
        req = Req(f"p{i}", shared, cache_salt=salt)
        assert ask(r, req) == (2 * KB, False)
        r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    assert {ld.tenant for ld in r.build_plan(Out()).loads} == {"acme", "bolt"}


def test_a_chat_keyed_prefix_is_found_and_the_longer_chain_wins(tmp_path) -> None:
    ids = tokens(3 * KB + 1)
    store_prefix(tmp_path, ids, chat=True)
    store_prefix(tmp_path, ids, blocks=1)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req) == (3 * KB, False)
    r.update_state_after_alloc(req, list(range(7)), 3 * KB)
    assert r.build_plan(Out()).loads[0].chat is True
    assert ask(role(tmp_path, chat=False), Req("r2", ids)) == (KB, False)  # no chat template: plain only


def test_a_hit_slower_than_prefill_is_answered_zero(tmp_path) -> None:
    ids = tokens(2 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path, rate=1e12)  # an engine that prefills faster than any disk
    assert ask(r, Req("r", ids)) == (0, False)
    assert r.stats()["misses:slower_than_prefill"] == 1


def test_write_back_plans_the_blocks_the_store_lacks_as_they_complete(tmp_path) -> None:
    ids = tokens(4 * KB + 3)
    store_prefix(tmp_path, ids, blocks=1)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req) == (KB, False)
    table = list(range(40, 49))
    r.update_state_after_alloc(req, table, KB)
    # chunked prefill: tokens 16..40 this step, the rest next step
    plan = r.build_plan(Out([NewReq("r", ids, (table,), KB)], num_scheduled_tokens={"r": 24}))
    (save,) = plan.saves
    assert (save.first, save.block_ids, save.tenant, save.token_ids) == (1, (42, 43), "acme", tuple(ids[: 2 * KB]))
    plan = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [None], [2 * KB + 8]), num_scheduled_tokens={"r": 35}))
    (save,) = plan.saves
    assert (save.first, save.block_ids) == (2, (44, 45, 46, 47))
    decode = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [([49],)], [4 * KB + 3]),
                              num_scheduled_tokens={"r": 1}))
    assert decode.saves == () and (decode.prompt_tokens, decode.other_tokens) == (0, 1)


def test_with_loads_off_a_stored_prefix_is_a_miss_and_write_back_still_plans_its_blocks(tmp_path) -> None:
    ids = tokens(3 * KB + 3)
    store_prefix(tmp_path, ids, blocks=1)
    r = role(tmp_path, load_mode="off")
    req = Req("r", ids)
    assert ask(r, req) == (0, False)  # block 0 is stored, but nothing is loaded
    assert r.stats()["misses:loads_off"] == 1 and "hits" not in r.stats()
    table = list(range(40, 47))
    r.update_state_after_alloc(req, table, 0)
    plan = r.build_plan(Out([NewReq("r", ids, (table,), 0)], num_scheduled_tokens={"r": 3 * KB + 3}))
    (save,) = plan.saves
    # every full block (the writer skips the one the store holds: no lookup told the scheduler of it)
    assert plan.loads == () and (save.first, save.block_ids) == (0, tuple(table[:6]))


def test_no_write_back_for_public_or_when_off(tmp_path) -> None:
    ids = tokens(2 * KB + 1)
    for r in (role(tmp_path, tenant="public"), role(tmp_path, write_back=False)):
        req = Req("r", ids)
        assert ask(r, req) == (0, False)
        plan = r.build_plan(Out([NewReq("r", ids, ([1, 2, 3, 4, 5],), 0)], num_scheduled_tokens={"r": 33}))
        assert plan.saves == ()


def test_a_resumed_request_replaces_its_block_table(tmp_path) -> None:
    ids = tokens(2 * KB + 1)
    r = role(tmp_path)
    req = Req("r", ids)
    ask(r, req)
    assert r.build_plan(Out([NewReq("r", ids, ([1, 2, 3, 4, 5],), 0)], num_scheduled_tokens={"r": 8})).saves == ()
    plan = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [([9, 8, 7, 6, 5],)], [0], {"r"}),
                            num_scheduled_tokens={"r": 33}))
    assert [s.block_ids for s in plan.saves] == [(9, 8, 7, 6)]


def test_a_failed_load_is_reported_and_its_recomputed_blocks_are_written_back(tmp_path) -> None:
    ids = tokens(3 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    req = Req("r", ids)
    assert ask(r, req) == (3 * KB, False)
    table = list(range(10, 17))
    r.update_state_after_alloc(req, table, 3 * KB)
    r.build_plan(Out([NewReq("r", ids, (table,), 3 * KB)], num_scheduled_tokens={"r": 1}))
    r.update_output(WorkerReport([LoadResult("r", loaded=KB, planned=3 * KB, reason="corrupt")]), None)
    # vLLM recomputes from the first bad block: the request comes back with its computed count cut there
    plan = r.build_plan(Out(scheduled_cached_reqs=Cached(["r"], [None], [KB]), num_scheduled_tokens={"r": 2 * KB + 1}))
    assert [(s.first, s.block_ids) for s in plan.saves] == [(1, (12, 13, 14, 15))]
    assert r.request_finished(req)["kvwarm"] == {"loaded_tokens": KB, "reason": "corrupt"}


def test_a_request_whose_load_failed_is_not_loaded_again(tmp_path) -> None:
    ids = tokens(2 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path, async_loads=True)
    req = Req("r", ids)
    assert ask(r, req) == (2 * KB, True)
    r.update_state_after_alloc(req, [1, 2, 3, 4], 2 * KB)
    r.build_plan(Out())
    # its snapshots were evicted before the worker read them: vLLM frees the request's blocks and asks again
    r.update_output(WorkerReport([LoadResult("r", loaded=0, planned=2 * KB, reason="absent")]), None)
    assert ask(r, req) == (0, False)
    assert r.build_plan(Out()).loads == ()
    totals = r.stats()
    assert totals["lookups"] == 1 and totals["misses:absent"] == 1


def test_a_load_unreported_when_the_request_finishes_worked(tmp_path) -> None:
    ids = tokens(2 * KB + 1)
    store_prefix(tmp_path, ids)
    r = role(tmp_path)
    req = Req("r", ids)
    ask(r, req)
    r.update_state_after_alloc(req, list(range(5)), 2 * KB)
    r.build_plan(Out())
    assert r.request_finished(req)["kvwarm"]["loaded_tokens"] == 2 * KB
    assert r.request_finished(req) == {} and len(r.tracker) == 0


def test_worker_reports_move_the_estimates(tmp_path) -> None:
    r = role(tmp_path)
    before = r.costs.prefill_seconds(1000)
    r.update_output(WorkerReport(forward_tokens=1000, forward_seconds=10.0), {"tokens_loaded": 5})
    assert r.costs.prefill_seconds(1000) != before and r.stats()["estimates"]["prefill_rate_source"] == "measured"
    assert r.stats()["tokens_loaded"] == 5


class StubFetches:
    """RemoteFetches' surface, recording what the scheduler asks of S3."""

    def __init__(self, mode: str) -> None:
        self.mode, self.has_remote, self.handed = mode, True, 0
        self.waits, self.backgrounds = [], []
        self.future: cf.Future = cf.Future()
        self.now = 0.0

    def usable(self, tenant):
        return True

    def wait_for(self, tenant, scope, blocks):
        self.waits.append(len(blocks))
        return Pending(self.future, self.now + 2.0)

    def background(self, tenant, scope, blocks):
        self.backgrounds.append(len(blocks))

    def close(self):
        pass


def test_sync_mode_asks_again_until_the_s3_copy_lands(tmp_path) -> None:
    ids = tokens(3 * KB + 1)
    store_prefix(tmp_path, ids, blocks=1)
    stub = StubFetches("sync")
    r = role(tmp_path, clock=lambda: stub.now)
    r.fetches = stub
    req = Req("r", ids)
    assert ask(r, req) == (None, False) and ask(r, req) == (None, False)
    store_prefix(tmp_path, ids)  # the copy lands in NVMe
    stub.future.set_result((3, None))
    assert ask(r, req) == (3 * KB, False) and stub.waits == [3]
    assert r.stats().get("shortened:fetch_timeout", 0) == 0


def test_sync_mode_gives_up_at_the_timeout_and_counts_it(tmp_path) -> None:
    ids = tokens(3 * KB + 1)
    store_prefix(tmp_path, ids, blocks=1)
    stub = StubFetches("sync")
    r = role(tmp_path, clock=lambda: stub.now)
    r.fetches = stub
    req = Req("r", ids)
    assert ask(r, req) == (None, False)
    stub.now = 2.5
    assert ask(r, req) == (KB, False)
    r.update_state_after_alloc(req, list(range(7)), KB)
    r.update_output(WorkerReport([LoadResult("r", loaded=KB, planned=KB)]), None)
    assert r.stats()["shortened:fetch_timeout"] == 1  # with the hit


def test_background_mode_answers_now_and_fetches_for_next_time(tmp_path) -> None:
    ids = tokens(3 * KB + 1)
    stub = StubFetches("background")
    r = role(tmp_path)
    r.fetches = stub
    assert ask(r, Req("r", ids)) == (0, False)
    assert stub.backgrounds == [3] and r.stats()["misses:fetch_scheduled"] == 1


def test_nothing_raises_into_vllm(tmp_path, monkeypatch) -> None:
    ids = tokens(2 * KB + 1)
    r = role(tmp_path)
    monkeypatch.setattr(r.probe, "probe", lambda *a: 1 / 0)
    assert ask(r, Req("r", ids)) == (0, False)
    r.update_state_after_alloc(Req("x", ids), [1, 2, 3, 4], 2 * KB)  # a load nobody planned: sent, to be failed
    (load,) = r.build_plan(Out()).loads
    assert load.token_ids == () and load.block_ids == (1, 2, 3, 4)


def test_memory_follows_the_requests_in_flight(tmp_path) -> None:
    r = role(tmp_path, cfg=config(public_prefixes=False))
    for i in range(2000):
        req = Req(f"r{i}", tokens(KB + 3, seed=i))
        r.on_new_request(req)
        ask(r, req)
        r.build_plan(Out([NewReq(req.request_id, req.prompt_token_ids, ([1, 2, 3],), 0)],
                         num_scheduled_tokens={req.request_id: KB + 3}))
        r.request_finished(req)
    assert len(r.tracker) == 0 and r.stats()["lookups"] == 2000


def test_write_back_extends_the_chain_the_hit_is_in_and_copies_a_public_head(tmp_path) -> None:
    chat_ids, pub_ids = tokens(3 * KB + 1, seed=8), tokens(3 * KB + 1, seed=9)
    store_prefix(tmp_path, chat_ids, chat=True, blocks=1)  # prefill warm --chat stored the head
    store_prefix(tmp_path, pub_ids, namespace="public", blocks=1)
    r = role(tmp_path)
    for name, ids in (("c", chat_ids), ("p", pub_ids)):
        req = Req(name, ids)
        assert ask(r, req) == (KB, False)
        r.update_state_after_alloc(req, list(range(7)), KB)
    plan = r.build_plan(Out([NewReq("c", chat_ids, (list(range(7)),), KB), NewReq("p", pub_ids, (list(range(7)),), KB)],
                            num_scheduled_tokens={"c": 2 * KB + 1, "p": 2 * KB + 1}))
    saves = {s.req_id: s for s in plan.saves}
    assert (saves["c"].chat, saves["c"].first) == (True, 1)  # the tail of the chat-keyed chain it extends
    assert (saves["p"].chat, saves["p"].first) == (False, 0)  # public's head is copied: a chain starts at its root
    assert saves["p"].tenant == "acme"  # into the tenant's own namespace: write-back never writes public
    inside = tokens(KB + 3, seed=10)  # a prompt that does not go past the public chain is not copied
    store_prefix(tmp_path, inside, namespace="public")
    req = Req("i", inside)
    assert ask(r, req) == (KB, False)
    r.update_state_after_alloc(req, list(range(3)), KB)
    assert r.build_plan(Out([NewReq("i", inside, (list(range(3)),), KB)], num_scheduled_tokens={"i": 3})).saves == ()
