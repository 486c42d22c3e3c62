"""The ring against a model queue (Hypothesis): random record sizes, polls and out-of-order
releases; every committed record comes out once, in order, whole, and the ring stays bounded."""
from __future__ import annotations

import os
import uuid
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from store.node.ring import Ring
from store.node.ring_layout import ALIGN
from tests.store.node.ring_workers import check, write_record

ARENA = 16 * 1024
SLOTS = 6

_sizes = st.one_of(st.integers(0, 200), st.integers(0, ARENA - ALIGN), st.sampled_from([ALIGN, 4096, ARENA - ALIGN]))
_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), _sizes),
    st.tuples(st.just("poll"), st.integers(1, 4)),
    st.tuples(st.just("release"), st.integers(0, 10)),
), min_size=1, max_size=60)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN + ALIGN  # the part and the 64-byte scales part


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_the_ring_behaves_as_a_bounded_fifo_queue(ops) -> None:
    path = f"/dev/shm/kvwarm-test-{uuid.uuid4().hex}.ring"
    producer = Ring.create(path, ARENA, slot_count=SLOTS)
    consumer = Ring.attach(path)
    try:
        writer, reader = producer.writer(), consumer.reader()
        unread: deque[tuple[int, int]] = deque()  # (k, size) committed, not handed out: the model queue
        out: list = []  # handed out, not released
        live_bytes: dict[int, int] = {}  # seq -> aligned bytes, reserved and not released
        k = 0
        for op, arg in ops:
            if op == "write":
                slot = write_record(writer, k, arg)
                if slot is None:
                    assert live_bytes, "an empty ring refused a record that fits its arena"
                else:
                    assert slot.seq == k
                    unread.append((k, arg))
                    live_bytes[k] = _aligned(arg)
                    k += 1
            elif op == "poll":
                got = list(reader.poll(limit=arg))
                assert len(got) == min(arg, len(unread))
                for rec in got:
                    want_k, want_size = unread.popleft()
                    assert rec.seq == want_k
                    check(rec, want_k, want_size)
                    out.append(rec)
            elif out:
                rec = out.pop(arg % len(out))
                check(rec, rec.seq, rec.parts[0].nbytes)  # still whole until released
                reader.release(rec)
                live_bytes.pop(rec.seq)
            assert sum(live_bytes.values()) <= ARENA and len(live_bytes) <= SLOTS
            assert reader.outstanding == len(out)
            oldest = min(live_bytes, default=k)
            assert reader.pending == k - oldest  # reclaimed up to the oldest record still held
        for rec in reader.poll():
            want_k, want_size = unread.popleft()
            check(rec, want_k, want_size)
        assert not unread
    finally:
        producer.close()
        consumer.close()
        os.unlink(path)
