"""What crosses the write-back ring: one record's metadata, a slot being written, a record read.

A record is up to eight byte *parts* (for a write-back block: the FP8 K/V bytes and the fp32
scales) and one fixed-size :class:`RecordMeta` kept in the slot's descriptor, so the consumer
learns what a block is without parsing anything.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from store.node.ring_errors import RecordTooLarge
from store.node.ring_layout import KEY_BYTES, MAX_ERRORS, NAMESPACE_BYTES

if TYPE_CHECKING:
    from store.node.ring import RingWriter

_U32 = 1 << 32


def _encoded(name: str, value: str, cap: int) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > cap:
        raise RecordTooLarge(f"{name} is {len(raw)} bytes in UTF-8; a ring record holds at most {cap}")
    if b"\x00" in raw:
        raise RecordTooLarge(f"{name} {value!r} holds a NUL character, which a ring record cannot carry")
    return raw


@dataclass(frozen=True)
class RecordMeta:
    """What a write-back record is: the fixed fields the node needs to store it.

    Attributes:
        namespace: the tenant's namespace (salt id) the block belongs to, <= 64 UTF-8 bytes.
        key: the block key (or the object name), <= 192 bytes.
        parent_key: the parent block's key ("" for a root block), <= 192 bytes.
        token_count: tokens the block covers.
        layer_count: layers its KV covers.
        precision_id: the storage precision's id (the node maps it to a ``Precision``).
        errors: measured quantisation errors (e.g. K and V relative L2 per layer), <= 336 values,
            kept as float32.
        chain: which of the producer's key chains the block extends (write-back: 0 plain, 1 chat-keyed).
        created_ns: when the producer made the block (wall clock, ns; 0: not said).
    """

    namespace: str
    key: str
    parent_key: str = ""
    token_count: int = 0
    layer_count: int = 0
    precision_id: int = 0
    errors: tuple[float, ...] = ()
    chain: int = 0
    created_ns: int = 0

    def __post_init__(self) -> None:
        _encoded("namespace", self.namespace, NAMESPACE_BYTES)
        _encoded("key", self.key, KEY_BYTES)
        _encoded("parent_key", self.parent_key, KEY_BYTES)
        if type(self.created_ns) is not int or not 0 <= self.created_ns < 1 << 64:
            raise ValueError(f"created_ns must be an int in [0, 2**64); got {self.created_ns!r}")
        for name in ("token_count", "layer_count", "precision_id", "chain"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < _U32:
                raise ValueError(f"{name} must be an int in [0, 2**32); got {v!r}")
        if len(self.errors) > MAX_ERRORS:
            raise RecordTooLarge(f"{len(self.errors)} error values; a ring record holds at most {MAX_ERRORS}")
        # float32, as the descriptor holds them: a record read back equals the one written
        object.__setattr__(self, "errors", tuple(np.asarray(self.errors, dtype=np.float32).tolist()))


def parts_crc(parts: tuple[Any, ...]) -> int:
    """CRC32 over a record's parts in order (the ``verify`` flag's check)."""
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc


def _as_bytes(data: Any) -> np.ndarray:
    """A flat uint8 view of a buffer (numpy array, bytes, memoryview, ``tensor.numpy()``), no copy."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("Slot.write takes a C-contiguous array: gather it into one first, or write into "
                             "Slot.part(i) viewed with its dtype and shape")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


class Slot:
    """Space reserved in the ring for one record, written by the producer and then committed.

    The consumer sees nothing of it until :meth:`commit`. Each part is a writable uint8 view
    into the ring (:meth:`part`); fill it with one copy per part (:meth:`write`) or by writing
    into the view directly (a gather's ``out=``). A slot must end in :meth:`commit` or
    :meth:`abandon`: the consumer hands records out in order and waits at an open slot.
    """

    __slots__ = ("_open", "_parts", "_writer", "index", "seq")

    def __init__(self, writer: RingWriter, seq: int, index: int, parts: tuple[np.ndarray, ...]) -> None:
        self._writer = writer
        self.seq = seq
        self.index = index
        self._parts = parts
        self._open = True

    @property
    def part_nbytes(self) -> tuple[int, ...]:
        return tuple(p.nbytes for p in self._parts)

    def part(self, i: int) -> np.ndarray:
        """Part ``i`` as a writable uint8 view into the ring (valid until commit or abandon)."""
        self._check_open()
        return self._parts[i]

    def write(self, i: int, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (any C-contiguous buffer) into part ``i`` at byte ``offset``: one memcpy.

        Raises:
            ValueError: the bytes do not fit the part at that offset.
        """
        self._check_open()
        src = _as_bytes(data)
        dst = self._parts[i]
        if offset < 0 or offset + src.nbytes > dst.nbytes:
            raise ValueError(f"{src.nbytes} bytes at offset {offset} do not fit part {i} of {dst.nbytes} bytes")
        np.copyto(dst[offset:offset + src.nbytes], src)

    def commit(self, meta: RecordMeta) -> None:
        """Publish the record: after this the consumer may see it, whole (and the views are stale)."""
        self._check_open()
        self._open = False
        self._writer._publish(self, meta, abandoned=False)

    def abandon(self) -> None:
        """Give the slot up: the consumer skips it and its space is reclaimed (counted, not read)."""
        self._check_open()
        self._open = False
        self._writer._publish(self, None, abandoned=True)

    def _check_open(self) -> None:
        if not self._open:
            raise ValueError(f"slot {self.seq} was already committed or abandoned; reserve a new one")


@dataclass(frozen=True)
class Record:
    """A committed record as the consumer sees it.

    ``parts`` are read-only memoryviews into the ring: valid until the record is released
    (the producer may then overwrite those bytes), so copy or store them before release.
    """

    seq: int
    meta: RecordMeta
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def array(self, i: int, dtype: Any = np.uint8) -> np.ndarray:
        """Part ``i`` as a read-only numpy array of ``dtype`` (no copy; valid until release)."""
        return np.frombuffer(self.parts[i], dtype=dtype)
