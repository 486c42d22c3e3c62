"""The write-back ring: a bounded shared-memory queue from one engine process to the node process.

An engine (the *producer*) hands each write-back block to the node (the *consumer*) through a
ring of its own: the already-quantised FP8 bytes and fp32 scales as byte *parts*, and a fixed
:class:`~store.node.ring_record.RecordMeta` (namespace, key, parent, token and layer counts,
precision id, errors). The node then checksums, writes and uploads them. The ring is a file
under ``/dev/shm`` of a size fixed at creation (:mod:`store.node.ring_layout`), mapped by both
ends; no resource tracker owns it, and nothing is pickled or parsed::

    engine (vLLM's thread)                      node process
    slot = writer.reserve(kv_bytes, scale_bytes)   for rec in reader.poll():
    if slot is None: count drop "ring_full"            store(rec.meta, rec.parts)
    slot.write(0, kv); slot.write(1, scales)           reader.release(rec)
    slot.commit(RecordMeta(...))

Bounded, and never blocking the engine: :meth:`RingWriter.reserve` answers ``None`` at once when
the slot table or the arena has no room (the caller counts the drop, reason ``ring_full``). A
record that could never fit raises :class:`~store.node.ring_errors.RecordTooLarge`.

Publication (why the consumer never sees a torn record). Every word has one writer. The
producer writes a slot's descriptor and then ``head_seq``; it writes the parts' bytes and the
metadata, and then, last, the slot's ``commit`` word, set to ``seq + 1`` (a number no earlier
occupant of that slot had, so a stale word never passes). The consumer reads ``head_seq``, then
a slot's ``commit`` word, and only after seeing ``seq + 1`` reads the metadata and the parts.
The consumer releases by writing ``read_pos`` and ``tail_seq`` after it has finished reading,
and the producer reads them before it reuses the space. Each ``commit``/``head``/``tail`` word
is an aligned 8-byte store (one instruction: never torn), and each is written in its own C call
after the copies it publishes have returned, so no compiler reorders them.

- x86-64 (TSO): stores are seen by other cores in program order and loads are not reordered
  with older loads or with younger stores. So seeing ``commit == seq + 1`` implies seeing the
  bytes stored before it, and a released region is never overwritten before the consumer's
  reads of it are done. Nothing more is needed, and a part costs one ``memcpy``.
- Weakly ordered CPUs (aarch64, POWER) may make the commit word visible before the data, and
  Python has no fence to call. There a ring is created with ``verify`` (the default off x86):
  the producer stores a CRC32 of the parts and the metadata in the descriptor before the commit
  word, and the consumer recomputes it after seeing the commit, a seqlock-style check. A mismatch means the
  stores have not all arrived yet: the record is not handed out on this poll (counted in
  ``RingReader.unsettled``) and is tried again on the next. The space is only reused after a
  release, which the consumer writes after its CRC pass has read every byte.

Crashes. Each end holds an OFD lock on the file (:mod:`store.node.ring_lock`), which the
kernel drops when its process dies, SIGKILL included.

- Producer killed mid-write: its reserved but uncommitted slots stay uncommitted. When the
  consumer reaches one and finds the producer's lock free (or the slot stamped with an older
  producer *generation* than the ring's current one), it discards the slot (``discarded``),
  still delivers any committed records after it, and releases the space. A new producer may
  take the same ring over (:meth:`Ring.writer` bumps the generation) or create a new one;
  :meth:`RingReader.finished` tells the node when a dead producer's ring is drained and may
  be unlinked.
- Consumer killed: the producer's view is unchanged, so it keeps answering ``None`` once the
  ring is full (bounded). A new consumer attaching continues from ``tail_seq``: records the
  dead one had read but not released are delivered again (the node's writes are idempotent:
  same key, same object), and uncommitted slots are never read.

A ring of another format version (or not a ring at all) is refused on attach with
:class:`~store.node.ring_errors.RingFormatMismatch`, which says which version it found.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from store.node.ring_errors import RingFormatMismatch
from store.node.ring_layout import (
    DESCRIPTOR_BYTES,
    DESCRIPTOR_DTYPE,
    FLAG_VERIFY,
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    RingLayout,
)
from store.node.ring_lock import RingEnd, is_held, let_go
from store.node.ring_record import parts_crc

if TYPE_CHECKING:
    from store.node.ring_reader import RingReader
    from store.node.ring_writer import RingWriter

# descriptor bytes [start, check) and [flags, end): what a record is, less the words written apart
_CRC_FIELDS = (DESCRIPTOR_DTYPE.fields["start"][1], DESCRIPTOR_DTYPE.fields["check"][1],
               DESCRIPTOR_DTYPE.fields["flags"][1])
_TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


def weakly_ordered() -> bool:
    """Whether this CPU may reorder stores (anything but x86): rings made here default to ``verify``."""
    return platform.machine().lower() not in _TSO_MACHINES


class Ring:
    """One ring file mapped into this process. Open it with :meth:`create` or :meth:`attach`, then
    take one end: :meth:`writer` (the engine) or :meth:`reader` (the node). Each end opens the
    ring itself: a process that is both attaches twice.

    Attributes:
        path: the ring's file.
        layout: its regions' sizes (:class:`~store.node.ring_layout.RingLayout`).
        verify: whether records carry a CRC32 that the consumer checks.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, layout: RingLayout, verify: bool) -> None:
        self.path = path
        self.layout = layout
        self.verify = verify
        self._fd = fd
        self._mm = mm
        self._ino = os.fstat(fd).st_ino
        self._end: str | None = None
        header = np.ndarray((), HEADER_DTYPE, buffer=mm, offset=0)
        #: one-element uint64 views of the header's words: one aligned 8-byte load or store each
        self.words = {name: np.ndarray((1,), np.uint64, buffer=mm, offset=HEADER_DTYPE.fields[name][1])
                      for name in ("generation", "producer_pid", "head_seq", "write_pos",
                                   "consumer_pid", "tail_seq", "read_pos")}
        self.header = header
        table = np.ndarray((layout.slot_count,), DESCRIPTOR_DTYPE, buffer=mm, offset=layout.table_offset)
        self.table = {name: table[name] for name in DESCRIPTOR_DTYPE.names}
        self.arena = np.ndarray((layout.arena_bytes,), np.uint8, buffer=mm, offset=layout.arena_offset)
        self._rows = np.ndarray((layout.slot_count, DESCRIPTOR_BYTES), np.uint8, buffer=mm, offset=layout.table_offset)

    def record_crc(self, index: int, parts: Sequence[Any]) -> int:
        """The ``verify`` check of the record in slot ``index``: CRC32 over its parts and every
        descriptor field the consumer reads (all but the commit, reserve, generation and check words)."""
        row = self._rows[index]
        return parts_crc((*parts, row[_CRC_FIELDS[0]:_CRC_FIELDS[1]], row[_CRC_FIELDS[2]:]))

    @classmethod
    def create(cls, path: str | os.PathLike, nbytes: int, *, slot_count: int = 256, verify: bool | None = None,
               mode: int = 0o600) -> Ring:
        """Make a new, empty ring file at ``path`` holding ``nbytes`` of record data (and
        ``slot_count`` records) at once, and map it. The file is built under a temporary name and
        renamed into place, so an attacher never sees a half-made ring; a ring already at ``path``
        is replaced (its mappers keep the old one).

        Args:
            path: the file, normally under ``/dev/shm``.
            nbytes: the arena's size (rounded up to 64); a record larger than this never fits.
            slot_count: records held at once.
            verify: CRC-check each record (default: on weakly ordered CPUs only; see the module).
            mode: the file's permissions (the node and the engine may run as different users).

        Raises:
            ConfigError: a size out of range.
            OSError: the file system has no room (``posix_fallocate`` reserves every byte now,
                so a full ``/dev/shm`` fails here and not as a SIGBUS later).
        """
        layout = RingLayout.for_capacity(nbytes, slot_count)
        verify = weakly_ordered() if verify is None else bool(verify)
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.posix_fallocate(fd, 0, layout.file_bytes)
            mm = _map(fd, layout.file_bytes)
            header = np.ndarray((), HEADER_DTYPE, buffer=mm, offset=0)
            for name, value in (("version", FORMAT_VERSION), ("flags", FLAG_VERIFY if verify else 0),
                                ("slot_count", layout.slot_count), ("descriptor_bytes", DESCRIPTOR_BYTES),
                                ("arena_bytes", layout.arena_bytes), ("arena_offset", layout.arena_offset),
                                ("table_offset", layout.table_offset), ("created_ns", time.time_ns())):
                header[name] = value
            header["magic"] = MAGIC  # last: a ring without its magic is refused
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        return cls(path, fd, mm, layout, verify)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> Ring:
        """Map an existing ring (the node attaching to an engine's ring, or a restarted engine).

        Raises:
            FileNotFoundError: no file at ``path``.
            RingFormatMismatch: not a kvwarm ring, or a ring of another format version.
        """
        path = os.fspath(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingFormatMismatch(f"a {size}-byte file is not a kvwarm write-back ring", path=path,
                                         found=None, expected=FORMAT_VERSION)
            mm = _map(fd, size)
            header = np.ndarray((), HEADER_DTYPE, buffer=mm, offset=0)
            layout = _checked_layout(header, path, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, layout, bool(int(header["flags"]) & FLAG_VERIFY))

    def writer(self) -> RingWriter:
        """Become the ring's producer (raises ``RingBusy`` while another live process is)."""
        from store.node.ring_writer import RingWriter

        self._take_end("writer")
        return RingWriter(self)

    def reader(self) -> RingReader:
        """Become the ring's consumer (raises ``RingBusy`` while another live process is)."""
        from store.node.ring_reader import RingReader

        self._take_end("reader")
        return RingReader(self)

    def producer_alive(self) -> bool:
        """Whether some other open of this ring holds the producer's end."""
        return is_held(self._fd, RingEnd.PRODUCER)

    def consumer_alive(self) -> bool:
        """Whether some other open of this ring holds the consumer's end."""
        return is_held(self._fd, RingEnd.CONSUMER)

    def close(self) -> None:
        """Unmap the ring and release this process's end. Views handed out stay valid until
        dropped (the mapping goes with the last of them)."""
        if self._fd < 0:
            return
        if self._end is not None:  # the lock is the description's: mmap's own dup of the fd would keep it
            let_go(self._fd, RingEnd.PRODUCER if self._end == "writer" else RingEnd.CONSUMER)
        mm, self._mm = self._mm, None
        self.words = {}
        self.table = {}
        self.header = self.arena = self._rows = None  # type: ignore[assignment]
        try:
            mm.close()
        except BufferError:
            pass  # views still handed out keep the mapping until they are dropped
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        """Remove the ring's file if it is still this ring (not a newer ring created at its path)."""
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_end(self, end: str) -> None:
        if self._fd < 0:
            raise ValueError(f"ring {self.path} is closed")
        if self._end is not None:
            raise ValueError(f"this open of ring {self.path} is already its {self._end}; attach the ring "
                             f"again for the other end (each end holds its own lock)")
        self._end = end


def _map(fd: int, size: int) -> mmap.mmap:
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:  # huge pages where shmem allows them (shmem_enabled "advise"): fewer TLB misses per copy
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return mm


def _checked_layout(header: np.ndarray, path: str, size: int) -> RingLayout:
    if header["magic"].tobytes() != MAGIC:
        raise RingFormatMismatch("this file is not a kvwarm write-back ring (no ring magic): pass the path the "
                                 "engine announced", path=path, found=None, expected=FORMAT_VERSION)
    version = int(header["version"])
    if version != FORMAT_VERSION:
        raise RingFormatMismatch(
            f"this ring is write-back ring format version {version}, and this kvwarm reads version "
            f"{FORMAT_VERSION}: run the engine and the node process from the same kvwarm release",
            path=path, found=version, expected=FORMAT_VERSION)
    try:
        layout = RingLayout(arena_bytes=int(header["arena_bytes"]), slot_count=int(header["slot_count"]))
    except ValueError as e:
        raise RingFormatMismatch(f"the ring's header is damaged ({e})", path=path, found=version,
                                 expected=FORMAT_VERSION) from None
    if (int(header["descriptor_bytes"]) != DESCRIPTOR_BYTES or int(header["arena_offset"]) != layout.arena_offset
            or int(header["table_offset"]) != layout.table_offset or size < layout.file_bytes):
        raise RingFormatMismatch("the ring's header does not match its file (damaged or still being made)",
                                 path=path, found=version, expected=FORMAT_VERSION)
    return layout


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
