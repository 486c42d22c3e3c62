"""Where a snapshot's payload lies in memory, and how a reader finds it.

A snapshot file is an Arrow IPC file whose one record batch holds every part (K, V and
scales of each layer). This format's writer lays the parts out one after the other in the
header's order, each padded to 8 bytes: :func:`canonical_layout` computes that layout from
the header alone, and :func:`known_span` checks a file against it from its first and last
columns, so a reader cuts every part from one span of the mapping instead of walking the
columns (:func:`column_buffers`, the fallback). :func:`map_file` maps a file read-only and
shared. No snapshot semantics here: :mod:`store.snapshot` verifies and interprets.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from store.errors import SnapshotCorrupt

if TYPE_CHECKING:
    from store.header import SnapshotHeader


def memory_bounds(source: pa.Buffer | pa.NativeFile) -> tuple[int, int] | None:
    """The address range of the memory a snapshot is read from (``None``: not in memory)."""
    if isinstance(source, pa.Buffer):
        return source.address, source.address + source.size
    if isinstance(source, pa.MemoryMappedFile) and source.size() > 0:
        pos = source.tell()
        try:
            source.seek(0)
            base = source.read_buffer(1).address  # zero-copy: the start of the mapping
        finally:
            source.seek(pos)
        return base, base + source.size()
    return None


def column_buffers(header: SnapshotHeader, batch: pa.RecordBatch, location: str) -> tuple[dict[str, pa.Buffer], list[int]]:
    """Every part's buffer, as Arrow's metadata places it, checked against the header's size."""
    parts: dict[str, pa.Buffer] = {}
    addresses = []
    for col, part in zip(batch.columns, header.parts):
        buf = col.buffers()[1]
        if buf is None or col.type.byte_width != part.nbytes or len(buf) < (col.offset + 1) * part.nbytes:
            raise SnapshotCorrupt(f"part {part.name} has the wrong size", location=location)
        if col.offset:
            buf = buf.slice(col.offset * part.nbytes, part.nbytes)
        elif len(buf) != part.nbytes:
            buf = buf.slice(0, part.nbytes)
        parts[part.name] = buf
        addresses.append(buf.address)
    return parts, addresses


@dataclass(frozen=True)
class PayloadLayout:
    """Where a snapshot's parts lie in the one region that holds them all.

    ``offsets[i]`` is the byte offset of ``parts[i]`` (the header's order) from the start
    of the region, which is ``nbytes`` long. Equal for every snapshot of one geometry and
    precision; instances are interned, so equal layouts are the same object.
    """

    parts: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, dtype, shape, nbytes)
    offsets: tuple[int, ...]
    nbytes: int

    def index(self) -> dict[str, int]:
        """Part name -> position (cached per layout)."""
        cached = self.__dict__.get("_index")
        if cached is None:
            cached = {p[0]: i for i, p in enumerate(self.parts)}
            object.__setattr__(self, "_index", cached)
        return cached


_LAYOUTS: dict[tuple, PayloadLayout] = {}
#: parts signature (name, dtype, shape, nbytes of each) -> its canonical layout
_BY_PARTS: dict[tuple, PayloadLayout] = {}


def _interned(key: tuple) -> PayloadLayout:
    """The one :class:`PayloadLayout` of ``key`` (parts, offsets, nbytes)."""
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = PayloadLayout(*key)
        if len(_LAYOUTS) < 1024:  # one per geometry and precision in practice
            _LAYOUTS[key] = layout
    return layout


def _signature(header: SnapshotHeader) -> tuple:
    return tuple((p.name, p.dtype, p.shape, p.nbytes) for p in header.parts)


