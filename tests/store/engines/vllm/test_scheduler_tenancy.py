"""What a client learns about tenants through the scheduler role: nothing (over a real local store).

Everything the connector hands back for a request (its answer to vLLM, the loads it plans, the
``kv_transfer_params`` vLLM returns to the client) is compared between two requests that differ
only in what the client must not learn: whether another tenant holds the prefix, whether a
tenant name or salt it tried is configured. The store probes the connector makes on the
request's own path are compared too (the work that could show in response time); the refusals
must still reach the server's counters.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from store.engines.vllm.metadata import LoadResult, WorkerReport
from tests.store.engines.vllm.scheduler_fakes import BOLT_SALT, KB, NewReq, Out, Req, config, role, store_prefix, tokens


def seen(r, req: Req, computed: int = 0) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """Everything the client gets from the connector for ``req`` (asked, allocated, stepped, loaded,
    finished, as vLLM drives it), and the store probes made on the calling thread meanwhile."""
    calls: list[tuple[Any, ...]] = []
    real, caller = r.probe.local.probe, threading.current_thread()

    def spy(tenant, blocks, root, **kw):
        if threading.current_thread() is caller:
            calls.append((tenant.name, root.salt_id, tuple(b.key for b in blocks)))
        return real(tenant, blocks, root, **kw)

    r.probe.local.probe = spy
    try:
        r.on_new_request(req)
        answer = r.get_num_new_matched_tokens(req, computed)
        table = list(range(len(req.prompt_token_ids) // 8 + 1))
        if answer[0]:
            r.update_state_after_alloc(req, table, answer[0])
        plan = r.build_plan(Out([NewReq(req.request_id, req.prompt_token_ids, (table,), computed + (answer[0] or 0))],
                                num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - (answer[0] or 0)}))
        loads = [ld for ld in plan.loads if ld.req_id == req.request_id]
        r.update_output(WorkerReport([LoadResult(ld.req_id, ld.end - ld.start, ld.end - ld.start) for ld in loads]),
                        None)
        finished = r.request_finished(req)
    finally:
        del r.probe.local.probe
    return {"answer": answer, "loads": loads, "kv_transfer_params": finished}, calls


def two_stores(tmp_path: Path, ids: list[int], holder: str, **kw: Any):
    """A role over a store where ``holder`` holds ``ids``, and one over a store where nobody does."""
    store_prefix(tmp_path / "held", ids, namespace=holder)
    return role(tmp_path / "held", **kw), role(tmp_path / "empty", **kw)


@pytest.mark.parametrize("salt, asker, holder", [(None, "acme", "bolt"),  # acme as the default tenant
                                                 (BOLT_SALT, "bolt", "acme")])  # bolt by its salt
def test_a_miss_looks_the_same_whether_or_not_another_tenant_holds_the_prefix(tmp_path, salt, asker, holder) -> None:
    ids = tokens(3 * KB + 5, seed=3)
    held, empty = two_stores(tmp_path, ids, holder)
    got, got_calls = seen(held, Req("r", ids, cache_salt=salt))
    want, want_calls = seen(empty, Req("r", ids, cache_salt=salt))
    assert got == want and got_calls == want_calls
    assert got["kv_transfer_params"] == {"kvwarm": {"loaded_tokens": 0, "reason": "absent"}}
    assert {c[0] for c in got_calls} == {asker}  # the holder's namespace is probed off the request path only
    # ... and the server counts the refusal
    s, e = held.stats(), empty.stats()
    assert (s["refused_cross_tenant"], s["misses:tenant_refused"], s["lookups"]) == (1, 1, 1)
    assert (e.get("refused_cross_tenant", 0), e["misses:absent"], e["lookups"]) == (0, 1, 1)


def test_a_hit_of_its_own_is_unchanged_by_another_tenant_holding_the_same_prefix(tmp_path) -> None:
    ids = tokens(2 * KB + 1, seed=4)
    held, empty = two_stores(tmp_path, ids, "bolt")
    for r in (held, empty):
        store_prefix(tmp_path / ("held" if r is held else "empty"), ids, namespace="acme")
    assert seen(held, Req("r", ids)) == seen(empty, Req("r", ids))
    assert held.stats()["hits"] == 1 and "refused_cross_tenant" not in held.stats()


@pytest.mark.parametrize("trust_named", [False, True])
def test_a_configured_tenant_name_and_an_unknown_one_look_the_same(tmp_path, trust_named) -> None:
    ids = tokens(3 * KB + 5, seed=5)
    store_prefix(tmp_path / "s", ids, namespace="acme")  # the default tenant's: neither claim may reach it
    r = role(tmp_path / "s", cfg=config(trust_named=trust_named))
    views = [seen(r, Req(f"r{i}", ids, kv_transfer_params={"kvwarm_tenant": name}))[0]
             for i, name in enumerate(["bolt", "mallory", "public-ish", "Not A Name", 7])]
    assert all(v == views[0] for v in views), views
    assert views[0]["kv_transfer_params"] == {"kvwarm": {"loaded_tokens": 0, "reason": "absent"}}
    s = r.stats()
    if trust_named:  # bolt is served, refused acme's prefix; the others are unknown, on the server's side
        assert (s["misses:tenant_refused"], s["refused_cross_tenant"], s["misses:tenant_unknown"]) == (1, 1, 4)
    else:
        assert s["misses:tenant_unverified"] == 5


def test_a_mapped_salt_with_nothing_stored_and_an_unmapped_one_look_the_same(tmp_path) -> None:
    ids, short = tokens(3 * KB + 5, seed=6), tokens(KB - 1, seed=6)
    r = role(tmp_path)
    for prompt in (ids, short):  # a short prompt is told short_prompt either way, as the probe says
        mapped, _ = seen(r, Req("m", prompt, cache_salt=BOLT_SALT))
        unmapped, _ = seen(r, Req("u", prompt, cache_salt="salt-nobody"))
        conflict, _ = seen(r, Req("c", prompt, cache_salt=BOLT_SALT, kv_transfer_params={"kvwarm_tenant": "acme"}))
        assert mapped == unmapped == conflict
    assert mapped["kv_transfer_params"]["kvwarm"]["reason"] == "short_prompt"
    s = r.stats()
    assert (s["misses:tenant_unknown"], s["misses:tenant_refused"], s["lookups"]) == (2, 2, 6)


def test_a_name_without_its_salt_loads_nothing_while_trust_named_is_off(tmp_path) -> None:
    ids = tokens(2 * KB + 1, seed=7)
    store_prefix(tmp_path, ids, namespace="bolt")
    r = role(tmp_path)
    view, _ = seen(r, Req("r", ids, kv_transfer_params={"kvwarm_tenant": "bolt"}))
    assert view["answer"] == (0, False) and view["loads"] == []
    assert r.stats()["misses:tenant_unverified"] == 1
    salted, _ = seen(r, Req("s", ids, cache_salt=BOLT_SALT, kv_transfer_params={"kvwarm_tenant": "bolt"}))
    assert salted["answer"] == (2 * KB, False) and salted["loads"][0].tenant == "bolt"  # the salt is the secret


def test_a_name_loads_its_tenants_prefix_when_the_gateway_is_trusted(tmp_path) -> None:
    ids = tokens(2 * KB + 1, seed=8)
    store_prefix(tmp_path, ids, namespace="bolt")
    r = role(tmp_path, cfg=config(trust_named=True))
    view, _ = seen(r, Req("r", ids, kv_transfer_params={"kvwarm_tenant": "bolt"}))
    assert view["answer"] == (2 * KB, False) and [ld.tenant for ld in view["loads"]] == ["bolt"]
    assert view["kv_transfer_params"] == {"kvwarm": {"loaded_tokens": 2 * KB, "reason": None}}
    assert r.stats()["hits"] == 1
