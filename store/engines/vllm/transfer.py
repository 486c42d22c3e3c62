"""A step's loads, layer by layer, beside the forward: the loader thread and the per-layer fences.

vLLM calls the connector's ``start_load_kv`` before the forward and ``wait_for_layer_load``
before each attention layer reads its KV. The worker looks a step's loads up there (Python
work: beside the forward it would take the GIL from it), then, on a GPU, :class:`LoadThread`
moves, dequantises and writes them on a thread of the worker's own (a CPU worker runs the same job
in ``start_load_kv``: beside the forward it only slowed both). Either way the job's device work is
issued on the worker's ``load`` stream (:mod:`store.engines.vllm.streams`), and :class:`StepLoad`
fences it against the forward's (compute) stream:

- the job's first device work waits on an event recorded on the compute stream when the step
  started (:meth:`StepLoad.begin`): the blocks it writes may still be in use by work queued before;
- the loader marks a layer :meth:`StepLoad.ready` once every load's writes into it are issued,
  recording an event on the load stream there;
- :meth:`StepLoad.wait` blocks the forward's thread until that layer is marked, then makes the
  compute stream wait on its event: the host waits only for the copies to be *issued*, the device
  for them to be *done*, and nothing syncs a whole stream. Under a full CUDA graph this Python
  would never run: the connector asks vLLM for piecewise graphs
  (``KvwarmConnector.requires_piecewise_for_cudagraph``).

So the load of layer ``l + 1`` overlaps the compute of layer ``l``. Every layer is marked
ready even when a load fails part-way (the failed blocks are reported, and vLLM recomputes
them): the forward never waits for a load that will not come. A job has one deadline,
``timeout_s`` after it starts: every wait takes what is left of it, and once it has passed the
remaining waits return at once and the step's loads are reported failed (``timeout``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from store.engines.vllm.metadata import LoadResult, LoadSpec
from store.engines.vllm.streams import Event, HostStreams, Stream, Streams

log = logging.getLogger("kvwarm.vllm")
#: Most seconds a step's load job may take, all its layers together, before the forward goes on without it
#: (a stuck loader must not hang the engine; the step's loads are then reported failed).
WAIT_TIMEOUT_S = 60.0


class StepLoad:
    """The layers of one step's loads, as the loader makes them ready, with their events.

    Args:
        layers: how many layers the worker holds.
        streams: the device's streams (the CPU's by default).
        start: an event on the compute stream when the step started; the job's device work waits on it.
        timeout_s: the job's deadline, from now (its start): every wait takes what is left of it.
        clock: monotonic seconds (the deadline's).
    """

    def __init__(self, layers: int, streams: Streams | None = None, *, start: Event | None = None,
                 timeout_s: float = WAIT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.streams = streams if streams is not None else HostStreams()
        self.layers = layers
        self.start = start
        self.timeout_s = timeout_s
        self.clock = clock
        self.deadline = clock() + timeout_s
        self._ready = [threading.Event() for _ in range(layers)]
        self._events: list[Event | None] = [None] * layers
        self._done = threading.Event()
        self.timed_out = False
        #: Waits that blocked until the deadline (at most one: the rest return at once).
        self.expired_waits = 0

    def begin(self) -> None:
        """The job starts issuing (on the load stream): its work waits for the step's start on the compute stream."""
        if self.start is not None:
            self.streams.current().wait_event(self.start)

    def ready(self, layer: int) -> None:
        """Every write of this step's loads into ``layer`` is issued (on the current, the load, stream)."""
        if self._ready[layer].is_set():
            return
        self._events[layer] = self.streams.record(f"layer {layer}")
        self._ready[layer].set()

    def finish(self) -> None:
        """The loader wrote what it could: every layer is ready, loaded or not."""
        for layer in range(self.layers):
            self.ready(layer)

    def complete(self) -> None:
        """The step's results are in (after :meth:`finish`): :meth:`wait_all` returns."""
        self.finish()
        self._done.set()

    def _wait(self, flag: threading.Event, what: str) -> bool:
        """Wait for ``flag`` until the job's deadline; ``False`` (and the job timed out) when it passed."""
        if flag.is_set():
            return True
        if self.timed_out:  # the deadline passed: no wait blocks again
            return False
        left = self.deadline - self.clock()
        if left > 0 and flag.wait(left):
            return True
        self.timed_out = True
        self.expired_waits += 1
        log.error("kvwarm: this step's loads were not done within %g s (waiting for %s); the forward goes on "
                  "without them (they are reported failed)", self.timeout_s, what)
        return False

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is ready (or the deadline passed); then the current (compute) stream waits on its event."""
        if not self._wait(self._ready[layer], f"layer {layer}"):
            return
        event = self._events[layer]
        if event is not None:
            self.streams.current().wait_event(event)

    def wait_all(self) -> bool:
        """Block until the step's results are in (:meth:`complete`); ``False`` when not by the deadline."""
        if not self._wait(self._done, "every layer"):
            return False
        return not self.timed_out


class LoadThread:
    """One thread that runs the worker's load jobs in order (a job is a callable with no arguments),
    each issuing its device work on ``stream`` (the worker's load stream).

    Args:
        stream: where the jobs' device work goes; ``None``: the thread's current stream.
    """

    def __init__(self, stream: Stream | None = None) -> None:
        self.stream = stream
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvwarm-load", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self.stream is not None:
                    with self.stream.use():
                        job()
                else:
                    job()
            except Exception:  # noqa: BLE001 - a job reports its own failures; the thread must outlive a bug
                log.exception("kvwarm: a load job failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the queued jobs finish, then stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)


@dataclass
class OpenLoad:
    """One load being made: its hit (mapped, pinned) and where its tokens go.

    Attributes:
        spec: what the scheduler planned.
        hit: the stored chain, mapped and pinned until the load is closed.
        end: one past the last prompt token the hit gives (a multiple of the engine block).
        first: the kvwarm block holding token ``spec.start``; ``offset``: tokens of it before ``spec.start``.
        ids: the engine blocks written, in token order.
        reason: why the hit is shorter than planned (``None`` when it is not).
        started: when the lookup began (the worker's clock).
        kv: every layer's K and V, dequantised at once (the CPU); ``[]``: every layer already written
            into its blocks (vLLM's CPU layout, natively); ``None``: layer by layer (a GPU).
        fail_from: the first of ``ids`` reported failed whatever was written (a write that raised:
            0), else ``None``.
        device_ids: ``ids`` as a tensor on the caches' device (made by the first layer that needs it).
    """

    spec: LoadSpec
    hit: Any
    end: int
    first: int
    offset: int
    ids: tuple[int, ...]
    reason: str | None
    started: float
    kv: list[torch.Tensor] | None = None
    fail_from: int | None = None
    device_ids: torch.Tensor | None = None


def run_loads(opened: Sequence[OpenLoad | LoadResult], job: StepLoad, *,
              write_layer: Callable[[OpenLoad, int], None],
              close_load: Callable[[OpenLoad], LoadResult]) -> list[LoadResult]:
    """A step's opened loads (a :class:`LoadResult` for one whose lookup failed), written layer by layer,
    each layer marked ready once every load's writes into it are issued.

    A ``write_layer`` that raises fails its load from its first block. Once the job's deadline has
    passed (the forward went on without it, and vLLM recomputes its blocks) nothing more is written.
    Every layer is marked ready, and every hit closed, whatever happens. Returns one result per load,
    in order.
    """
    live = [op for op in opened if isinstance(op, OpenLoad)]
    try:
        job.begin()  # after the step's start on the compute stream
        for layer in range(job.layers):
            for op in live:
                if job.timed_out:  # a late write would land in blocks vLLM now recomputes
                    op.fail_from = 0
                if op.fail_from == 0:
                    continue
                try:
                    write_layer(op, layer)
                except Exception:  # noqa: BLE001 - a request never fails because of kvwarm
                    log.exception("kvwarm load for request %s failed at layer %d; vLLM recomputes it",
                                  op.spec.req_id, layer)
                    op.fail_from = 0
            job.ready(layer)
    finally:
        job.finish()
        results = {id(op): close_load(op) for op in live}
    return [results[id(op)] if isinstance(op, OpenLoad) else op for op in opened]
