"""The worker's fences through the stream interface the CPU build implements (store.engines.vllm.streams):
a real worker's loads and write-back issue their events and waits in the order a GPU needs, and a stuck
load job costs one timeout, not one per layer."""
from __future__ import annotations

import threading

import pytest

from store.engines.vllm.fences import Fences
from store.engines.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from store.engines.vllm.streams import HostStreams, describe
from store.engines.vllm.transfer import LoadThread, StepLoad
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import KB, L, new, store_blocks, tokens


def test_host_streams_log_in_order_per_thread_and_catch_a_wait_on_an_event_never_recorded() -> None:
    streams = HostStreams()
    side = streams.new_stream("side")
    assert streams.current() is streams.compute
    start = streams.record("start")
    seen = []

    def other() -> None:
        seen.append(streams.current().name)  # another thread issues on the compute stream by default

    with side.use():
        assert streams.current() is side
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(HANG_S)
        side.wait_event(start)
        side.wait_event(streams.event("never"))  # a lost fence on CUDA (waiting on it is a no-op)
    side.wait_stream(streams.compute)
    assert seen == ["compute"] and streams.current() is streams.compute
    assert describe(streams.ops()) == ["record compute start", "enter side", "wait_event side start",
                                       "wait_unrecorded side never", "exit side", "wait_stream side compute"]
    small = HostStreams(max_ops=2)
    for i in range(5):
        small.record(str(i))
    assert describe(small.ops()) == ["record compute 3", "record compute 4"]  # bounded: the oldest go


def test_a_step_load_and_its_write_back_are_fenced_in_order(tmp_path, worker) -> None:
    """A real worker (CPU caches, a real store) through HostStreams: what a GPU worker issues, in order."""
    streams = worker.fences.streams
    assert isinstance(streams, HostStreams) and worker.writer.device_streams is streams
    ids = tokens(2 * KB + 1, seed=30)
    store_blocks(tmp_path, ids)
    plan = StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),),
                    saves=(SaveSpec("r", "acme", False, 0, tuple(ids[: 2 * KB]), (1, 2, 3, 4)),),
                    computes=(new("r", (1, 2, 3, 4, 5), 2 * KB, 1),))
    worker.begin_step(plan)
    worker.start_load(plan)
    for layer in range(L):
        worker.wait_layer(layer)
    worker.after_forward(plan)
    assert worker.take_failed() == set() and worker.writer.drain(HANG_S)
    assert worker.counters.totals()["write_back_skipped:present"] == 2  # the copies reached the writer
    worker.begin_step(StepPlan())
    worker.start_load(StepPlan())  # the next step: its forward waits until the save stream read the cache
    me = threading.current_thread().name
    assert describe(o for o in streams.ops() if o.thread == me) == [
        "record compute step start",  # loads start after what the compute stream had queued
        "enter load", "wait_event load step start",
        *(f"record load layer {i}" for i in range(L)),  # an event after each layer's writes
        "exit load",
        *(f"wait_event compute layer {i}" for i in range(L)),  # each attention waits on its layer
        "record compute forward end",  # write-back copies start once the forward is done
        "enter save", "wait_event save forward end", "record save cache read", "exit save",
        "record save saved",  # after the copies to host memory
        "wait_event compute cache read",  # the next forward may overwrite blocks vLLM freed
    ]
    writer = [describe([o])[0] for o in streams.ops() if o.thread == "kvwarm-writeback"]
    assert writer == ["synchronize saved"]  # the writer reads the copies only after their event
    assert not [o for o in streams.ops() if o.op == "wait_unrecorded"]


def test_a_stalled_load_job_costs_one_timeout_for_all_its_layers() -> None:
    gate = threading.Event()
    thread = LoadThread()
    job = StepLoad(32, timeout_s=0.05)  # one deadline for the job, from its start
    thread.submit(lambda: gate.wait(HANG_S))  # the loader never makes a layer ready
    try:
        for layer in range(32):
            job.wait(layer)
        assert job.timed_out and job.expired_waits == 1  # the first wait took the time; 31 returned at once
        assert not job.wait_all() and job.expired_waits == 1
    finally:
        gate.set()
        thread.close()


def test_a_wait_takes_what_is_left_of_the_jobs_deadline() -> None:
    now = [100.0]
    job = StepLoad(4, timeout_s=10.0, clock=lambda: now[0])
    assert job.deadline == 110.0
    job.ready(0)
    now[0] = 109.0
    job.wait(0)  # ready: no wait, whatever the clock
    assert not job.timed_out
    now[0] = 110.0  # the deadline passed: layer 1 is not waited for at all
    job.wait(1)
    job.wait(2)
    assert job.timed_out and job.expired_waits == 1 and not job.wait_all()


@pytest.mark.parametrize("stall_at", [0, 1])
def test_a_worker_whose_loader_stalls_reports_the_steps_loads_failed_once_the_deadline_passed(
        tmp_path, worker, stall_at) -> None:
    ids = tokens(2 * KB + 1, seed=31)
    store_blocks(tmp_path, ids)
    gate = threading.Event()
    write = worker._write

    def stalled(cache, block_ids, k, v) -> None:
        if cache is worker.caches[stall_at]:
            gate.wait(HANG_S)
        write(cache, block_ids, k, v)

    worker._write = stalled
    worker.fences = Fences("cpu", threaded=True, timeout_s=0.05)
    try:
        worker.start_load(StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB,
                                                   (1, 2, 3, 4)),)))
        job = worker._pending.job
        for layer in range(L):
            worker.wait_layer(layer)
        assert worker.take_failed() == {1, 2, 3, 4} and job.expired_waits == 1
        (result,) = worker.take_report().loads
        assert (result.loaded, result.reason) == (0, "timeout")
        assert worker.counters.totals()["load_failures:timeout"] == 1
        gate.set()  # the loader comes back: it finishes the write it was in, then writes nothing more
        assert job._done.wait(HANG_S)
        for layer in range(stall_at + 1, L):
            assert bool((worker.caches[layer][[1, 2, 3, 4]] == -3.0).all())
    finally:
        gate.set()
