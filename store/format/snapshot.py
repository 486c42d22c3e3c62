"""Snapshot files: map one back zero-copy, check it, hand out its parts.

A snapshot holds the KV of one block (``block_size`` tokens, every layer). On disk it
is an uncompressed Arrow IPC file: the header (JSON) and its checksum live in the
schema metadata; the payload is one record batch with one ``large_binary`` column
whose one value holds every part (``k.<layer>``, ``v.<layer>``, ``k_scale.<layer>``,
``v_scale.<layer>``) where :func:`store.format.payload.canonical_layout` puts it, so each part
maps straight into numpy and torch with no copy. See ``docs/reference/format.md`` for the layout
and the one-block-per-file trade-off. Making one is :mod:`store.format.encode` (its names are
also importable from here).
"""
from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import torch
import xxhash

from store.errors import SnapshotCorrupt, SnapshotError
from store.format.header import SnapshotHeader
from store.format.payload import META_CHECKSUM, META_HEADER, PayloadLayout, payload_span
from store.format.precision import STORAGE_DTYPES, dequantize

# What a damaged file can make pyarrow (or our parsing of what it returns) raise.
# All of it means "corrupt"; none of it may escape untyped into the serving path.
_DAMAGE = (pa.ArrowException, OSError, UnicodeDecodeError, KeyError, IndexError, ValueError, TypeError,
           NotImplementedError, OverflowError)


