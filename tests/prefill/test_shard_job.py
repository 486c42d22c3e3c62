"""One shard's job in-process: shared prefixes first, waits through the probe, steps in plan order, the cut."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from prefill.block_writer import BlockWriter
from prefill.runner import DeadlinePassed, PrefillReport
from prefill.shard_job import ShardOptions, ShardReport, Wait, run_shard
from prefill.shards import make_shards, prefixes_of
from store.identity.keys import block_chain
from tests.prefill.factories import config_for
from tests.prefill.shard_plans import BLOCK, SYSTEM, independent_plan, shared_prompt_plan, under_system


def _shards(plan, n):
    return make_shards(prefixes_of(plan.entries, lambda t, c: []), n, block_size=BLOCK)


def _distinct_blocks(plan) -> int:
    return len({e.token_ids[:(d + 1) * BLOCK] for e in plan.entries for d in range(len(e.token_ids) // BLOCK)})


def test_two_shards_compute_every_block_once_and_the_waiter_continues_from_the_stored_prefix(tiny, store, caplog):
    plan = shared_prompt_plan()
    config = config_for()
    shards = _shards(plan, 2)
    owner = next(s for s in shards if s.computes)
    waiter = next(s for s in shards if s.waits)
    kw = dict(loaded=tiny, store=store, config=config, precision=config.kv_cache.precision())
    reports = {}

    def run(s):
        reports[s.index] = run_shard(s, plan.entries, **kw)

    with caplog.at_level(logging.INFO, logger="prefill.shard_job"):
        t = threading.Thread(target=run, args=(waiter,))
        t.start()  # it waits for the system prompt, which only the owner computes
        run(owner)
        t.join(timeout=300)
    assert not t.is_alive()
    (wait,) = reports[waiter.index].waits
    assert wait.found and wait.owner == owner.index and wait.blocks == len(SYSTEM) // BLOCK
    assert "waiting for the shared prefix" in caplog.text and "continuing from the stored KV" in caplog.text
    # every block computed once: the shards' tokens add up to the plan's distinct blocks
    assert sum(r.prefill.tokens_computed for r in reports.values()) == _distinct_blocks(plan) * BLOCK
    assert sum(r.prefill.blocks_written for r in reports.values()) == _distinct_blocks(plan)
    assert all(r.prefill.blocks_skipped == 0 and r.prefill.blocks_left == 0 and not r.cut for r in reports.values())
    # both serve prefixes under the system prompt, and only the owner computed its blocks
    under = set(under_system(plan))
    assert under & set(owner.entries) and under & set(waiter.entries)
    assert reports[owner.index].prefill.tokens_computed >= len(SYSTEM)


def test_a_rerun_computes_nothing_and_a_wait_that_times_out_computes_the_prefix_here(tiny, store):
    plan = shared_prompt_plan()
    config = config_for()
    waiter = next(s for s in _shards(plan, 2) if s.waits)
    kw = dict(loaded=tiny, store=store, config=config, precision=config.kv_cache.precision())
    # the owner never runs: the waiter gives up and computes the system prompt itself
    alone = run_shard(waiter, plan.entries, options=ShardOptions(wait_timeout_s=0.2, poll_s=0.05), **kw)
    assert not alone.waits[0].found and alone.prefill.blocks_left == 0 and not alone.cut
    again = run_shard(waiter, plan.entries, **kw)
    assert again.prefill.tokens_computed == 0 and again.prefill.blocks_written == 0 and again.waits[0].found


def test_a_deadline_cuts_the_least_valuable_entries_of_the_shard(tiny, store, monkeypatch):
    from types import SimpleNamespace

    from prefill import runner

    plan = independent_plan(24, 2)
    config = config_for()
    (shard,) = _shards(plan, 1)
    # a clock that moves 10 s per forward batch and never by itself: the runner measures its rate on it too
    clock = _StepClock(start=1000.0)
    monkeypatch.setattr(runner, "time", SimpleNamespace(time=clock, perf_counter=clock, strftime=time.strftime,
                                                        gmtime=time.gmtime))
    real = BlockWriter.write

    def slow(self, *a, **k):  # inside the runner's timing of a batch
        clock.now += 10.0
        return real(self, *a, **k)

    monkeypatch.setattr(BlockWriter, "write", slow)
    # steps of 4 entries (one batch each); the deadline leaves room for a few of the six
    report = run_shard(shard, plan.entries, loaded=tiny, store=store, config=config,
                       precision=config.kv_cache.precision(), deadline=1045.0, clock=clock,
                       options=ShardOptions(step_tokens=4 * 2 * BLOCK, stop_margin_s=2.0))
    assert report.prefill.stopped == "deadline" and report.cut
    assert report.finished_at <= 1045.0
    done = [i for i in shard.entries if i not in report.cut]
    assert done and max(done) < min(report.cut), "a cut entry outranks a computed one"
    assert report.prefill.blocks_left == 2 * len(report.cut)
    for i in report.cut:  # nothing of a cut entry is half there: its blocks are absent, not torn
        root = tiny.key_root(config.kv_cache.precision(), BLOCK, config.tenant("public").salt)
        assert store.probe(config.tenant("public"), block_chain(root, plan.entries[i].token_ids), root).count == 0


def test_a_deadline_already_past_writes_nothing(tiny, store):
    plan = independent_plan(2, 1)
    config = config_for()
    (shard,) = _shards(plan, 1)
    with pytest.raises(DeadlinePassed):
        run_shard(shard, plan.entries, loaded=tiny, store=store, config=config,
                  precision=config.kv_cache.precision(), deadline=1.0)


def test_a_shards_steps_add_their_work_and_its_record_stays_flat():
    counts = PrefillReport(prefixes=3, blocks_total=9, blocks_stored_before=2)
    counts.add(PrefillReport(prefixes=5, blocks_total=4, blocks_written=4, tokens_computed=64, seconds=1.0,
                             quant_error_max=0.25, oom_splits=1))
    counts.add(PrefillReport(prefixes=1, blocks_written=1, tokens_computed=16, seconds=1.0, stopped="deadline",
                             quant_error_max=0.125))
    counts.add(PrefillReport())  # a step after the stop does not clear it
    assert (counts.prefixes, counts.blocks_total, counts.blocks_stored_before) == (3, 9, 2)  # the caller's to set
    assert (counts.blocks_written, counts.tokens_computed, counts.seconds, counts.oom_splits) == (5, 80, 2.0, 1)
    assert counts.quant_error_max == 0.25 and counts.stopped == "deadline"
    report = ShardReport(shard=1, shards=2, est_gpu_s=0.5, prefill=counts, cut=[4], waits=[Wait(0, 2, 0, 1.5, True)],
                         finished_at=7.0)
    record = report.as_dict()
    # the keys the parent flow (flows/shards.py) and prefill.json's readers take from a shard's record
    assert record["entries"] == 3 and "prefixes" not in record and "prefill" not in record
    assert record["tokens_computed"] == 80 and record["tokens_per_s"] == 40.0 and record["blocks_left"] == 0
    assert record["waits"] == [{"entry": 0, "blocks": 2, "owner": 0, "waited_s": 1.5, "found": True}]
    assert {k: record[k] for k in ("shard", "shards", "est_gpu_s", "stopped", "cut", "finished_at")} == {
        "shard": 1, "shards": 2, "est_gpu_s": 0.5, "stopped": "deadline", "cut": [4], "finished_at": 7.0}


class _StepClock:
    """A clock that moves only when a batch runs (the test advances it), so nothing depends on real time."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
