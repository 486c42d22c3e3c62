"""Making a snapshot file: its pieces are the file, written whole by one writev."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.format.encode import snapshot_bytes, write_pieces, write_snapshot
from tests.store.factories import make_chain, make_root, make_snapshot


def _write(tmp_path: Path, snap) -> Path:
    p = tmp_path / "s.kvw"
    with open(p, "wb") as f:
        write_snapshot(f, snap)
    return p


def test_pieces_are_the_file_and_survive_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces a tier writes with writev are exactly the file, and a short write resumes mid-piece."""
    snap = make_snapshot(make_root(), make_chain(make_root(), 1)[0])
    data = _write(tmp_path, snap).read_bytes()
    assert b"".join(snap.pieces) == data == snapshot_bytes(snap)
    assert snap.file_size == len(data)

    real_writev = os.writev
    calls = []

    def short_writev(fd: int, views) -> int:  # the kernel may write fewer bytes than asked
        calls.append(len(views))
        head = b"".join(bytes(v) for v in views)[:1000]
        return real_writev(fd, [head])

    monkeypatch.setattr(os, "writev", short_writev)
    fd = os.open(tmp_path / "short.kvw", os.O_WRONLY | os.O_CREAT)
    try:
        assert write_pieces(fd, snap.pieces) == len(data)
    finally:
        os.close(fd)
    assert (tmp_path / "short.kvw").read_bytes() == data
    assert len(calls) == -(-len(data) // 1000)