class Snapshot:
    """A snapshot opened for reading: header plus zero-copy views of its parts.

    The views are read-only and stay valid while this object (which holds the
    mapping) is alive.
    """

    def __init__(self, header: SnapshotHeader, span: tuple[pa.Buffer, PayloadLayout], source: object,
                 location: str) -> None:
        self.header = header
        self.location = location
        self._part_views: dict[str, pa.Buffer] | None = None  # cut from the span when first asked for
        self._source = source  # keeps the memory map alive
        self._span: tuple[pa.Buffer, PayloadLayout] | None = span

    @property
    def _parts(self) -> dict[str, pa.Buffer]:
        """Part name -> zero-copy buffer (cut from the span on first use; empty once closed)."""
        if self._part_views is None:
            if self._span is None:
                self._part_views = {}
            else:
                buf, layout = self._span
                self._part_views = {p[0]: buf.slice(off, p[3]) for p, off in zip(layout.parts, layout.offsets)}
        return self._part_views

    @property
    def payload(self) -> tuple[np.ndarray, "PayloadLayout"] | None:
        """Every part at once: one read-only ``uint8`` array spanning the payload (no copy),
        and where each part lies in it; ``None`` once closed.

        Snapshots of one geometry written by this format share their :class:`PayloadLayout`
        (the same object), so a reader can copy or dequantise many of them with one
        operation per snapshot instead of one per part.
        """
        if self._span is None:
            return None
        return np.frombuffer(self._span[0], dtype=np.uint8), self._span[1]

    def array(self, name: str) -> np.ndarray:
        """The raw bytes of one part as a read-only ``uint8`` array (no copy)."""
        return np.frombuffer(self._parts[name], dtype=np.uint8)

    def tensor(self, name: str) -> torch.Tensor:
        """One part as a torch tensor in its stored dtype and shape (no copy)."""
        part = next(p for p in self.header.parts if p.name == name)
        with warnings.catch_warnings():
            # The mapping is read-only by design; torch warns that it cannot write to it.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(self.array(name))
        return t.view(STORAGE_DTYPES[part.dtype]).view(part.shape)

    def layer(self, layer: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(K, V)``, dequantised to ``dtype``, each ``[kv_heads, tokens, head_dim]``."""
        out = []
        g = self.header.precision.group_tokens
        for name in ("k", "v"):
            scale_name = f"{name}_scale.{layer}"
            scale = self.tensor(scale_name) if scale_name in self._parts else None
            out.append(dequantize(self.tensor(f"{name}.{layer}"), scale, dtype, g))
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        return self.header.payload_nbytes

    def close(self) -> None:
        """Drop the views and the mapping (views taken earlier must not be used after)."""
        self._part_views = {}  # not None: nothing is cut from the span after close
        self._span = None
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._source = None  # a mapped buffer is unmapped when its last view goes


#: the part of a header that does not grow with its payload, with room to spare (a genuine one is ~2 KiB)
HEADER_BASE_BYTES = 128 << 10


def _open(source: pa.Buffer | pa.NativeFile, location: str) -> tuple[pa.ipc.RecordBatchFileReader, SnapshotHeader, bytes]:
    try:
        reader = pa.ipc.open_file(source)
        meta = reader.schema.metadata or {}
    except _DAMAGE as exc:
        raise SnapshotCorrupt(f"unreadable snapshot: {exc}", location=location) from None
    raw = meta.get(META_HEADER)
    if raw is None or SnapshotHeader.checksum(raw) != meta.get(META_CHECKSUM, b"").decode(errors="replace"):
        raise SnapshotCorrupt("header checksum mismatch or header missing", location=location)
    # A header's numbers (token ids, shapes, errors) grow with its payload; one far larger than its
    # payload can need is refused before parsing, which costs several times the text.
    size = source.size if isinstance(source, pa.Buffer) else source.size()
    payload = max(0, size - 2 * len(raw))  # the file holds the header twice (schema and footer)
    if len(raw) > HEADER_BASE_BYTES + 8 * payload:
        raise SnapshotCorrupt(f"header of {len(raw)} bytes for a payload of about {payload}: more than any "
                              "genuine snapshot's", location=location)
    return reader, SnapshotHeader.from_json(raw, location=location), raw


def read_header(source: pa.Buffer | pa.NativeFile, *, location: str = "") -> SnapshotHeader:
    """Only the header (checksummed), without touching the payload."""
    return _open(source, location)[1]


def read_snapshot(source: pa.Buffer | pa.NativeFile, *, location: str = "", verify_payload: bool = True,
                  full: bool = False) -> Snapshot:
    """Open a snapshot from a memory map or an in-memory buffer.

    Args:
        source: a mapped file (:func:`store.format.payload.map_file`, zero-copy; ``pa.memory_map``
            works too) or a ``pa.Buffer``.
        location: where it came from, for error messages.
        verify_payload: check every part's checksum (xxh3, ~9 GB/s).
        full: also check the schema copy at the start of the file and the
            key/token consistency (what ``prefill store verify`` and GC do).

    Raises:
        SnapshotCorrupt: damaged bytes anywhere we read.
        UnknownFormatVersion: written by a format this reader does not know.
        SnapshotMismatch: (``full``) the key is not the hash of its own contents.
    """
    try:
        reader, header, raw = _open(source, location)
        if reader.num_record_batches != 1:
            raise SnapshotCorrupt("payload must be exactly one record batch", location=location)
        span = payload_span(header, reader.get_batch(0), location)
        if verify_payload:
            _verify(header, span, location)
        if full:
            _check_leading_schema(source, raw, location)
            header.check_consistent(location=location)
    except SnapshotError:
        raise
    except _DAMAGE as exc:
        raise SnapshotCorrupt(f"unreadable snapshot: {exc}", location=location) from None
    return Snapshot(header, span, source, location)


def _verify(header: SnapshotHeader, span: tuple[pa.Buffer, PayloadLayout], location: str) -> None:
    """Every part's xxh3 against the header's."""
    view = memoryview(span[0])
    for part, off in zip(header.parts, span[1].offsets):
        if xxhash.xxh3_64_hexdigest(view[off:off + part.nbytes]) != part.xxh3:
            raise SnapshotCorrupt(f"payload checksum mismatch in part {part.name}", location=location)


def _check_leading_schema(source: pa.Buffer | pa.NativeFile, raw: bytes, location: str) -> None:
    """The IPC file repeats the schema at its start; both copies must agree."""
    if isinstance(source, pa.Buffer):
        buf = source
    else:
        # Arrow IPC: 8-byte file magic, then 0xFFFFFFFF and the schema message's length.
        prefix = source.read_at(16, 0)
        length = int.from_bytes(prefix[12:16], "little", signed=True)
        if length <= 0 or length > source.size():
            raise SnapshotCorrupt("leading schema length is invalid", location=location)
        buf = pa.py_buffer(source.read_at(16 + length, 0))
    stream = pa.ipc.open_stream(pa.BufferReader(buf.slice(8)))
    if (stream.schema.metadata or {}).get(META_HEADER) != raw:
        raise SnapshotCorrupt("the two header copies in the file differ", location=location)
