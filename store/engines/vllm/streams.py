"""Streams and events: how the worker fences its loads and write-back against the forward, on any device.

The worker issues its device work on streams of its own and orders it against the forward's
(the *compute* stream) only through events, as vLLM's own offloading worker does:

- a step's loads run on the ``load`` stream, after an event recorded on the compute stream when
  the step starts (the blocks they write may still be in use by work queued before); an event
  is recorded after each layer's writes, and the compute stream waits on it before that layer's
  attention;
- write-back runs on the ``save`` stream, after an event recorded on the compute stream when the
  forward ends; the writer thread reads the host copies only after an event recorded after them
  has completed, and the next step's compute stream waits until the save stream has read the
  cache (vLLM may hand those blocks to another request).

:class:`Streams` is that interface. :class:`DeviceStreams` is it on an accelerator (``torch.Stream``
and ``torch.Event``, device-agnostic: CUDA, ROCm, XPU). :class:`HostStreams` is it on the CPU, where
every operation is done when it returns: it keeps the ordered log of what was issued
(:class:`StreamOp`), so the CPU worker runs the same calls in the same order as a GPU worker, and a
test reads that order. It also catches what a GPU would silently get wrong: a wait on an event
never recorded is a no-op on CUDA (the fence is lost); here it is logged as ``wait_unrecorded``.
"""
from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch

#: The most operations :class:`HostStreams` keeps (the oldest go first: a serving worker runs for days).
HOST_LOG_OPS = 4096


class Event(ABC):
    """A point in a stream's work (``name`` says which, for logs)."""

    name: str

    @abstractmethod
    def record(self, stream: Stream) -> None:
        """Mark the point: everything issued on ``stream`` so far."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the work before the recorded point is done."""


class Stream(ABC):
    """An ordered queue of device work (``name`` says which, for logs)."""

    name: str

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work issued on this stream from now on starts after ``event``'s point (the host does not wait)."""

    @abstractmethod
    def wait_stream(self, other: Stream) -> None:
        """Work issued on this stream from now on starts after everything issued on ``other`` so far."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until everything issued on this stream is done."""

    @abstractmethod
    def use(self) -> contextlib.AbstractContextManager[Stream]:
        """A context in which the calling thread issues its device work on this stream."""


class Streams(ABC):
    """One device's streams and events, as the worker needs them."""

    @abstractmethod
    def current(self) -> Stream:
        """The stream the calling thread issues work on now (on the forward's thread: the compute stream)."""

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A stream of the worker's own (``load``, ``save``)."""

    @abstractmethod
    def event(self, name: str) -> Event:
        """A new event, not yet recorded."""

    def record(self, name: str, stream: Stream | None = None) -> Event:
        """A new event recorded on ``stream`` (default: :meth:`current`)."""
        event = self.event(name)
        event.record(stream if stream is not None else self.current())
        return event


def streams_for(device: torch.device | str) -> Streams:
    """The streams of ``device``: :class:`HostStreams` on the CPU, else :class:`DeviceStreams`."""
    device = torch.device(device)
    return HostStreams() if device.type == "cpu" else DeviceStreams(device)


