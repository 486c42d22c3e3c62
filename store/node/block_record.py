"""A write-back block as a ring record: how an engine writes one, and how the node reads it back.

One record per kvwarm block, four parts and the fixed :class:`~store.node.ring_record.RecordMeta`:

- part 0: the block's token ids (``uint32``, little-endian), which its snapshot's header holds;
- part 1: every layer's stored K then V bytes, layer after layer (FP8, or the kept dtype);
- part 2: every layer's fp32 K then V scales (FP8 layers only; empty when none);
- part 3: the measured errors, float64: every layer's K error, then every layer's V error (the
  header records them as the engine measured them; the meta's float32 ``errors`` would round them).

The meta names the block (namespace, key, parent key), says which of the engine's chains it is in
(``chain``: 0 plain, 1 chat-keyed), when it was made, and
``precision_id`` (:func:`precision_id`), which the node checks against the precision the engine
announced. The shapes come from that announcement (:class:`Announcement`): nothing is parsed.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from store.format.encode import StoredLayer
from store.format.precision import STORAGE_DTYPES, Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import Block
from store.node.ring_record import Record, RecordMeta
from store.node.ring_writer import RingWriter


def precision_id(precision: Precision) -> int:
    """A record's 32-bit precision check: CRC32 of the precision's scheme and dtype."""
    return zlib.crc32(f"{precision.kv_dtype}|{precision.scheme_id()}".encode())


@dataclass(frozen=True)
class Announcement:
    """What an engine tells the node about its ring (the ``ATTACH`` op's body, JSON).

    Attributes:
        ring: the ring's file.
        identities: the model's plain and chat-keyed identities (``None``: no chat template).
        precision: the storage precision its blocks are quantised at.
        kv_block: tokens per block.
        ttl_s: the snapshots' lifetime.
        kv_heads, head_dim: a layer's KV shape.
        layers: layers per block.
        pid: the engine process.
        tenants: the tenants the engine serves (their blocks' uploads are the node's).
    """

    ring: str
    identities: tuple[ModelIdentity, ModelIdentity | None]
    precision: Precision
    kv_block: int
    ttl_s: float
    kv_heads: int
    head_dim: int
    layers: int
    pid: int
    tenants: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """As the ``ATTACH`` body."""
        plain, chat = self.identities
        return json.dumps({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                           "identities": [dataclasses.asdict(plain), None if chat is None else dataclasses.asdict(chat)],
                           "precision": dataclasses.asdict(self.precision)}).encode()

    @classmethod
    def decode(cls, body: bytes) -> Announcement:
        """:meth:`encode`'s inverse.

        Raises:
            ValueError: not an announcement (a field missing or of another type).
        """
        try:
            d: dict[str, Any] = json.loads(body.decode())
            plain, chat = d["identities"]
            p = dict(d["precision"])
            p["keep_layers"] = tuple(p.get("keep_layers", ()))
            out = cls(ring=str(d["ring"]), identities=(ModelIdentity(**plain), None if chat is None else ModelIdentity(**chat)),
                      precision=Precision(**p), kv_block=int(d["kv_block"]), ttl_s=float(d["ttl_s"]),
                      kv_heads=int(d["kv_heads"]), head_dim=int(d["head_dim"]), layers=int(d["layers"]),
                      pid=int(d["pid"]), tenants=tuple(str(t) for t in d.get("tenants", ())))
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a ring announcement: {exc}") from None
        if min(out.kv_block, out.kv_heads, out.head_dim, out.layers) < 1:
            raise ValueError("a ring announcement's shapes must be positive")
        return out

    def shapes(self) -> list[tuple[torch.dtype, int, tuple[int, ...] | None]]:
        """Per layer: its storage dtype, its K (or V) bytes and its scales' shape (``None``: unquantised)."""
        p = self.precision
        out = []
        for layer in range(self.layers):
            name = p.layer_dtype(layer)
            dtype = STORAGE_DTYPES[name]
            nbytes = self.kv_heads * self.kv_block * self.head_dim * dtype.itemsize
            scale = None
            if name == "fp8_e4m3":
                scale = (self.kv_heads,) if p.granularity == "head" else (self.kv_heads, -(-self.kv_block // p.group_tokens))
            out.append((dtype, nbytes, scale))
        return out

    def part_nbytes(self) -> tuple[int, int, int, int]:
        """A record's four part sizes."""
        shapes = self.shapes()
        return (4 * self.kv_block, sum(2 * n for _, n, _ in shapes),
                sum(2 * 4 * int(np.prod(s)) for _, _, s in shapes if s is not None), 2 * 8 * self.layers)


def _raw(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a flat uint8 array (no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def write_block(writer: RingWriter, sizes: tuple[int, ...], meta: RecordMeta, tokens: Sequence[int],
                layers: Sequence[StoredLayer], k_errors: Sequence[float], v_errors: Sequence[float]) -> bool:
    """Reserve, fill and commit one block's record (one copy per stored tensor); ``False`` at once
    when the ring has no room (the caller counts the drop)."""
    slot = writer.reserve(*sizes)
    if slot is None:
        return False
    try:
        slot.write(0, np.asarray(tokens, dtype="<u4"))
        off = soff = 0
        for sl in layers:
            for x, s in ((sl.k, sl.k_scale), (sl.v, sl.v_scale)):
                raw = _raw(x)
                slot.write(1, raw, off)
                off += raw.nbytes
                if s is not None:
                    raw = _raw(s)
                    slot.write(2, raw, soff)
                    soff += raw.nbytes
        slot.write(3, np.asarray([*k_errors, *v_errors], dtype="<f8"))
    except BaseException:
        slot.abandon()
        raise
    slot.commit(meta)
    return True


def block_meta(namespace: str, block: Block, *, chain: int, precision: Precision, now: float,
               layers: int) -> RecordMeta:
    """The meta of one block's record, made at ``now`` (wall clock, seconds)."""
    return RecordMeta(namespace=namespace, key=block.key, parent_key=block.parent, token_count=len(block.tokens),
                      layer_count=layers, precision_id=precision_id(precision), chain=chain,
                      created_ns=round(now * 1e9))


def read_block(record: Record, ann: Announcement) -> tuple[tuple[int, ...], list[StoredLayer], list[float], list[float]]:
    """A record's token ids, layers and K and V errors, copied out of the ring (the record may be
    released after).

    Raises:
        ValueError: its parts do not have the sizes the announcement gives.
    """
    sizes = ann.part_nbytes()
    got = tuple(p.nbytes for p in record.parts)
    if got != sizes:
        raise ValueError(f"a record of parts {got} bytes; the engine announced {sizes}")
    tokens = tuple(record.array(0, "<u4").tolist())
    data = torch.frombuffer(bytearray(record.parts[1]), dtype=torch.uint8) if sizes[1] else torch.empty(0, dtype=torch.uint8)
    scales = torch.frombuffer(bytearray(record.parts[2]), dtype=torch.uint8) if sizes[2] else None
    shape = (ann.kv_heads, ann.kv_block, ann.head_dim)
    layers, off, soff = [], 0, 0
    for dtype, n, sshape in ann.shapes():
        kv, sc = [], []
        for _ in range(2):
            kv.append(data[off:off + n].view(dtype).view(shape))
            off += n
            if sshape is not None:
                assert scales is not None
                m = 4 * int(np.prod(sshape))
                sc.append(scales[soff:soff + m].view(torch.float32).view(sshape))
                soff += m
        layers.append(StoredLayer(kv[0], sc[0] if sc else None, kv[1], sc[1] if sc else None))
    errors = record.array(3, "<f8").tolist()
    return tokens, layers, errors[:ann.layers], errors[ann.layers:]