def canonical_layout(header: SnapshotHeader) -> PayloadLayout:
    """Where this format's writer puts the parts: one after the other in the header's order,
    each padded to 8 bytes (Arrow IPC's buffer alignment), in one region."""
    sig = _signature(header)
    layout = _BY_PARTS.get(sig)
    if layout is None:
        offsets, at = [], 0
        for p in header.parts:
            offsets.append(at)
            at += -(-p.nbytes // 8) * 8
        layout = _interned((sig, tuple(offsets), offsets[-1] + header.parts[-1].nbytes))
        if len(_BY_PARTS) < 1024:
            _BY_PARTS[sig] = layout
    return layout


def known_span(header: SnapshotHeader, batch: pa.RecordBatch,
               bounds: tuple[int, int] | None) -> tuple[pa.Buffer, PayloadLayout] | None:
    """The span of a snapshot laid out as this format's writer lays it out (:func:`canonical_layout`),
    found from its first and last columns only (walking 100+ columns is most of the cost of
    opening a snapshot).

    Arrow has checked every column's buffer against the file; this checks that the first
    and last sit where the canonical layout puts them, inside the source's memory. Every
    byte a reader takes is then cut from the span by that layout: the bytes the writer put
    there (damaged metadata cannot move them), under the header's per-part checksums when
    the payload is verified. ``None``: walk every column instead.
    """
    if not header.parts or bounds is None:
        return None
    layout = canonical_layout(header)
    first, last = batch.column(0), batch.column(batch.num_columns - 1)
    b0, bl = first.buffers()[1], last.buffers()[1]
    p0, pl = header.parts[0], header.parts[-1]
    if (b0 is None or bl is None or first.offset or last.offset
            or first.type.byte_width != p0.nbytes or last.type.byte_width != pl.nbytes
            or len(b0) < p0.nbytes or len(bl) < pl.nbytes
            or bl.address - b0.address != layout.offsets[-1] or layout.offsets[-1] + pl.nbytes != layout.nbytes
            or b0.address < bounds[0] or b0.address + layout.nbytes > bounds[1]):
        return None
    return pa.foreign_buffer(b0.address, layout.nbytes, base=b0), layout


def span_of_columns(header: SnapshotHeader, parts: dict[str, pa.Buffer], addresses: list[int],
                    bounds: tuple[int, int] | None) -> tuple[pa.Buffer, PayloadLayout] | None:
    """One buffer over every part, and the (interned) layout of the parts in it.

    Only for parts that all lie in the source's own memory (``bounds``: the mapping or
    buffer read from): Arrow copies buffers it finds misaligned, and a span over copies
    would cover unrelated memory. ``None`` where that is unknown or not so.
    """
    if not addresses or bounds is None:
        return None
    first = header.parts[0]
    start = addresses[0]
    end = max(a + p.nbytes for a, p in zip(addresses, header.parts))
    if min(addresses) != start or end - start > 2 * header.payload_nbytes + 64 * len(addresses):
        return None  # not one region of parts in order (this format pads each to 8 bytes)
    if start < bounds[0] or end > bounds[1]:
        return None  # Arrow copied (realigned) some buffers: they are not in the source
    layout = _interned((_signature(header), tuple(a - start for a in addresses), end - start))
    base = parts[first.name]
    return pa.foreign_buffer(start, end - start, base=base), layout


def map_file(path: str | os.PathLike[str], *, willneed: bool = False) -> pa.Buffer:
    """Map a snapshot file read-only and shared (``MAP_SHARED``): a zero-copy ``pa.Buffer``.

    Pages are read when first touched; every process mapping the same file shares the
    page cache's one copy. ``willneed``: ask the kernel, once, to read the whole file ahead
    (``MADV_WILLNEED``, asynchronous; the call itself walks the file's pages, ~0.3 ms for a
    1.5 MiB file even when they are cached). Unlike
    ``pa.memory_map``, whose reads each make that ``madvise`` call again (~0.3 ms to open
    a 12-layer snapshot), reads through this buffer make no system call. The mapping goes
    when the last view of it does.

    Raises:
        FileNotFoundError: no such file. An empty file maps to an empty buffer (which
            :func:`read_snapshot` calls corrupt).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return pa.py_buffer(b"")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if willneed and hasattr(mapped, "madvise"):
        try:
            mapped.madvise(mmap.MADV_WILLNEED)
        except OSError:
            pass  # advice only
    return pa.py_buffer(mapped)
