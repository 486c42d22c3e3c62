"""Making a snapshot file: quantise one block's KV, describe it, lay it out, serialise it.

:func:`build_snapshot` quantises and measures the error; :func:`encode_snapshot` takes
KV already quantised (the prefill job quantises a batch at once on its device) and lays
the parts out in one payload (:func:`store.format.payload.canonical_layout`). The result, an
:class:`EncodedSnapshot`, knows its file as pieces: Arrow IPC framing and zero-copy
views of the payload, which :func:`write_pieces` hands to one ``writev`` and
:func:`snapshot_bytes` joins for object stores. Reading is :mod:`store.format.snapshot`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import BinaryIO, Sequence

import numpy as np
import pyarrow as pa
import torch
import xxhash

from store.format.header import SOURCES, Layout, Part, SnapshotHeader
from store.format.payload import META_CHECKSUM, META_HEADER, PAYLOAD_COLUMN, PAYLOAD_TYPE, canonical_layout
from store.format.precision import STORAGE_DTYPES, Precision, dequantize, quantize, relative_error
from store.identity.keys import Block, KeyRoot, root_key, tokens_digest


@dataclass(frozen=True)
class EncodedSnapshot:
    """A snapshot ready to write: its header and its payload, every part laid out as
    :func:`store.format.payload.canonical_layout` says (one ``uint8`` array)."""

    header: SnapshotHeader
    payload: np.ndarray

    def __post_init__(self) -> None:
        nbytes = canonical_layout(self.header).nbytes
        if self.payload.dtype != np.uint8 or self.payload.ndim != 1 or self.payload.nbytes != nbytes:
            raise ValueError(f"payload must be a 1-D uint8 array of the {nbytes} bytes the header lays out, "
                             f"got {self.payload.dtype} {self.payload.shape}")

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        """Each part's bytes in the header's order (views of the payload)."""
        layout = canonical_layout(self.header)
        return tuple(self.payload[off:off + p[3]] for p, off in zip(layout.parts, layout.offsets))

    # Built once per snapshot and reused by every write of it (the local tier sizes it,
    # then writes it; the S3 tier serialises it again): the header JSON alone is ~0.5 ms.
    @cached_property
    def schema(self) -> pa.Schema:
        """The Arrow schema, whose metadata carries the header and its checksum."""
        return _schema(self.header)

    @cached_property
    def batch(self) -> pa.RecordBatch:
        """The payload: one record batch of length 1 with one ``large_binary`` column whose
        one value is the whole payload (viewed, not copied)."""
        offsets = pa.py_buffer(np.array([0, self.payload.nbytes], dtype=np.int64))
        column = pa.Array.from_buffers(PAYLOAD_TYPE, 1, [None, offsets, pa.py_buffer(self.payload)])
        return pa.record_batch([column], schema=self.schema)

    @cached_property
    def pieces(self) -> tuple[bytes | pa.Buffer, ...]:
        """The file, in order, as the pieces Arrow hands a sink: small ``bytes`` of IPC
        framing and zero-copy views of the part buffers. A writer passes them to one
        ``writev`` (:func:`write_pieces`); joined, they are the file's bytes."""
        sink = _Pieces()
        write_snapshot(pa.PythonFile(sink, mode="w"), self)
        return tuple(sink.pieces)  # type: ignore[arg-type]

    @cached_property
    def file_size(self) -> int:
        """Exact size in bytes of the file this snapshot becomes (computed without writing it)."""
        return sum(len(p) for p in self.pieces)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _check_block(root: KeyRoot, block: Block, precision: Precision, tokens: int) -> None:
    if root.kv_dtype != precision.kv_dtype or root.quant_scheme != precision.scheme_id():
        raise ValueError("root was keyed for another precision: build the KeyRoot from this Precision")
    if tokens != root.block_size or len(block.tokens) != root.block_size:
        raise ValueError(f"a snapshot holds exactly one block of {root.block_size} tokens, got {tokens}")


