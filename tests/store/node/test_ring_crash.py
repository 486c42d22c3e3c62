"""kill -9 of either end of a write-back ring: nothing torn is read, nothing grows unbounded,
and what was committed is not lost."""
from __future__ import annotations

import numpy as np
import pytest

from store.node.ring import Ring
from store.node.ring_errors import RingBusy
from tests.store.node.ring_workers import (
    check,
    consume_then_hang,
    kill,
    meta,
    produce_forever,
    produce_then_hang,
    size_of,
    spawn,
    wait_for,
    write_record,
)

N = 5000  # bytes of each record's first part


@pytest.mark.parametrize("commit_after", [False, True], ids=["open-slot-last", "committed-slot-behind-it"])
def test_a_producer_killed_mid_write_loses_only_its_unfinished_slot(ring_path, tmp_path, commit_after) -> None:
    Ring.create(ring_path, 64 * 1024, slot_count=16).close()
    reader = Ring.attach(ring_path).reader()
    proc = spawn(produce_then_hang, ring_path, 3, N, str(tmp_path), commit_after)
    wait_for(tmp_path / "ready")
    # Alive and mid-write: the consumer gets the committed records and waits at the open slot.
    records = list(reader.poll())
    assert [r.seq for r in records] == [0, 1, 2]
    for k, rec in enumerate(records):
        check(rec, k, N)
        reader.release(rec)
    assert list(reader.poll()) == [] and reader.discarded == 0 and not reader.finished()
    kill(proc)
    # Dead: its open slot is discarded, a record committed behind it still comes out.
    later = list(reader.poll())
    assert reader.discarded == 1
    if commit_after:
        assert [r.seq for r in later] == [4]
        check(later[0], 4, N)
        reader.release(later[0])
    else:
        assert later == []
    assert reader.pending == 0 and reader.finished()
    # The space is reclaimed: a restarted engine takes the ring over and fills all of it.
    writer = Ring.attach(ring_path).writer()
    assert writer.generation == 2
    assert write_record(writer, 10, 64 * 1024 - 64) is not None
    (rec,) = reader.poll()
    check(rec, 10, 64 * 1024 - 64)

#: producers killed in turn (each a spawned process: seconds to start on the CI's two cores)
GENERATIONS = 2


def test_a_new_producer_makes_a_dead_ones_open_slot_known_dead_by_its_generation(ring_path, tmp_path) -> None:
    Ring.create(ring_path, 64 * 1024, slot_count=16).close()
    proc = spawn(produce_then_hang, ring_path, 1, N, str(tmp_path), False)
    wait_for(tmp_path / "ready")
    kill(proc)
    writer = Ring.attach(ring_path).writer()  # before any consumer looked: generation 2
    assert write_record(writer, 7, N) is not None
    reader = Ring.attach(ring_path).reader()
    records = list(reader.poll())
    assert [r.seq for r in records] == [0, 2] and reader.discarded == 1
    check(records[0], 0, N)
    check(records[1], 7, N)
    assert writer.ring.producer_alive() is False  # asked from the producer's own open: no other holder
    assert reader.ring.producer_alive() is True


def test_a_consumer_killed_leaves_the_ring_bounded_and_a_new_one_continues(ring_path, tmp_path) -> None:
    Ring.create(ring_path, 32 * 1024, slot_count=16).close()
    writer = Ring.attach(ring_path).writer()
    for k in range(4):
        assert write_record(writer, k, N) is not None
    proc = spawn(consume_then_hang, ring_path, 2, N, str(tmp_path))
    wait_for(tmp_path / "ready")
    assert (tmp_path / "read").read_text() == "4"
    with pytest.raises(RingBusy, match="live consumer"):
        Ring.attach(ring_path).reader()
    kill(proc)
    # Nobody reads: the producer fills what the dead consumer released, then is answered "full".
    k = 4
    while write_record(writer, k, N) is not None:
        k += 1
    assert k > 4 and writer.full_answers == 1
    for _ in range(3):
        assert write_record(writer, k, N) is None
    assert writer.pending == k - 2
    # A new consumer continues from the dead one's releases: records 2 and 3 again, then the rest.
    reader = Ring.attach(ring_path).reader()
    records = list(reader.poll())
    assert [r.seq for r in records] == list(range(2, k))
    for rec in records:
        check(rec, rec.seq, N)
        reader.release(rec)
    assert write_record(writer, k, N) is not None


def test_a_new_consumer_never_reads_a_slot_still_being_written(ring_path) -> None:
    Ring.create(ring_path, 32 * 1024, slot_count=16).close()
    writer = Ring.attach(ring_path).writer()
    assert write_record(writer, 0, N) is not None
    slot = writer.reserve(N, 64)
    slot.write(0, np.full(N, 0xEE, np.uint8))
    reader = Ring.attach(ring_path).reader()
    assert [r.seq for r in reader.poll()] == [0]
    assert list(reader.poll()) == [] and reader.discarded == 0  # producer alive: wait, don't discard
    slot.write(1, np.zeros(16, np.float32))
    slot.commit(meta(1))
    (rec,) = reader.poll()
    assert rec.seq == 1 and bytes(rec.parts[0][:4]) == b"\xee" * 4


def test_producers_killed_anywhere_leave_only_whole_records_in_order(ring_path) -> None:
    # No hook: each producer dies wherever SIGKILL finds it (mid-copy, mid-reserve, spinning on
    # a full ring). Every record read is whole; each generation's records come out in order.
    Ring.create(ring_path, 48 * 1024, slot_count=8).close()
    reader = Ring.attach(ring_path).reader()
    seen: list[int] = []
    for generation in range(GENERATIONS):
        first_k = 1000 * generation
        proc = spawn(produce_forever, ring_path, first_k)
        got = 0
        while got < 40 + 17 * generation:  # a different point of each stream
            for rec in reader.poll():
                k = int(rec.meta.key.removeprefix("key-"))
                check(rec, k, size_of(k))
                seen.append(k)
                reader.release(rec)
                got += 1
            assert proc.is_alive()
        kill(proc)
        for rec in reader.poll():  # what it committed before dying
            k = int(rec.meta.key.removeprefix("key-"))
            check(rec, k, size_of(k))
            seen.append(k)
            reader.release(rec)
        assert reader.finished()
    for g in range(GENERATIONS):
        mine = [k for k in seen if 1000 * g <= k < 1000 * (g + 1)]
        assert mine == list(range(1000 * g, 1000 * g + len(mine)))  # none lost between, none twice
    assert reader.discarded <= GENERATIONS