# -- an accelerator ------------------------------------------------------------
class _DeviceEvent(Event):
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.raw = torch.Event(device=device)

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _DeviceStream)
        self.raw.record(stream.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()


class _DeviceStream(Stream):
    def __init__(self, name: str, raw: torch.Stream) -> None:
        self.name = name
        self.raw = raw

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _DeviceEvent)
        self.raw.wait_event(event.raw)

    def wait_stream(self, other: Stream) -> None:
        assert isinstance(other, _DeviceStream)
        self.raw.wait_stream(other.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        # the stream's device too (a new thread starts on device 0: a tensor-parallel rank's is not); then the
        # thread's current stream of that device, and back
        with torch.accelerator.device_index(self.raw.device_index):
            before = torch.accelerator.current_stream(self.raw.device_index)
            torch.accelerator.set_stream(self.raw)
            try:
                yield self
            finally:
                torch.accelerator.set_stream(before)


class DeviceStreams(Streams):
    """:class:`Streams` on an accelerator (``torch.Stream`` / ``torch.Event`` on ``device``)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, torch.accelerator.current_device_index())

    def current(self) -> Stream:
        return _DeviceStream("current", torch.accelerator.current_stream(self.device))

    def new_stream(self, name: str) -> Stream:
        return _DeviceStream(name, torch.Stream(device=self.device))

    def event(self, name: str) -> Event:
        return _DeviceEvent(name, self.device)


# -- the CPU: done at once, in order, logged ------------------------------------
@dataclass(frozen=True)
class StreamOp:
    """One operation :class:`HostStreams` was asked for.

    Attributes:
        op: ``record``, ``wait_event``, ``wait_unrecorded`` (a wait on an event never recorded: a lost fence),
            ``wait_stream``, ``synchronize`` (of a stream, or of an event with ``stream`` empty),
            ``enter``/``exit`` (a thread starts/stops issuing on ``stream``).
        stream: the stream's name (``""`` for an event's ``synchronize``).
        event: the event's name (or, for ``wait_stream``, the other stream's), else ``""``.
        thread: the name of the thread that asked.
    """

    op: str
    stream: str
    event: str = ""
    thread: str = ""


class _HostEvent(Event):
    def __init__(self, name: str, owner: HostStreams) -> None:
        self.name = name
        self.owner = owner
        self.recorded = False

    def record(self, stream: Stream) -> None:
        self.recorded = True  # CPU work is done when issued: the point is passed at once
        self.owner._log("record", stream.name, self.name)

    def synchronize(self) -> None:
        self.owner._log("synchronize" if self.recorded else "wait_unrecorded", "", self.name)


class _HostStream(Stream):
    def __init__(self, name: str, owner: HostStreams) -> None:
        self.name = name
        self.owner = owner

    def wait_event(self, event: Event) -> None:
        recorded = isinstance(event, _HostEvent) and event.recorded
        self.owner._log("wait_event" if recorded else "wait_unrecorded", self.name, event.name)

    def wait_stream(self, other: Stream) -> None:
        self.owner._log("wait_stream", self.name, other.name)

    def synchronize(self) -> None:
        self.owner._log("synchronize", self.name)

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        stack = self.owner._stack()
        stack.append(self)
        self.owner._log("enter", self.name)
        try:
            yield self
        finally:
            stack.pop()
            self.owner._log("exit", self.name)


class HostStreams(Streams):
    """:class:`Streams` on the CPU: every operation is done when issued; the order they were issued in is
    kept (:meth:`ops`, the last :data:`HOST_LOG_OPS`). A thread's current stream is ``compute`` unless it
    is inside a stream's :meth:`Stream.use`."""

    def __init__(self, max_ops: int = HOST_LOG_OPS) -> None:
        self._ops: deque[StreamOp] = deque(maxlen=max_ops)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.compute = _HostStream("compute", self)

    def _stack(self) -> list[_HostStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _log(self, op: str, stream: str, event: str = "") -> None:
        with self._lock:
            self._ops.append(StreamOp(op, stream, event, threading.current_thread().name))

    def ops(self) -> list[StreamOp]:
        """The operations issued so far, oldest first."""
        with self._lock:
            return list(self._ops)

    def clear(self) -> None:
        """Forget the operations logged so far."""
        with self._lock:
            self._ops.clear()

    def current(self) -> Stream:
        stack = self._stack()
        return stack[-1] if stack else self.compute

    def new_stream(self, name: str) -> Stream:
        return _HostStream(name, self)

    def event(self, name: str) -> Event:
        return _HostEvent(name, self)


def describe(ops: list[StreamOp] | Any) -> list[str]:
    """``"op stream event"`` per operation (what a test or a log line compares)."""
    return [" ".join(p for p in (o.op, o.stream, o.event) if p) for o in ops]
