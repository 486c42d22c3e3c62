"""The write-back ring's queue: order, wrap-around, full answers, large records, one process
per end (spawned producers), and the refusals."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from store.node.ring import Ring
from store.node.ring_errors import RecordTooLarge, RingBusy
from store.node.ring_layout import ALIGN
from store.node.ring_record import RecordMeta
from tests.store.node.ring_workers import check, meta, produce, spawn, write_record


def _ends(path: str, nbytes: int, slot_count: int = 64):
    producer = Ring.create(path, nbytes, slot_count=slot_count)
    consumer = Ring.attach(path)
    return producer.writer(), consumer.reader()


def test_records_cross_processes_in_order_and_whole_through_a_small_ring(ring_path, tmp_path) -> None:
    rng = random.Random(7)
    sizes = [rng.choice([0, 1, 63, 64, 65, 4096, 20_000, 40_000]) for _ in range(300)]
    Ring.create(ring_path, 64 * 1024, slot_count=8).close()  # much smaller than the stream: it wraps many times
    reader = Ring.attach(ring_path).reader()
    proc = spawn(produce, ring_path, sizes, str(tmp_path / "result.json"))
    k = 0
    while k < len(sizes):
        for rec in reader.poll():
            assert rec.seq == k
            check(rec, k, sizes[k])
            reader.release(rec)
            k += 1
        assert proc.is_alive() or proc.exitcode == 0, f"producer exited with {proc.exitcode}"
    proc.join(60)
    assert proc.exitcode == 0
    assert json.loads((tmp_path / "result.json").read_text())["pid"] == proc.pid
    assert list(reader.poll()) == [] and reader.pending == 0 and reader.discarded == 0


def test_wrap_around_skips_the_arena_tail_and_keeps_bytes_whole(ring_path) -> None:
    writer, reader = _ends(ring_path, 10 * ALIGN)
    starts = []
    for k in range(12):  # 3-line records in a 10-line arena: each fourth one wraps
        slot = write_record(writer, k, 3 * ALIGN - 64)
        assert slot is not None
        starts.append(int(writer.ring.table["start"][slot.index]) % (10 * ALIGN))
        (rec,) = reader.poll()
        check(rec, k, 3 * ALIGN - 64)
        reader.release(rec)
    assert starts[:4] == [0, 3 * ALIGN, 6 * ALIGN, 0]  # the fourth does not fit before the end


def test_a_full_ring_answers_none_at_once_and_takes_records_again_after_a_release(ring_path) -> None:
    writer, reader = _ends(ring_path, 4096, slot_count=64)
    held = [write_record(writer, k, 1000) for k in range(4)]  # 4 x (1000 + 64 aligned) = 4352 > 4096
    assert held[:3] and all(s is not None for s in held[:3]) and held[3] is None
    assert writer.full_answers == 1
    assert write_record(writer, 3, 1000) is None  # still full: the answer never waits
    records = list(reader.poll())
    assert [r.seq for r in records] == [0, 1, 2]
    reader.release(records[1])  # out of order: nothing reclaimed while record 0 is out
    assert write_record(writer, 3, 1000) is None
    reader.release(records[0])
    assert write_record(writer, 3, 1000) is not None
    assert writer.full_answers == 3


def test_the_slot_table_bounds_the_ring_too(ring_path) -> None:
    writer, reader = _ends(ring_path, 1 << 20, slot_count=2)
    assert write_record(writer, 0, 10) and write_record(writer, 1, 10)
    assert write_record(writer, 2, 10) is None
    first = next(reader.poll())
    reader.release(first)
    assert write_record(writer, 2, 10) is not None


def test_a_record_as_large_as_the_arena_fits_an_empty_ring_and_a_larger_one_is_refused(ring_path) -> None:
    arena = 1 << 20
    writer, reader = _ends(ring_path, arena)
    assert write_record(writer, 0, 100) is not None
    with pytest.raises(RecordTooLarge, match="nbytes >="):
        writer.reserve(arena, 64)  # with its scales part it is over the arena: never fits
    assert writer.reserve(arena - 64, 64) is None  # fits only an empty ring
    reader.release(next(reader.poll()))
    slot = write_record(writer, 1, arena - 64)  # the whole arena, across the wrap
    assert slot is not None
    rec = next(reader.poll())
    check(rec, 1, arena - 64)


def test_an_abandoned_slot_is_skipped_and_its_space_reclaimed(ring_path) -> None:
    writer, reader = _ends(ring_path, 4096)
    slot = writer.reserve(3000)
    slot.abandon()
    assert write_record(writer, 1, 2000) is None  # not reclaimed until the consumer passes it
    assert list(reader.poll()) == [] and reader.abandoned == 1
    assert write_record(writer, 1, 2000) is not None
    (rec,) = reader.poll()
    check(rec, 1, 2000)
    with pytest.raises(ValueError, match="already committed or abandoned"):
        slot.commit(meta(0))


def test_a_slot_can_be_filled_in_place_through_its_part_view(ring_path) -> None:
    writer, reader = _ends(ring_path, 1 << 16)
    slot = writer.reserve(4 * 8 * 16, 0)
    kv = slot.part(0).view(np.float32).reshape(8, 16)
    np.multiply(np.arange(128, dtype=np.float32).reshape(8, 16), 2, out=kv)  # e.g. a gather's out=
    slot.commit(RecordMeta(namespace="n", key="k"))
    (rec,) = reader.poll()
    assert np.array_equal(rec.array(0, np.float32), np.arange(128, dtype=np.float32) * 2)
    assert rec.parts[1].nbytes == 0
    with pytest.raises(TypeError):
        rec.parts[0][0] = 1  # read-only to the consumer


def test_each_end_is_held_by_one_open_at_a_time(ring_path) -> None:
    writer, _reader = _ends(ring_path, 4096)
    with pytest.raises(RingBusy, match="live producer"):
        Ring.attach(ring_path).writer()
    with pytest.raises(RingBusy, match="live consumer"):
        Ring.attach(ring_path).reader()
    with pytest.raises(ValueError, match="attach the ring again"):
        writer.ring.reader()
    writer.ring.close()  # the producer leaves: another may take over, one generation on
    again = Ring.attach(ring_path).writer()
    assert again.generation == writer.generation + 1


def test_record_metadata_is_bounded_by_the_descriptor() -> None:
    with pytest.raises(RecordTooLarge, match="at most 192"):
        RecordMeta(namespace="n", key="k" * 193)
    with pytest.raises(RecordTooLarge, match="NUL"):
        RecordMeta(namespace="a\x00b", key="k")
    with pytest.raises(RecordTooLarge, match="at most 336"):
        RecordMeta(namespace="n", key="k", errors=(0.0,) * 337)
    with pytest.raises(ValueError, match="token_count"):
        RecordMeta(namespace="n", key="k", token_count=-1)


def test_wait_returns_once_a_producer_in_another_process_has_written(ring_path, tmp_path) -> None:
    Ring.create(ring_path, 1 << 16).close()
    reader = Ring.attach(ring_path).reader()
    assert reader.wait(0) is False  # nothing yet, and it does not sleep past its timeout
    proc = spawn(produce, ring_path, [100, 200], str(tmp_path / "result.json"))
    got = []
    while len(got) < 2:
        assert reader.wait(60), "the producer's records never came"
        for rec in reader.poll():
            check(rec, rec.seq, [100, 200][rec.seq])
            got.append(rec)
    proc.join(60)
    assert proc.exitcode == 0 and reader.wait(0) is False


def test_unlink_removes_only_the_ring_it_mapped(ring_path) -> None:
    old = Ring.attach(Ring.create(ring_path, 4096).path)
    new = Ring.create(ring_path, 8192)  # an engine restarted and made a fresh ring at the same path
    old.unlink()
    assert Ring.attach(ring_path).layout.arena_bytes == 8192  # still there: not old's file
    new.unlink()
    with pytest.raises(FileNotFoundError):
        Ring.attach(ring_path)