def build_snapshot(
    *,
    root: KeyRoot,
    block: Block,
    tenant: str,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    precision: Precision,
    created_at: float,
    ttl_s: float,
    source: str | None = None,
) -> EncodedSnapshot:
    """Quantise one block's KV and describe it.

    Args:
        root: the key root the block's key was computed from (must match ``precision``).
        block: the block (key, parent, tokens) from :func:`store.identity.keys.block_chain`.
        tenant: tenant name recorded in the header (its salt is in ``root``).
        kv: per layer ``(K, V)``, each ``[kv_heads, block_size, head_dim]`` in the
            model's dtype.
        precision: storage precision; the measured relative error per layer is recorded.
        created_at: unix seconds.
        ttl_s: lifetime in seconds; ``expires_at = created_at + ttl_s``.
        source: where the KV was computed, recorded in the header: ``prefill`` or
            ``write-back`` (:data:`store.format.header.SOURCES`); ``None`` records none
            (read back as ``unknown``).

    Raises:
        ValueError: shapes disagree with each other or with the block, ``root`` was
            keyed for another precision, or ``source`` is not one of the sources.
    """
    if not kv:
        raise ValueError("kv must hold at least one layer")
    heads, tokens, dim = kv[0][0].shape
    _check_block(root, block, precision, tokens)
    stored: list[StoredLayer] = []
    errors: dict[str, list[float]] = {"k_rel_l2": [], "v_rel_l2": []}
    for layer, (k, v) in enumerate(kv):
        pair = []
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != (heads, tokens, dim):
                raise ValueError(f"layer {layer} {name.upper()} has shape {tuple(x.shape)}, expected {(heads, tokens, dim)}")
            q, scale = quantize(x, precision, layer)
            back = dequantize(q, scale, torch.float32, precision.group_tokens)
            errors[f"{name}_rel_l2"].append(relative_error(x, back))
            pair += [q, scale]
        stored.append(StoredLayer(*pair))
    return encode_snapshot(root=root, block=block, tenant=tenant, layers=stored, errors=errors, precision=precision,
                           created_at=created_at, ttl_s=ttl_s, source=source)


@dataclass(frozen=True)
class StoredLayer:
    """One layer of one block as stored: K and V (``[kv_heads, block_size, head_dim]``) and their scales."""

    k: torch.Tensor
    k_scale: torch.Tensor | None
    v: torch.Tensor
    v_scale: torch.Tensor | None


def encode_snapshot(
    *,
    root: KeyRoot,
    block: Block,
    tenant: str,
    layers: Sequence[StoredLayer],
    errors: dict[str, list[float]],
    precision: Precision,
    created_at: float,
    ttl_s: float,
    source: str | None = None,
) -> EncodedSnapshot:
    """Describe one block's already-quantised KV (what :func:`build_snapshot` does after
    quantising; the prefill job quantises a whole batch at once on its device and calls this).

    Args:
        layers: per layer, the stored tensors from :func:`store.format.precision.quantize`.
        errors: ``k_rel_l2`` and ``v_rel_l2``, one relative error per layer.
        source: as for :func:`build_snapshot`.

    Raises:
        ValueError: shapes or dtypes disagree with each other, the block or ``precision``,
            or ``source`` is not one of the sources.
    """
    if not layers:
        raise ValueError("layers must hold at least one layer")
    if source is not None and source not in SOURCES:
        raise ValueError(f"source {source!r} is not allowed; choose one of {', '.join(SOURCES)} (or None)")
    heads, tokens, dim = layers[0].k.shape
    _check_block(root, block, precision, tokens)
    if any(len(errors.get(f"{n}_rel_l2", ())) != len(layers) for n in ("k", "v")):
        raise ValueError("errors needs one k_rel_l2 and one v_rel_l2 value per layer")
    layout = Layout(num_layers=len(layers), num_kv_heads=heads, head_dim=dim, block_size=tokens)
    parts: list[Part] = []
    buffers: list[np.ndarray] = []

    def add(name: str, dtype: str, tensor: torch.Tensor) -> None:
        raw = _bytes_of(tensor)
        parts.append(Part(name, dtype, tuple(tensor.shape), int(raw.nbytes), xxhash.xxh3_64_hexdigest(raw)))
        buffers.append(raw)

    for layer, sl in enumerate(layers):
        dtype = precision.layer_dtype(layer)
        for name, x, scale in (("k", sl.k, sl.k_scale), ("v", sl.v, sl.v_scale)):
            if tuple(x.shape) != (heads, tokens, dim) or x.dtype != STORAGE_DTYPES[dtype]:
                raise ValueError(f"layer {layer} {name.upper()} is {tuple(x.shape)} {x.dtype}; "
                                 f"expected {(heads, tokens, dim)} {STORAGE_DTYPES[dtype]}")
            if (scale is None) != (dtype != "fp8_e4m3"):
                raise ValueError(f"layer {layer} {name.upper()}: scales go with FP8 layers and only with them")
            add(f"{name}.{layer}", dtype, x)
            if scale is not None:
                add(f"{name}_scale.{layer}", "fp32", scale)
    header = SnapshotHeader(
        key=block.key,
        parent_key=block.parent,
        root_key=root_key(root),
        tenant=tenant,
        salt_id=root.salt_id,
        token_ids=tuple(block.tokens),
        tokens_sha256=tokens_digest(block.tokens),
        model_fingerprint=root.model_fingerprint,
        tokenizer_fingerprint=root.tokenizer_fingerprint,
        chat_template_hash=root.chat_template_hash,
        adapter_hash=root.adapter_hash,
        kv_dtype=root.kv_dtype,
        quant_scheme=root.quant_scheme,
        layout=layout,
        precision=precision,
        parts=tuple(parts),
        created_at=float(created_at),
        expires_at=float(created_at) + float(ttl_s),
        quant_error=errors,
        format_version=root.format_version,
        source=source,
    )
    layout = canonical_layout(header)
    payload = np.zeros(layout.nbytes, dtype=np.uint8)  # zero padding between parts
    for raw, off in zip(buffers, layout.offsets):
        payload[off:off + raw.nbytes] = raw
    return EncodedSnapshot(header, payload)


