"""Done-when 2, end to end: write-back, then a restarted engine on the same store is warm.

The first engine on the bf16 store (the ``bf16_engine`` fixture, write-back on) computes
``written_back``, which no plan named and nothing stored, and writes its full blocks to the
store as ordinary snapshots; it is stopped. A new engine on the same store, started with a
plan naming that prefix (prefetched at start-up), loads those blocks from kvwarm and returns
the same tokens, and writes nothing again (a block already stored is not rewritten).
"""
from __future__ import annotations

import pytest

from bench.lib.vllm_engine import run_engine
from store.config import load_config
from store.format.payload import map_file
from store.format.snapshot import read_snapshot
from store.plan import plan_from_prefixes, write_plan
from tests.store.engines.vllm.harness import TENANT, connector, count, engine_spec, outcome, reasons, request
from tests.store.engines.vllm.prompts import all_ids
from tests.store.engines.vllm.writeback_names import PROMPT, written_names


@pytest.fixture(scope="module")
def restarted(bf16_store, bf16_engine):
    """A second engine on the store the first one wrote back to (the first is stopped by then)."""
    d = bf16_store.parent
    plan = write_plan(plan_from_prefixes(TENANT, [all_ids()[PROMPT][:512]]), d / "plan.json")
    steps = [{"name": "again", "requests": [request(all_ids()[PROMPT])]}]
    return run_engine(engine_spec(steps, extra=connector(bf16_store, plan=str(plan))), d / "engine-b")


def test_the_first_engine_computes_the_prompt_and_writes_its_full_blocks_back(bf16_store, bf16_engine, cold):
    call = bf16_engine.calls("write")[0]
    assert call["tokens"] == cold[PROMPT]
    assert outcome(call).get("loaded_tokens") == 0
    worker = bf16_engine.stats(None, "worker")  # after shutdown: the writer has drained
    assert count(worker, "written_back_blocks") >= 2
    assert not reasons(worker, "write_back_dropped")
    cfg = load_config(bf16_store)
    ids = all_ids()[PROMPT]
    for i, name in enumerate(written_names(bf16_store)):  # ordinary snapshots, as any reader takes them
        path = bf16_store.parent / "store" / "objects" / name
        header = read_snapshot(map_file(path), location=str(path), verify_payload=True).header
        assert header.tenant == TENANT and header.token_ids == tuple(ids[256 * i: 256 * (i + 1)])
        assert header.precision == cfg.kv_cache.precision()
        assert header.expires_at - header.created_at == pytest.approx(cfg.kv_cache.ttl_seconds())


def test_a_restarted_engine_loads_the_written_back_blocks_and_returns_the_same_tokens(restarted, cold):
    call = restarted.calls("again")[0]
    assert call["tokens"] == cold[PROMPT]
    assert outcome(call).get("loaded_tokens") == 512
    stats = restarted.stats("again")
    assert count(stats, "tokens_loaded") == 512 and not reasons(stats, "load_failures")
    worker = restarted.stats(None, "worker")
    assert count(worker, "written_back_blocks") == 0  # both blocks were in the store already
    assert count(worker, "prefetched_blocks") == 2  # the plan's prefix, mapped at start-up
