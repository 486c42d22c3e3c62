"""The worker role over a real local store and engine-shaped CPU caches: loads, failures, write-back, prefetch."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from store.engines.vllm.agents import start_agents
from store.engines.vllm.decodes import Decodes
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from store.engines.vllm.paging import read_layer, write_layer
from store.engines.vllm.settings import ConnectorSettings
from store.engines.vllm.validity import Compute
from store.engines.vllm.worker import WorkerRole
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.plan import Plan, PlanEntry, write_plan
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import (
    EB,
    IDENT,
    KB,
    NB,
    D,
    H,
    L,
    cfg,
    expected,
    new,
    step,
    store_blocks,
    tokens,
)


def test_a_load_writes_the_stored_kv_into_the_planned_blocks_from_vllms_hit(tmp_path, worker) -> None:
    ids = tokens(3 * KB + 5)
    store_blocks(tmp_path, ids)
    # vLLM's own cache holds the first engine block: the load starts in the middle of kvwarm block 0
    spec = LoadSpec("r", "acme", False, tuple(ids[: 3 * KB]), EB, 3 * KB, (40, 7, 33, 2, 19))
    worker.start_load(StepPlan(loads=(spec,)))
    assert worker.take_failed() == set()
    (result,) = worker.take_report().loads
    assert (result.loaded, result.planned, result.reason) == (3 * KB - EB, 3 * KB - EB, None) and result.nbytes > 0
    for layer in range(L):
        k, v = read_layer(worker.caches[layer], worker.layout, list(spec.block_ids))
        want_k = torch.cat([expected(b)[layer][0] for b in range(3)], dim=1)[:, EB:]
        want_v = torch.cat([expected(b)[layer][1] for b in range(3)], dim=1)[:, EB:]
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert bool((worker.caches[0][[0, 1, 3]] == -3.0).all())  # nothing else written
    assert worker.counters.totals()["tokens_loaded"] == 3 * KB - EB


def test_what_is_not_there_is_reported_by_block_id_and_counted(tmp_path, worker) -> None:
    ids = tokens(3 * KB + 1, seed=1)
    chain = store_blocks(tmp_path, ids)
    (tmp_path / "nvme" / "objects" / "acme" / chain[1].key[:2] / f"{chain[1].key}.kvw").unlink()  # evicted meanwhile
    spec = LoadSpec("r", "acme", False, tuple(ids[: 3 * KB]), 0, 3 * KB, tuple(range(10, 16)))
    unplanned = LoadSpec("x", "acme", False, (), 0, 2 * EB, (20, 21))
    worker.start_load(StepPlan(loads=(spec, unplanned)))
    assert worker.take_failed() == {12, 13, 14, 15, 20, 21}  # block 0 loaded; the rest recomputed by vLLM
    results = {r.req_id: r for r in worker.take_report().loads}
    assert (results["r"].loaded, results["r"].reason) == (KB, "absent")
    assert results["x"].loaded == 0
    assert worker.counters.totals()["load_failures:absent"] == 1 and worker.take_failed() == set()


def test_a_corrupt_snapshot_fails_its_blocks_and_is_quarantined(tmp_path, worker) -> None:
    ids = tokens(2 * KB + 1, seed=2)
    chain = store_blocks(tmp_path, ids)
    path = tmp_path / "nvme" / "objects" / "acme" / chain[0].key[:2] / f"{chain[0].key}.kvw"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    worker.start_load(StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),)))
    assert worker.take_failed() == {1, 2, 3, 4}
    assert worker.take_report().loads[0].reason == "corrupt" and not path.exists()


def test_write_back_stores_what_the_engine_computed_and_skips_what_is_stored(tmp_path, worker) -> None:
    ids = tokens(3 * KB + 3, seed=3)
    store_blocks(tmp_path, ids, blocks=1)
    table = [50, 51, 52, 53, 54, 55]
    for layer in range(L):  # the engine "computed" blocks 1 and 2
        k = torch.cat([expected(b)[layer][0] for b in (1, 2)], dim=1)
        v = torch.cat([expected(b)[layer][1] for b in (1, 2)], dim=1)
        write_layer(worker.caches[layer], worker.layout, table[2:6], k, v)
    step(worker, StepPlan(saves=(SaveSpec("r", "acme", False, 1, tuple(ids[: 3 * KB]), tuple(table[2:6])),
                                 SaveSpec("s", "acme", False, 0, tuple(ids[:KB]), tuple(table[:2]))),
                          computes=(new("r", table, KB, 2 * KB), new("s", table[:2], 0, KB))))
    assert worker.writer.drain(HANG_S)
    totals = worker.counters.totals()
    assert totals["written_back_blocks"] == 2 and totals["write_back_skipped:present"] == 1
    c = cfg()
    tenant = c.tenant("acme")
    root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
    store = Store.open(f"file://{tmp_path}/nvme", c)
    for b in (1, 2):
        snap = store.get(tenant, block_chain(root, ids)[b], root)
        assert snap is not None and snap.header.origin == "write-back"  # the header says where the KV was computed
        for layer in range(L):
            k, v = snap.layer(layer, torch.bfloat16)
            assert torch.equal(k, expected(b)[layer][0]) and torch.equal(v, expected(b)[layer][1])
    store.close()


def test_no_write_back_of_a_request_whose_load_failed_in_the_step(tmp_path, worker) -> None:
    ids = tokens(2 * KB + 1, seed=4)
    step(worker, StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),),
                          saves=(SaveSpec("r", "acme", False, 0, tuple(ids[: 2 * KB]), (1, 2, 3, 4)),),
                          computes=(new("r", (1, 2, 3, 4, 5), 2 * KB, 1),)))
    assert worker.writer.drain(HANG_S) and "written_back_blocks" not in worker.counters.totals()
    assert worker.counters.totals()["write_back_dropped:invalid"] == 2
    assert worker.take_report().refused == {"r": 0}  # the scheduler plans block 0 again


def test_a_full_queue_drops_saves_and_counts_them(tmp_path, worker) -> None:
    worker.writer.max_bytes = 1
    ids = tokens(KB + 1, seed=5)
    step(worker, StepPlan(saves=(SaveSpec("r", "acme", False, 0, tuple(ids[:KB]), (1, 2)),),
                          computes=(new("r", (1, 2, 3), 0, KB + 1),)))
    assert worker.counters.totals()["write_back_dropped:queue_full"] == 1
    assert worker.take_report().refused == {"r": 0}  # planned again when the request computes prompt tokens


def test_a_save_the_queue_takes_only_part_of_keeps_its_head_and_reports_its_tail(tmp_path, worker) -> None:
    worker.writer.max_bytes = L * (KB // EB) * worker.layout.block_bytes  # one kvwarm block's copies
    ids = tokens(3 * KB + 1, seed=6)
    step(worker, StepPlan(saves=(SaveSpec("r", "acme", False, 0, tuple(ids[: 3 * KB]), (1, 2, 3, 4, 5, 6)),),
                          computes=(new("r", (1, 2, 3, 4, 5, 6, 7), 0, 3 * KB + 1),)))
    assert worker.writer.drain(HANG_S)
    totals = worker.counters.totals()
    assert totals["write_back_dropped:queue_full"] == 2 and totals["written_back_blocks"] == 1
    assert worker.take_report().refused == {"r": 1}  # the scheduler plans blocks 1 and 2 again


def test_steps_of_mostly_prefill_are_timed_for_the_scheduler(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    now = [100.0]
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=cfg(pool_dir=tmp_path / "pool"),
                          model_dir=tmp_path)
    worker = WorkerRole(s, identities=(IDENT, None), engine_block=EB, clock=lambda: now[0])
    try:
        worker.begin_step(StepPlan())
        now[0] += 0.25  # the forward
        worker.after_forward(StepPlan(prompt_tokens=500, other_tokens=3))
        report = worker.take_report()
        assert report.forward_tokens == 503 and report.forward_seconds == 0.25
        worker.begin_step(StepPlan())
        now[0] += 0.25
        worker.after_forward(StepPlan(prompt_tokens=10, other_tokens=30))
        assert worker.take_report() is None
    finally:
        worker.close()


def test_the_node_agent_maps_the_plan_into_the_pool(tmp_path, worker) -> None:
    a, b = tokens(2 * KB, seed=6), tokens(2 * KB, seed=7)
    store_blocks(tmp_path, a)
    store_blocks(tmp_path, b)
    plan = write_plan(Plan(entries=(PlanEntry("acme", token_ids=tuple(a), score=2.0),
                                    PlanEntry("acme", text="b", score=1.0), PlanEntry("mallory", token_ids=tuple(b)))),
                      tmp_path / "plan.json")
    agents = start_agents(worker, replace(worker.settings, plan=str(plan)), lambda text, chat: b)
    try:
        deadline = time.monotonic() + HANG_S
        while worker.counters.totals().get("prefetched_blocks", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        agents.close()
    assert worker.counters.totals()["prefetched_blocks"] == 4  # acme's two prefixes; mallory's is not ours
    assert worker.counters.totals()["agent_rankings"] == 1
    assert worker.loader("acme", False).pool.usage() > 0


def test_a_chat_keyed_save_goes_under_the_chat_root(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    chat_ident = ModelIdentity("test-model@1", "tok-1", chat_template_hash="c" * 64, name="m")
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=cfg(pool_dir=tmp_path / "pool"),
                          model_dir=tmp_path)
    w = WorkerRole(s, identities=(IDENT, chat_ident), engine_block=EB)
    caches = [torch.zeros((NB, H, EB, 2 * D), dtype=torch.bfloat16) for _ in range(L)]
    w.register(caches, EngineLayout("cpu_vec", NB, H, EB, D, torch.bfloat16), total_kv_heads=H)
    ids = tokens(2 * KB, seed=8)
    step(w, StepPlan(saves=(SaveSpec("r", "acme", True, 1, tuple(ids), (5, 6)),),
                     computes=(new("r", (3, 4, 5, 6), KB, KB),)))
    assert w.writer.drain(HANG_S) and w.counters.totals()["written_back_blocks"] == 1
    c = cfg()
    tenant = c.tenant("acme")
    chat_root = chat_ident.key_root(c.kv_cache.precision(), KB, tenant.salt)
    plain_root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
    store = Store.open(f"file://{tmp_path}/nvme", c)
    assert store.get(tenant, block_chain(chat_root, ids)[1], chat_root) is not None
    assert store.probe(tenant, block_chain(plain_root, ids), plain_root).count == 0
    store.close()
    w.close()


def test_kv_computed_over_another_requests_failed_load_is_not_stored_until_recomputed(tmp_path, worker) -> None:
    ids = tokens(3 * KB + 1, seed=9)
    store_blocks(tmp_path, ids, blocks=1)  # kvwarm block 1 is planned but absent: its load fails
    a_table, b_table = (1, 2, 3, 4, 5), (1, 2, 3, 4, 10, 11, 12)
    # A loads 0..2KB; B shares A's blocks through vLLM's prefix cache, in the same step, and computes block 2
    save_b = SaveSpec("B", "acme", False, 2, tuple(ids[: 3 * KB]), (10, 11))
    step(worker, StepPlan(loads=(LoadSpec("A", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),),
                          saves=(save_b,), computes=(new("A", a_table, 2 * KB, 1), new("B", b_table, 2 * KB, KB))))
    assert worker.take_failed() == {3, 4}
    assert worker.take_report().refused == {"B": 1}
    assert worker.counters.totals()["write_back_dropped:invalid"] == 1
    # vLLM rewinds both to the failed block; A recomputes it, B its own part, in one step: now B's blocks are stored
    for layer in range(L):
        k = torch.cat([expected(b)[layer][0] for b in (1, 2)], dim=1)
        v = torch.cat([expected(b)[layer][1] for b in (1, 2)], dim=1)
        write_layer(worker.caches[layer], worker.layout, (3, 4, 10, 11), k, v)
    step(worker, StepPlan(saves=(SaveSpec("B", "acme", False, 1, tuple(ids[: 3 * KB]), (3, 4, 10, 11)),),
                          computes=(Compute("A", KB, KB + 1), Compute("B", 2 * KB, KB))))
    assert worker.writer.drain(HANG_S) and worker.counters.totals()["written_back_blocks"] == 2
    assert worker.take_report() is None or not worker.take_report().refused


def test_a_save_whose_blocks_the_ledger_does_not_know_is_not_stored(tmp_path, worker) -> None:
    ids = tokens(KB + 1, seed=10)
    step(worker, StepPlan(saves=(SaveSpec("r", "acme", False, 0, tuple(ids[:KB]), (7, 8)),),
                          computes=(new("r", (1, 2, 3), 0, KB + 1),)))  # the plan says blocks 7, 8; r holds 1, 2
    assert worker.writer.drain(HANG_S) and "written_back_blocks" not in worker.counters.totals()
    assert worker.take_report().refused == {"r": 0}


def test_a_deferred_load_is_reported_finished_whether_it_worked_or_not(tmp_path, worker) -> None:
    ids = tokens(2 * KB + 1, seed=11)
    store_blocks(tmp_path, ids, blocks=1)
    good = LoadSpec("good", "acme", False, tuple(ids[:KB]), 0, KB, (1, 2), deferred=True)
    bad = LoadSpec("bad", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (3, 4, 5, 6), deferred=True)
    plain = LoadSpec("plain", "acme", False, tuple(ids[:KB]), 0, KB, (7, 8))
    step(worker, StepPlan(loads=(good, bad, plain)))
    assert worker.take_finished_loads() == {"good", "bad"} and worker.take_finished_loads() == set()
    assert worker.take_failed() == {5, 6}


def test_steady_decodes_told_in_bulk_reach_the_ledger(worker) -> None:
    ids = tokens(KB, seed=8)
    step(worker, StepPlan(computes=(new("B", (1, 2, 3), 0, 2 * EB + 1), new("C", (7, 8), 0, EB + 1))))
    # A loads blocks 1 and 2, which B holds (vLLM's prefix cache): the load fails (nothing stored), and B,
    # decoding in bulk over them in the same step, computes over garbage; C decodes over its own good blocks
    step(worker, StepPlan(loads=(LoadSpec("A", "acme", False, tuple(ids), 0, KB, (1, 2)),),
                          computes=(new("A", (1, 2, 6), KB, 1),), decodes=Decodes(("B", "C"), (2 * EB + 1, EB + 1),
                                                                                  (1, 1))))
    assert {1, 2, 3, 6} <= worker.ledger.invalid and worker.ledger.valid_prefix("B", 3) == 0
    assert worker.ledger.valid_prefix("C", 2) == 2 and 8 not in worker.ledger.invalid