def _schema(header: SnapshotHeader) -> pa.Schema:
    # One column holding the whole payload: opening, framing and writing a file cost the
    # same whatever its layer count (one column per part cost ~10 us a part at each end).
    raw = header.to_json()
    return pa.schema(
        [(PAYLOAD_COLUMN, PAYLOAD_TYPE)],
        metadata={META_HEADER: raw, META_CHECKSUM: SnapshotHeader.checksum(raw).encode()},
    )


def write_snapshot(sink: BinaryIO | pa.NativeFile, snap: EncodedSnapshot) -> None:
    """Write ``snap`` as an Arrow IPC file to an open binary sink (no copy of the payload)."""
    with pa.ipc.new_file(sink, snap.schema) as writer:
        writer.write_batch(snap.batch)


class _Pieces:
    """A write-only file that keeps what it is given (small ``bytes`` of IPC framing, and
    zero-copy ``pa.Buffer`` views of the payload) for one final join."""

    closed = False

    def __init__(self) -> None:
        self.pieces: list[object] = []

    def write(self, data: object) -> int:
        self.pieces.append(data)
        return len(data)  # type: ignore[arg-type]

    def flush(self) -> None:
        pass


def snapshot_bytes(snap: EncodedSnapshot) -> bytes:
    """The file's bytes in memory (for object stores): one allocation and one copy of the
    payload, and ``bytes``, which botocore sends without another copy (not so ``bytearray``)."""
    return b"".join(snap.pieces)  # type: ignore[arg-type]


def write_pieces(fd: int, pieces: Sequence[bytes | pa.Buffer]) -> int:
    """Write ``pieces`` to the file descriptor ``fd`` in order, with as few ``writev``
    calls as the kernel allows (one for a snapshot of up to ~1000 parts; a short write
    resumes where it stopped). Returns the bytes written.

    One system call instead of one per part: 128 part-sized writes through a Python file
    cost 16 MiB snapshots about 1.2 ms more than one ``write`` of the same bytes.
    """
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total, i = 0, 0
    iov_max = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    while i < len(views):
        n = os.writev(fd, views[i:i + iov_max])
        total += n
        while i < len(views) and n >= len(views[i]):  # drop what was written whole
            n -= len(views[i])
            i += 1
        if n:  # a short write inside views[i]: the rest of it next
            views[i] = views[i][n:]
    return total
