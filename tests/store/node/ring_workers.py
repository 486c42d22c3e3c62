"""Producer and consumer processes for the ring tests (spawned: each opens the ring itself).

Record ``k``'s parts are a byte pattern of ``k`` and a float32 ramp, so a torn or misplaced
read shows as a content mismatch. A process told to ``hang`` writes a ``ready`` file and then
waits for a ``go`` file that the test never makes: it is killed with SIGKILL there.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np

from store.node.ring import Ring
from store.node.ring_record import Record, RecordMeta


def payload(k: int, nbytes: int) -> np.ndarray:
    """Record ``k``'s first part: ``nbytes`` of a pattern that depends on ``k`` and the offset."""
    return ((np.arange(nbytes, dtype=np.uint32) * 7 + k * 131) % 251).astype(np.uint8)


def scales(k: int, count: int = 16) -> np.ndarray:
    return np.arange(count, dtype=np.float32) + np.float32(k)


def meta(k: int) -> RecordMeta:
    return RecordMeta(namespace="tenant-a", key=f"key-{k}", parent_key=f"key-{k - 1}" if k else "",
                      token_count=256, layer_count=32, precision_id=1, errors=(0.01 * k, 0.02))


def write_record(writer, k: int, nbytes: int):
    """Reserve, fill and commit record ``k``; ``None`` (nothing written) when the ring is full."""
    slot = writer.reserve(nbytes, 64)
    if slot is None:
        return None
    slot.write(0, payload(k, nbytes))
    slot.write(1, scales(k))
    slot.commit(meta(k))
    return slot


def check(record: Record, k: int, nbytes: int) -> None:
    """Raise AssertionError unless ``record`` is record ``k`` of ``nbytes``, whole."""
    assert record.meta == meta(k), (record.meta, k)
    assert record.parts[0].nbytes == nbytes
    assert np.array_equal(record.array(0), payload(k, nbytes)), f"record {k}: bytes differ"
    assert np.array_equal(record.array(1, np.float32), scales(k)), f"record {k}: scales differ"


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    """Wait until ``path`` exists (a process's signal); AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def _hang(gate: Path) -> None:
    (gate / "ready").touch()
    while not (gate / "go").exists():
        time.sleep(0.05)


def produce(path: str, sizes: list[int], result: str) -> None:
    """Write records 0.. with the given sizes, waiting (in this test process only) when full."""
    writer = Ring.attach(path).writer()
    for k, n in enumerate(sizes):
        while write_record(writer, k, n) is None:
            time.sleep(0.0005)
    Path(result).write_text(json.dumps({"full_answers": writer.full_answers, "pid": os.getpid()}))


def size_of(k: int) -> int:
    """Record ``k``'s first-part size in :func:`produce_forever`'s stream (0 to ~30 KB, uneven)."""
    return (k * 7919) % 30_011


def produce_forever(path: str, first_k: int) -> None:
    """Write records ``first_k``, ``first_k + 1``, ... of :func:`size_of` sizes until killed."""
    writer = Ring.attach(path).writer()
    k = first_k
    while True:
        if write_record(writer, k, size_of(k)) is None:
            time.sleep(0)
        else:
            k += 1


def produce_then_hang(path: str, committed: int, nbytes: int, gate: str, commit_after: bool) -> None:
    """Commit ``committed`` records, reserve and fill one more without committing it, and hang.
    With ``commit_after``, reserve and commit one further record behind the open one first."""
    writer = Ring.attach(path).writer()
    for k in range(committed):
        assert write_record(writer, k, nbytes) is not None
    slot = writer.reserve(nbytes, 64)
    assert slot is not None
    slot.write(0, np.full(nbytes, 0xEE, np.uint8))  # data in, commit word not written
    if commit_after:
        assert write_record(writer, committed + 1, nbytes) is not None
    _hang(Path(gate))


def consume_then_hang(path: str, release: int, nbytes: int, gate: str) -> None:
    """Read every committed record, release the first ``release`` of them, and hang holding the rest."""
    reader = Ring.attach(path).reader()
    records = list(reader.poll())
    for k, rec in enumerate(records):
        check(rec, k, nbytes)
    for rec in records[:release]:
        reader.release(rec)
    Path(gate, "read").write_text(str(len(records)))
    _hang(Path(gate))


def kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL ``proc`` and reap it."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode


def spawn(target, *args) -> mp.process.BaseProcess:
    """Start ``target(*args)`` in a fresh interpreter (spawn: no inherited ring or lock)."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc
