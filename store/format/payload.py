"""Where a snapshot's payload lies in memory, and how a reader finds it.

A snapshot file is an Arrow IPC file whose one record batch has one column of one value:
the payload, every part (K, V and scales of each layer) one after the other in the
header's order, each starting 8-byte aligned. :func:`canonical_layout` computes where
each part lies from the header alone, and :func:`payload_span` finds the payload in a
batch, so a reader cuts every part from one buffer, whatever the layer count.
:func:`payload_nbytes` and :func:`kv_bytes_per_token` say how large a payload is from
the geometry and precision alone, before anything is written: the one source of the
KV bytes a token takes in the store. :func:`map_file` maps a file read-only and shared.
No snapshot semantics here: :mod:`store.format.snapshot` verifies and interprets.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from store.errors import SnapshotCorrupt
from store.format.precision import STORAGE_DTYPES

if TYPE_CHECKING:
    from store.format.header import Layout, SnapshotHeader
    from store.format.precision import Precision

#: schema metadata keys: the header's canonical JSON, and its xxh3-64 (hex)
META_HEADER = b"kvwarm.header"
META_CHECKSUM = b"kvwarm.header_xxh3"
#: the one column of the one record batch, the payload, and its type: ``large_binary``,
#: not ``fixed_size_binary``, whose width Arrow caps at 256 MiB
PAYLOAD_COLUMN = "payload"
PAYLOAD_TYPE = pa.large_binary()


@dataclass(frozen=True)
class PayloadLayout:
    """Where a snapshot's parts lie in the one region that holds them all.

    ``offsets[i]`` is the byte offset of ``parts[i]`` (the header's order) from the start
    of the region, which is ``nbytes`` long. Equal for every snapshot of one geometry and
    precision; :func:`canonical_layout` interns them, so equal layouts are the same object.
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


#: parts signature (name, dtype, shape, nbytes of each) -> its canonical layout
_BY_PARTS: dict[tuple, PayloadLayout] = {}


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the 8-byte boundary where the next part starts."""
    return -(-nbytes // 8) * 8


def canonical_layout(header: SnapshotHeader) -> PayloadLayout:
    """Where the parts lie in the payload: one after the other in the header's order, each
    starting 8-byte aligned (zero padding between them), the last one unpadded. Computed
    from the header alone; one interned instance per geometry and precision."""
    sig = tuple(p[:4] for p in header.parts)  # (name, dtype, shape, nbytes) of each
    layout = _BY_PARTS.get(sig)
    if layout is None:
        offsets, at = [], 0
        for p in header.parts:
            offsets.append(at)
            at += _aligned(p.nbytes)
        layout = PayloadLayout(sig, tuple(offsets), offsets[-1] + header.parts[-1].nbytes)
        if len(_BY_PARTS) < 1024:  # one per geometry and precision in practice
            _BY_PARTS[sig] = layout
    return layout


def payload_nbytes(layout: Layout, precision: Precision) -> int:
    """Bytes of the payload of one block of geometry ``layout`` stored in ``precision``.

    What :func:`store.format.encode.encode_snapshot` lays out (``canonical_layout(...).nbytes``):
    per layer K then V, ``[kv_heads, block_size, head_dim]`` in the layer's storage dtype
    (FP8, or ``keep_dtype`` for the kept layers), each FP8 one followed by its fp32
    scales (one per kv head, or per kv head and group of ``group_tokens``), 8-byte aligned.
    """
    values = layout.num_kv_heads * layout.block_size * layout.head_dim
    if precision.granularity == "head_group":
        scales = layout.num_kv_heads * -(-layout.block_size // precision.group_tokens)
    else:
        scales = layout.num_kv_heads
    sizes: list[int] = []
    for layer in range(layout.num_layers):
        dtype = precision.layer_dtype(layer)
        part = values * STORAGE_DTYPES[dtype].itemsize
        sizes += [part, scales * 4] * 2 if dtype == "fp8_e4m3" else [part] * 2  # K (+ scales), V (+ scales)
    return sum(_aligned(n) for n in sizes[:-1]) + sizes[-1]


def kv_bytes_per_token(layout: Layout, precision: Precision) -> float:
    """KV bytes one token takes in the store: :func:`payload_nbytes` over the block's tokens
    (the kept layers and the per-block scales included; the file's header is not)."""
    return payload_nbytes(layout, precision) / layout.block_size


def payload_span(header: SnapshotHeader, batch: pa.RecordBatch, location: str) -> tuple[pa.Buffer, PayloadLayout]:
    """The payload's bytes (zero-copy) and the layout of the parts in them.

    The file's one record batch holds one ``large_binary`` column of one value, the
    payload, laid out by :func:`canonical_layout` and starting at offset 0 of the column's
    data buffer (so 8-byte aligned in the file). Arrow has checked the buffers against
    the file; this checks the value against the header.

    Raises:
        SnapshotCorrupt: the batch is not one such value of the header's payload size.
    """
    if not header.parts:
        raise SnapshotCorrupt("the header lists no payload parts", location=location)
    layout = canonical_layout(header)
    if batch.num_columns != 1 or batch.num_rows != 1 or batch.column(0).type != PAYLOAD_TYPE:
        raise SnapshotCorrupt(f"payload must be one large_binary value, got {batch.num_columns} column(s) of "
                              f"{batch.num_rows} row(s), {batch.schema.types}", location=location)
    col = batch.column(0)
    _, offsets, data = col.buffers()
    at = col.offset * 8
    if offsets is None or data is None or len(offsets) < at + 16:
        raise SnapshotCorrupt("payload buffers are missing", location=location)
    start, end = (int(x) for x in memoryview(offsets)[at:at + 16].cast("q"))
    if start != 0 or end != layout.nbytes or len(data) < end:
        raise SnapshotCorrupt(f"payload is bytes {start}..{end} of a {len(data)}-byte buffer; the header lays out "
                              f"0..{layout.nbytes}", location=location)
    return (data if len(data) == end else data.slice(0, end)), layout


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
