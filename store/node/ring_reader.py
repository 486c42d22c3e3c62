"""The node's end of a write-back ring: committed records in order, released when stored."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from store.node.ring_errors import RingBusy
from store.node.ring_layout import MAX_PARTS, SLOT_ABANDONED
from store.node.ring_lock import RingEnd, try_hold
from store.node.ring_record import Record, RecordMeta

if TYPE_CHECKING:
    from store.node.ring import Ring


class RingReader:
    """The consumer of one ring (the node process). One per ring; use it from one thread.

    It starts where the ring's last consumer released up to, so a node restarted after a crash
    gets again the records the dead one had read but not released, and never an uncommitted one.

    Attributes:
        discarded: slots a dead producer left uncommitted, skipped and reclaimed.
        abandoned: slots the producer gave up (``Slot.abandon``), skipped and reclaimed.
        unsettled: polls that found a committed record whose CRC did not match yet (``verify``
            rings on weakly ordered CPUs); it is tried again on the next poll.
    """

    def __init__(self, ring: Ring) -> None:
        if not try_hold(ring._fd, RingEnd.CONSUMER):
            ring._end = None
            raise RingBusy(f"ring {ring.path} already has a live consumer (pid {int(ring.words['consumer_pid'][0])}): "
                           f"one node process reads a ring; stop the other one first")
        self.ring = ring
        ring.words["consumer_pid"][0] = os.getpid()
        self._tail = int(ring.words["tail_seq"][0])
        self._next = self._tail
        self._settled: set[int] = set()  # handed-out or skipped slots at or after the tail, now done with
        self._slots = ring.layout.slot_count
        self._arena_bytes = ring.layout.arena_bytes
        self._mv = memoryview(ring.arena).toreadonly()
        self.discarded = 0
        self.abandoned = 0
        self.unsettled = 0

    def poll(self, limit: int | None = None) -> Iterator[Record]:
        """Committed records not handed out yet, oldest first, up to ``limit``.

        Stops at the first slot still being written by a live producer (records come out in
        the order they were reserved). Slots a dead producer left unfinished are discarded on
        the way. Each record's views stay valid until :meth:`release`.
        """
        w = self.ring.words
        t = self.ring.table
        head = int(w["head_seq"][0])
        given = 0
        producer_dead: bool | None = None
        while self._next < head and (limit is None or given < limit):
            seq = self._next
            i = seq % self._slots
            if int(t["commit"][i]) != seq + 1:
                if int(t["generation"][i]) == int(w["generation"][0]):
                    if producer_dead is None:
                        producer_dead = not self.ring.producer_alive()
                    if not producer_dead:
                        return  # still being written
                # Its producer is gone (or replaced). Look once more: it may have committed
                # between our first look and its death; a dead producer writes nothing more.
                if int(t["commit"][i]) != seq + 1:
                    self.discarded += 1
                    self._settle(seq)
                    self._next = seq + 1
                    continue
            if int(t["flags"][i]) & SLOT_ABANDONED:
                self.abandoned += 1
                self._settle(seq)
                self._next = seq + 1
                continue
            parts = self._parts(i)
            if self.ring.verify and self.ring.record_crc(i, parts) != int(t["check"][i]):
                self.unsettled += 1
                return
            record = Record(seq=seq, meta=self._meta(i), parts=parts)
            self._next = seq + 1
            given += 1
            yield record

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the producer has reserved a record this reader has not handed out (or left
        slots behind), at most ``timeout_s``; True when a :meth:`poll` may find something.

        It polls one word with a backoff from 50 us to 1 ms, so an idle node costs no core and a
        busy one sees a record within about a millisecond; the producer pays nothing for it.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        head = self.ring.words["head_seq"]
        pause = 50e-6
        while int(head[0]) <= self._next:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)
        return True

    def release(self, record: Record) -> None:
        """Done with ``record`` (stored, or given up): its space may be reused by the producer.

        Records may be released in any order; space is reclaimed up to the oldest one still out.
        """
        if not self._tail <= record.seq < self._next or record.seq in self._settled:
            raise ValueError(f"record {record.seq} is not out of this reader (released already, or another ring's)")
        self._settle(record.seq)

    @property
    def outstanding(self) -> int:
        """Records handed out and not yet released."""
        return self._next - self._tail - sum(1 for s in self._settled if s < self._next)

    @property
    def pending(self) -> int:
        """Records reserved by the producer and not yet released (committed or not)."""
        return int(self.ring.words["head_seq"][0]) - self._tail

    def finished(self) -> bool:
        """Whether the producer is gone and every record it left is released: the node may close
        the ring and :meth:`Ring.unlink` it."""
        return self.pending == 0 and not self.ring.producer_alive()

    def _parts(self, i: int) -> tuple[memoryview, ...]:
        t = self.ring.table
        n = min(int(t["nparts"][i]), MAX_PARTS)
        base = int(t["start"][i]) % self._arena_bytes
        return tuple(self._mv[base + o: base + o + ln]
                     for o, ln in zip(t["part_off"][i, :n].tolist(), t["part_len"][i, :n].tolist()))

    def _meta(self, i: int) -> RecordMeta:
        t = self.ring.table
        nerrors = int(t["nerrors"][i])
        return RecordMeta(
            namespace=bytes(t["namespace"][i]).decode("utf-8"),
            key=bytes(t["key"][i]).decode("utf-8"),
            parent_key=bytes(t["parent_key"][i]).decode("utf-8"),
            token_count=int(t["token_count"][i]),
            layer_count=int(t["layer_count"][i]),
            precision_id=int(t["precision_id"][i]),
            errors=tuple(t["errors"][i, :nerrors].tolist()),
            chain=int(t["chain"][i]),
            created_ns=int(t["created_ns"][i]),
        )

    def _settle(self, seq: int) -> None:
        self._settled.add(seq)
        if seq != self._tail:
            return
        t = self.ring.table
        tail = self._tail
        read_pos = None
        while tail in self._settled:
            self._settled.discard(tail)
            read_pos = int(t["end"][tail % self._slots])
            tail += 1
        self._tail = tail
        # Both after every read of the released records. tail_seq first: a consumer killed between
        # the two leaves read_pos behind (less room, for a while), never ahead of records a new
        # consumer will deliver again.
        w = self.ring.words
        w["tail_seq"][0] = tail
        if read_pos is not None:
            w["read_pos"][0] = read_pos
