"""A step's loads, layer by layer, beside the forward: the loader thread and the per-layer signals.

vLLM calls the connector's ``start_load_kv`` before the forward and ``wait_for_layer_load``
before each attention layer reads its KV. The worker looks a step's loads up there (Python
work: beside the forward it would take the GIL from it), then, on a GPU, :class:`LoadThread`
moves, dequantises and writes them on a thread of the worker's own, issuing on a side stream
(a CPU worker runs the same job in ``start_load_kv``: beside the forward it only slowed both),
and :class:`StepLoad` tells the forward when each layer is written:

- the loader marks a layer :meth:`StepLoad.ready` once every load's writes into it are issued
  (on a GPU it records a CUDA event on the side stream there);
- :meth:`StepLoad.wait` blocks the forward's thread until that layer is ready, then (on a GPU)
  makes the forward's stream wait for the event: the host waits only for the copies to be
  *issued*, the device for them to be *done*, and nothing syncs a whole stream.

So the load of layer ``l + 1`` overlaps the compute of layer ``l``. Every layer is marked
ready even when a load fails part-way (the failed blocks are reported, and vLLM recomputes
them): the forward never waits for a load that will not come.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from store.engines.vllm.metadata import LoadResult, LoadSpec

log = logging.getLogger("kvwarm.vllm")
#: Most seconds the forward waits for one layer before it goes on without it (a stuck loader
#: must not hang the engine; the step's loads are then reported failed).
WAIT_TIMEOUT_S = 60.0


class StepLoad:
    """The layers of one step's loads, as the loader thread makes them ready.

    Args:
        layers: how many layers the worker holds.
        device: where the caches live (a CUDA device gets events).
    """

    def __init__(self, layers: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.layers = layers
        self._ready = [threading.Event() for _ in range(layers)]
        self._events: list[Any] = [None] * layers
        self._done = threading.Event()
        self.timed_out = False

    def ready(self, layer: int) -> None:
        """Every write of this step's loads into ``layer`` is issued (on a GPU, on the current stream)."""
        if self._ready[layer].is_set():
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[layer] = event
        self._ready[layer].set()

    def finish(self) -> None:
        """The loader wrote what it could: every layer is ready, loaded or not."""
        for layer in range(self.layers):
            self.ready(layer)

    def complete(self) -> None:
        """The step's results are in (after :meth:`finish`): :meth:`wait_all` returns."""
        self.finish()
        self._done.set()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is ready; on a GPU, the current stream then waits for its writes."""
        if not self._ready[layer].wait(WAIT_TIMEOUT_S):
            self.timed_out = True
            log.error("kvwarm: layer %d of this step's loads was not ready after %g s; the forward goes on "
                      "without it (its loads are reported failed)", layer, WAIT_TIMEOUT_S)
            return
        event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all(self) -> bool:
        """Block until the step's results are in (:meth:`complete`); ``False`` when not within the timeout."""
        if not self._done.wait(WAIT_TIMEOUT_S):
            self.timed_out = True
            return False
        return not self.timed_out


class LoadThread:
    """One thread that runs the worker's load jobs in order (a job is a callable with no arguments).

    Args:
        device: the caches' device: on a CUDA device the thread runs its jobs on a side stream
            of its own.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvwarm-load", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
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
        kv: every layer's K and V, dequantised at once (the CPU); ``None``: layer by layer (a GPU).
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

    A ``write_layer`` that raises fails its load from its first block. Every layer is marked
    ready, and every hit closed, whatever happens. Returns one result per load, in order.
    """
    live = [op for op in opened if isinstance(op, OpenLoad)]
    try:
        for layer in range(job.layers):
            for op in live:
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
