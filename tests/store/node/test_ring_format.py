"""What a ring's consumer refuses (another format version, a file that is no ring), and the
``verify`` check that stands in for a memory fence on weakly ordered CPUs."""
from __future__ import annotations

import numpy as np
import pytest

from store.errors import OperationalError
from store.node.ring import Ring
from store.node.ring_errors import RingFormatMismatch
from store.node.ring_layout import FORMAT_VERSION, HEADER_DTYPE
from tests.store.node.ring_workers import check, spawn, write_record


def _set_version(path: str, version: int) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_DTYPE.fields["version"][1])
        f.write(int(version).to_bytes(4, "little"))


def _attach_in_a_process(path: str) -> None:
    try:
        Ring.attach(path)
    except RingFormatMismatch as e:
        raise SystemExit(10 + (e.found or 0))
    raise SystemExit(0)


def test_a_ring_of_another_format_version_is_refused_saying_which(ring_path) -> None:
    Ring.create(ring_path, 4096).close()
    _set_version(ring_path, FORMAT_VERSION + 1)
    with pytest.raises(RingFormatMismatch) as refused:
        Ring.attach(ring_path)
    assert refused.value.found == FORMAT_VERSION + 1 and refused.value.expected == FORMAT_VERSION
    assert f"version {FORMAT_VERSION + 1}" in str(refused.value) and f"reads version {FORMAT_VERSION}" in str(refused.value)
    assert isinstance(refused.value, OperationalError)
    proc = spawn(_attach_in_a_process, ring_path)  # a node process started on its own says the same
    proc.join(60)
    assert proc.exitcode == 10 + FORMAT_VERSION + 1
    _set_version(ring_path, FORMAT_VERSION)
    Ring.attach(ring_path).close()


def test_a_file_that_is_no_ring_is_refused(ring_path) -> None:
    with open(ring_path, "wb") as f:
        f.write(b"\x00" * 8192)
    with pytest.raises(RingFormatMismatch, match="not a kvwarm write-back ring") as refused:
        Ring.attach(ring_path)
    assert refused.value.found is None
    with open(ring_path, "wb") as f:
        f.write(b"short")
    with pytest.raises(RingFormatMismatch, match="5-byte file"):
        Ring.attach(ring_path)


def test_a_header_that_does_not_match_its_file_is_refused(ring_path) -> None:
    Ring.create(ring_path, 1 << 16).close()
    with open(ring_path, "r+b") as f:
        f.truncate(8192)
    with pytest.raises(RingFormatMismatch, match="does not match its file"):
        Ring.attach(ring_path)


def test_a_verify_ring_holds_back_a_record_whose_bytes_have_not_all_arrived(ring_path) -> None:
    producer = Ring.create(ring_path, 1 << 16, verify=True)
    writer = producer.writer()
    reader = Ring.attach(ring_path).reader()
    assert reader.ring.verify
    slot = write_record(writer, 0, 3000)
    # As a weakly ordered CPU may show it: the commit word is visible, one data store is not yet.
    part = slot._parts[0]
    late = int(part[1234])
    part[1234] = late ^ 0xFF
    assert list(reader.poll()) == [] and reader.unsettled == 1
    part[1234] = late  # the store arrives
    (rec,) = reader.poll()
    check(rec, 0, 3000)


def test_a_plain_ring_hands_records_out_without_a_checksum(ring_path) -> None:
    producer = Ring.create(ring_path, 1 << 16, verify=False)
    writer = producer.writer()
    reader = Ring.attach(ring_path).reader()
    write_record(writer, 0, 100)
    assert not reader.ring.verify and int(reader.ring.table["check"][0]) == 0
    (rec,) = reader.poll()
    assert np.array_equal(rec.array(1, np.float32), np.arange(16, dtype=np.float32))


def test_a_verify_ring_holds_back_a_record_whose_metadata_has_not_all_arrived(ring_path) -> None:
    writer = Ring.create(ring_path, 1 << 16, verify=True).writer()
    reader = Ring.attach(ring_path).reader()
    write_record(writer, 0, 100)
    keys = writer.ring.table["key"]
    keys[0] = b"stale-key"
    assert list(reader.poll()) == [] and reader.unsettled == 1
    keys[0] = b"key-0"
    (rec,) = reader.poll()
    check(rec, 0, 100)
