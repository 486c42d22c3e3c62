"""Where everything lies in a write-back ring's file: the header, the slot table and the arena.

A ring file is three regions, each starting on a page::

    [ header: 4 KiB ][ slot table: slot_count x 2 KiB descriptors ][ arena: arena_bytes ]

The header's words are grouped by their one writer, each group on a cache line of its own
(no false sharing between the engine's thread and the node's):

- fixed at creation: magic, format version, region sizes, flags (``verify``);
- the producer's: its generation (bumped by each producer that opens the ring), pid, the next
  sequence number to reserve (``head_seq``) and the arena position after its last reservation;
- the consumer's: its pid, the first sequence number not yet released (``tail_seq``) and the
  arena position up to which every byte is released (``read_pos``).

Arena positions and sequence numbers only grow (64-bit, they never wrap in practice); a slot is
``seq % slot_count`` and a byte is ``pos % arena_bytes``. A descriptor's words are written by the
producer only, and its ``commit`` word last of all (see :mod:`store.node.ring`).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from store.errors import ConfigError

MAGIC = b"KVWRING\x00"
#: Bump on any change to the header, the descriptor or the arena's rules: a reader of another
#: version refuses the ring (``RingFormatMismatch``) instead of misreading it.
FORMAT_VERSION = 2
PAGE = mmap.PAGESIZE
HEADER_BYTES = 4096
DESCRIPTOR_BYTES = 2048
#: arena positions (record starts and part starts) are multiples of this: cache-line aligned
ALIGN = 64
MAX_PARTS = 8
NAMESPACE_BYTES = 64
KEY_BYTES = 192
MAX_ERRORS = 336

#: header flag: the producer writes a CRC32 of each record's parts and the consumer checks it
#: before handing the record out (the seqlock-style check for weakly ordered CPUs; see ring.py)
FLAG_VERIFY = 1

HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "flags", "slot_count", "descriptor_bytes", "arena_bytes", "arena_offset",
              "table_offset", "created_ns",
              "generation", "producer_pid", "head_seq", "write_pos",
              "consumer_pid", "tail_seq", "read_pos"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8",
                "<u8", "<u8", "<u8", "<u8",
                "<u8", "<u8", "<u8"],
    # creation constants on line 0, the producer's words on line 2, the consumer's on line 3
    "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 48,
                128, 136, 144, 152,
                192, 200, 208],
    "itemsize": HEADER_BYTES,
})

#: descriptor flag: the producer gave the slot up (``Slot.abandon``); the consumer skips it
SLOT_ABANDONED = 1

DESCRIPTOR_DTYPE = np.dtype({
    "names": ["commit", "reserve", "generation", "start", "end", "nparts", "nerrors", "token_count",
              "layer_count", "precision_id", "check", "flags", "chain", "part_len", "part_off", "created_ns",
              "namespace", "key", "parent_key", "errors"],
    "formats": ["<u8", "<u8", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4",
                "<u4", "<u4", "<u4", "<u4", "<u4", ("<u8", (MAX_PARTS,)), ("<u8", (MAX_PARTS,)), "<u8",
                f"S{NAMESPACE_BYTES}", f"S{KEY_BYTES}", f"S{KEY_BYTES}", ("<f4", (MAX_ERRORS,))],
    "offsets": [0, 8, 16, 24, 32, 40, 44, 48,
                52, 56, 60, 64, 68, 72, 136, 200,
                256, 320, 512, 704],
    "itemsize": DESCRIPTOR_BYTES,
})
assert 704 + 4 * MAX_ERRORS <= DESCRIPTOR_BYTES


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RingLayout:
    """The sizes of a ring's regions and where each starts in the file.

    Attributes:
        arena_bytes: bytes of record data the ring holds at once (a multiple of 64).
        slot_count: records the ring holds at once (each needs one descriptor).
    """

    arena_bytes: int
    slot_count: int

    def __post_init__(self) -> None:
        if self.arena_bytes < ALIGN or self.arena_bytes % ALIGN:
            raise ConfigError(f"a ring's arena_bytes must be a positive multiple of {ALIGN}; got {self.arena_bytes}")
        if not 1 <= self.slot_count <= 1 << 20:
            raise ConfigError(f"a ring's slot_count must be between 1 and {1 << 20}; got {self.slot_count}")

    @classmethod
    def for_capacity(cls, nbytes: int, slot_count: int) -> RingLayout:
        """The layout whose arena holds ``nbytes`` (rounded up to 64)."""
        return cls(arena_bytes=_round_up(max(int(nbytes), ALIGN), ALIGN), slot_count=int(slot_count))

    @property
    def table_offset(self) -> int:
        return HEADER_BYTES

    @property
    def arena_offset(self) -> int:
        return _round_up(HEADER_BYTES + self.slot_count * DESCRIPTOR_BYTES, PAGE)

    @property
    def file_bytes(self) -> int:
        return _round_up(self.arena_offset + self.arena_bytes, PAGE)


def record_extent(part_nbytes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Each part's offset within a record (64-byte aligned), and the record's aligned size."""
    offsets = []
    at = 0
    for n in part_nbytes:
        offsets.append(at)
        at += _round_up(n, ALIGN)
    return tuple(offsets), max(at, ALIGN)
