"""The worker's fences: its load stream (and loader thread), and the events that order it against the forward.

One :class:`Fences` per worker, made when the engine registers its caches. Each step
(:meth:`Fences.start`), on the forward's thread, before the forward:

1. the compute stream waits until the last write-back has read the cache
   (:meth:`store.engines.vllm.writeback.WriteBack.fence`): vLLM may have handed those blocks to
   another request, and this step's forward, or its loads, may write them;
2. an event is recorded on the compute stream (``step start``), and the step's load job
   (:class:`store.engines.vllm.transfer.StepLoad`) waits on it before its first copy on the load stream.

:meth:`Fences.run` runs the job: on an accelerator on the loader thread (beside the forward), on
the CPU in the caller's thread; both issue on the load stream. :mod:`store.engines.vllm.streams`
says what each implementation does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from store.engines.vllm.streams import Streams, streams_for
from store.engines.vllm.transfer import WAIT_TIMEOUT_S, LoadThread, StepLoad

if TYPE_CHECKING:
    from store.engines.vllm.writeback import WriteBack


class Fences:
    """The streams of one worker's device, its load stream, and (on an accelerator) its loader thread.

    Args:
        device: where the engine's caches live.
        timeout_s: each step's load job's deadline (:class:`store.engines.vllm.transfer.StepLoad`).
        threaded: run load jobs on a thread of their own (default: on an accelerator only; a CPU
            worker loads in ``start_load_kv``, since beside the forward both were slower).
    """

    def __init__(self, device: torch.device | str, *, timeout_s: float = WAIT_TIMEOUT_S,
                 threaded: bool | None = None) -> None:
        device = torch.device(device)
        self.streams: Streams = streams_for(device)
        self.load = self.streams.new_stream("load")
        self.timeout_s = timeout_s
        self.thread = LoadThread(self.load) if (device.type != "cpu" if threaded is None else threaded) else None

    def start(self, layers: int, writer: WriteBack | None = None, *, loads: bool = True) -> StepLoad | None:
        """A step starts (the forward's thread, before the forward): the compute stream first waits until
        ``writer``'s last copy has read the cache; then, when the step ``loads``, its load job, fenced after
        that point (else ``None``)."""
        compute = self.streams.current()
        if writer is not None:
            writer.fence(compute)
        if not loads:
            return None
        return StepLoad(layers, self.streams, start=self.streams.record("step start", compute),
                        timeout_s=self.timeout_s)

    def run(self, work: Callable[[], None]) -> None:
        """Run a step's load job on the load stream: on the loader thread, or here when there is none."""
        if self.thread is not None:
            self.thread.submit(work)
            return
        with self.load.use():
            work()

    def close(self) -> None:
        """Let the queued jobs finish, then stop the loader thread."""
        if self.thread is not None:
            self.thread.close()
