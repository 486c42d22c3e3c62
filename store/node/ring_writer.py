"""The engine's end of a write-back ring: reserve space, fill it, commit it (never blocks)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from store.node.ring_errors import RecordTooLarge, RingBusy
from store.node.ring_layout import MAX_PARTS, SLOT_ABANDONED, record_extent
from store.node.ring_lock import RingEnd, try_hold
from store.node.ring_record import RecordMeta, Slot

if TYPE_CHECKING:
    from store.node.ring import Ring

#: the reason a caller counts for a block it drops on a ``None`` answer from :meth:`RingWriter.reserve`
RING_FULL = "ring_full"


class RingWriter:
    """The producer of one ring. One per ring; use it from one thread (vLLM's worker thread).

    Taking the producer's end bumps the ring's *generation*: slots a dead earlier producer left
    uncommitted are then known to be dead without asking the kernel.

    Attributes:
        generation: this producer's generation, stamped on every slot it reserves.
        full_answers: reservations answered ``None`` (the caller counts its drops as ``ring_full``).
    """

    def __init__(self, ring: Ring) -> None:
        if not try_hold(ring._fd, RingEnd.PRODUCER):
            ring._end = None
            raise RingBusy(f"ring {ring.path} already has a live producer (pid {int(ring.words['producer_pid'][0])}); "
                           f"one engine process writes a ring: create a ring per engine")
        self.ring = ring
        w = ring.words
        self.generation = int(w["generation"][0]) + 1
        w["generation"][0] = self.generation
        w["producer_pid"][0] = os.getpid()
        self._head = int(w["head_seq"][0])
        self._pos = int(w["write_pos"][0])
        self._arena_bytes = ring.layout.arena_bytes
        self._slots = ring.layout.slot_count
        self.full_answers = 0

    def reserve(self, *part_nbytes: int) -> Slot | None:
        """Space for one record of the given part sizes (bytes), or ``None`` at once when the ring
        has no room now (the consumer is behind, or gone).

        Raises:
            RecordTooLarge: the record can never fit this ring (more than its arena, or than 8 parts).
            ValueError: a negative size.
        """
        sizes = tuple(int(n) for n in part_nbytes)
        if not 1 <= len(sizes) <= MAX_PARTS:
            raise RecordTooLarge(f"a ring record has 1 to {MAX_PARTS} parts; got {len(sizes)}")
        if min(sizes) < 0:
            raise ValueError(f"part sizes must be >= 0; got {sizes}")
        offsets, need = record_extent(sizes)
        arena = self._arena_bytes
        if need > arena:
            raise RecordTooLarge(f"a record of {need} bytes (aligned) never fits this ring's {arena}-byte arena "
                                 f"({self.ring.path}): create the ring with nbytes >= {need}")
        w = self.ring.words
        seq = self._head
        tail = int(w["tail_seq"][0])
        if seq - tail >= self._slots:
            self.full_answers += 1
            return None
        pos = self._pos
        phys = pos % arena
        start = pos if phys + need <= arena else pos + (arena - phys)  # a record never wraps: skip the tail
        end = start + need
        # An empty ring (every record released) is free whole, whatever the skipped tail cost.
        if tail != seq and end - int(w["read_pos"][0]) > arena:
            self.full_answers += 1
            return None
        i = seq % self._slots
        t = self.ring.table
        t["generation"][i] = self.generation
        t["start"][i] = start
        t["end"][i] = end
        t["nparts"][i] = len(sizes)
        t["part_len"][i, :len(sizes)] = sizes
        t["part_off"][i, :len(sizes)] = offsets
        t["flags"][i] = 0
        t["reserve"][i] = seq + 1
        self._pos = end
        self._head = seq + 1
        w["write_pos"][0] = end
        w["head_seq"][0] = seq + 1  # after the descriptor: the consumer reads slots below head only
        base = start % arena
        views = tuple(self.ring.arena[base + o: base + o + n] for o, n in zip(offsets, sizes))
        return Slot(self, seq, i, views)

    def _publish(self, slot: Slot, meta: RecordMeta | None, *, abandoned: bool) -> None:
        i = slot.index
        t = self.ring.table
        if abandoned:
            t["flags"][i] = SLOT_ABANDONED
        else:
            assert meta is not None
            t["namespace"][i] = meta.namespace.encode("utf-8")
            t["key"][i] = meta.key.encode("utf-8")
            t["parent_key"][i] = meta.parent_key.encode("utf-8")
            t["token_count"][i] = meta.token_count
            t["layer_count"][i] = meta.layer_count
            t["precision_id"][i] = meta.precision_id
            t["chain"][i] = meta.chain
            t["created_ns"][i] = meta.created_ns
            t["nerrors"][i] = len(meta.errors)
            if meta.errors:
                t["errors"][i, :len(meta.errors)] = np.asarray(meta.errors, dtype=np.float32)
            if self.ring.verify:
                t["check"][i] = self.ring.record_crc(i, slot._parts)
        t["commit"][i] = slot.seq + 1  # last: the record is whole from here on

    @property
    def pending(self) -> int:
        """Records reserved and not yet released by the consumer."""
        return self._head - int(self.ring.words["tail_seq"][0])

    def consumer_alive(self) -> bool:
        """Whether a node process holds the ring's consumer end now."""
        return self.ring.consumer_alive()
