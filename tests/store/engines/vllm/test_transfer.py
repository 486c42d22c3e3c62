"""A step's loads layer by layer on the loader thread: the forward waits for its layer only, every layer
is made ready whatever fails, and failures are counted once the loads are done."""
from __future__ import annotations

import threading

from store.engines.vllm.fences import Fences
from store.engines.vllm.metadata import LoadResult, LoadSpec, StepPlan
from store.engines.vllm.paging import write_layer
from store.engines.vllm.transfer import LoadThread, OpenLoad, StepLoad, run_loads
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import KB, store_blocks, tokens


def spec(req: str, n: int = 2) -> LoadSpec:
    return LoadSpec(req, "acme", False, (1,) * (n * KB), 0, n * KB, tuple(range(n * 2)))


def test_every_layer_is_made_ready_and_every_hit_closed_whatever_fails() -> None:
    job = StepLoad(3)
    closed, written = [], []

    def open_load(s: LoadSpec) -> OpenLoad | LoadResult:
        if s.req_id == "absent":
            return LoadResult(s.req_id, 0, s.end, reason="absent")
        return OpenLoad(s, None, s.end, 0, 0, s.block_ids, None, 0.0)

    def write(op: OpenLoad, layer: int) -> None:
        if op.spec.req_id == "breaks" and layer == 1:
            raise OSError("disk")
        written.append((op.spec.req_id, layer))

    def close(op: OpenLoad) -> LoadResult:
        closed.append(op.spec.req_id)
        return LoadResult(op.spec.req_id, 0 if op.fail_from == 0 else op.end, op.end)

    opened = [open_load(s) for s in (spec("ok"), spec("absent"), spec("breaks"))]
    results = run_loads(opened, job, write_layer=write, close_load=close)
    assert [r.req_id for r in results] == ["ok", "absent", "breaks"]
    assert [r.loaded for r in results] == [2 * KB, 0, 0] and sorted(closed) == ["breaks", "ok"]
    assert written == [("ok", 0), ("breaks", 0), ("ok", 1), ("ok", 2)]  # layer by layer; the broken load stops
    for layer in range(3):
        job.wait(layer)  # ready, not a hang


def test_the_forward_waits_for_its_layer_only(tmp_path, worker) -> None:
    ids = tokens(2 * KB + 1, seed=20)
    store_blocks(tmp_path, ids)
    gate, at_gate = threading.Event(), threading.Event()
    layout = worker.layout

    def writer(cache, block_ids, k, v) -> None:
        if cache is worker.caches[1]:  # layer 1 is held back until the test says so
            at_gate.set()
            assert gate.wait(HANG_S)
        write_layer(cache, layout, block_ids, k.contiguous(), v.contiguous())

    worker._write = writer
    worker.fences = Fences("cpu", threaded=True)  # what a GPU worker runs its loads on (a CPU worker loads in start_load_kv)
    worker.start_load(StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),)))
    worker.wait_layer(0)  # layer 0 is written while layer 1 is not
    assert at_gate.wait(HANG_S) and not worker._pending.job._ready[1].is_set()
    gate.set()
    worker.wait_layer(1)
    assert worker.take_failed() == set() and worker.take_report().loads[0].loaded == 2 * KB


def test_the_load_thread_runs_jobs_in_order_and_survives_one_that_raises() -> None:
    thread = LoadThread()
    seen = []
    done = threading.Event()
    thread.submit(lambda: seen.append(1))
    thread.submit(lambda: 1 / 0)
    thread.submit(lambda: (seen.append(2), done.set()))
    assert done.wait(HANG_S) and seen == [1, 2]
    thread.close()
