"""Whether a snapshot header describes the payload it lays out: layout, precision and parts agree.

A header's checksum proves only that nobody changed it since it was written, not that its
writer told the truth. Readers cut every part from the payload by the header's ``parts``
(name, dtype, shape, byte count), and engines fill their caches by its ``layout``; where the
two disagree, a snapshot with sound checksums and identity would pass every check and raise
later, inside ``dequantized`` or ``copy_into_paged``. :func:`check_geometry` makes the
reader refuse it first: the parts must be exactly the ones :func:`store.format.encode.encode_snapshot`
writes for the header's layout and precision (``k.<l>``, ``v.<l>``, and for FP8 layers
``k_scale.<l>``, ``v_scale.<l>``), each of the layer's storage dtype and shape, and each
part's byte count the product of its shape and its dtype's size. Pure arithmetic on the
header (nothing is allocated from its numbers); the file's size bounds the payload
(:func:`store.format.payload.payload_span`).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from store.errors import SnapshotCorrupt
from store.format.precision import Precision

if TYPE_CHECKING:
    from store.format.header import Layout, SnapshotHeader

_INT, _STR = {int}, {str}
#: bytes per element of each storage dtype a header may name
ITEMSIZE: dict[str, int] = {"fp8_e4m3": 1, "bf16": 2, "fp16": 2, "fp32": 4}


def _count(value: object) -> bool:
    """A positive integer (JSON's ``true`` is not one)."""
    return type(value) is int and value >= 1


def check_precision(precision: Precision, kv_dtype: str, quant_scheme: str, *, location: str = "") -> None:
    """The precision's own fields have the types it needs, and it is the precision that the
    header's ``kv_dtype`` and ``quant_scheme`` (which the key is computed from) name."""
    if type(precision.group_tokens) is not int or any(type(i) is not int for i in precision.keep_layers):
        raise SnapshotCorrupt("precision's group_tokens and keep_layers must be integers", location=location)
    if precision.kv_dtype != kv_dtype or precision.scheme_id() != quant_scheme:
        raise SnapshotCorrupt(f"the header's precision ({precision.scheme_id()}) is not its kv_dtype {kv_dtype!r} "
                              f"and quant_scheme {quant_scheme!r}", location=location)


@functools.lru_cache(maxsize=256)
def expected_parts(layout: Layout, precision: Precision) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Part name -> (storage dtype, shape, byte count) of every part a snapshot of ``layout``
    stored in ``precision`` holds (cached: one entry per geometry and precision in practice).

    Only call it with a layout and precision whose counts :func:`check_geometry` has bounded
    by the header's part count: it makes one entry per part.
    """
    heads, tokens, dim = layout.num_kv_heads, layout.block_size, layout.head_dim
    kv_shape = (heads, tokens, dim)
    if precision.granularity == "head_group":
        scale_shape: tuple[int, ...] = (heads, -(-tokens // precision.group_tokens))
    else:
        scale_shape = (heads,)
    scale = ("fp32", scale_shape, math.prod(scale_shape) * ITEMSIZE["fp32"])
    out: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for layer in range(layout.num_layers):
        dtype = precision.layer_dtype(layer)
        for kv in ("k", "v"):
            out[f"{kv}.{layer}"] = (dtype, kv_shape, math.prod(kv_shape) * ITEMSIZE[dtype])
            if dtype == "fp8_e4m3":
                out[f"{kv}_scale.{layer}"] = scale
    return out


def _fp8_layers(layout: Layout, precision: Precision) -> int:
    if precision.compression != "fp8":
        return 0
    return layout.num_layers - sum(1 for i in precision.keep_layers if i < layout.num_layers)


def check_geometry(header: SnapshotHeader, *, location: str = "") -> None:
    """Refuse (with :class:`SnapshotCorrupt`) a header whose parts are not exactly what its
    layout and precision lay out.

    Checks, in this order, so that nothing is computed from a number before it is bounded:
    the layout's counts are positive integers; the precision is the one the header's
    ``kv_dtype`` and ``quant_scheme`` name; the number of parts is what the layout and
    precision give (so the layer count is bounded by the header's own length); then each part:
    a known name met once, its layer's storage dtype, its shape (``[kv_heads, block_size,
    head_dim]``, scales ``[kv_heads]`` or ``[kv_heads, groups]``, integers), a byte count equal
    to the shape's elements times the dtype's size, and a checksum that is a string.
    """
    layout, precision, parts = header.layout, header.precision, header.parts
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        if not _count(getattr(layout, name)):
            raise SnapshotCorrupt(f"layout.{name} must be a positive integer, got {getattr(layout, name)!r}",
                                  location=location)
    check_precision(precision, header.kv_dtype, header.quant_scheme, location=location)
    want = 2 * layout.num_layers + 2 * _fp8_layers(layout, precision)
    if len(parts) != want:
        raise SnapshotCorrupt(f"the header lists {len(parts)} payload parts; its layout ({layout.num_layers} layers) "
                              f"and precision lay out {want}", location=location)
    # NOTE: the types first, so that the cache below can be keyed on equality: JSON's 2.0 equals
    # 2 (and hashes alike) but is no tensor dimension.
    if ({type(n) for p in parts for n in p[2]} | {type(p[3]) for p in parts}) != _INT or \
            {type(p[4]) for p in parts} != _STR:
        raise SnapshotCorrupt("payload parts' shapes and byte counts must be integers, their checksums strings",
                              location=location)
    # Snapshots of one geometry repeat one part list: checked once, then looked up (~100 us a
    # 32-layer header otherwise, on every open).
    key = (layout, precision, tuple(p[:4] for p in parts))
    if key in _ACCEPTED:
        return
    _check_parts(parts, expected_parts(layout, precision), location)
    if len(_ACCEPTED) < 256:
        _ACCEPTED.add(key)


#: (layout, precision, (name, dtype, shape, nbytes) of each part) that passed :func:`_check_parts`
_ACCEPTED: set[tuple] = set()


def _check_parts(parts: tuple, expected: dict[str, tuple[str, tuple[int, ...], int]], location: str) -> None:
    seen: set[str] = set()
    for p in parts:
        name, dtype, shape, nbytes, _ = p
        exp = expected.get(name) if type(name) is str else None
        if exp is None or name in seen:
            raise SnapshotCorrupt(f"payload part {name!r} is not one this layout lays out, or is listed twice",
                                  location=location)
        seen.add(name)
        if dtype != exp[0] or shape != exp[1]:
            raise SnapshotCorrupt(f"payload part {name} is {dtype} {list(shape)}; the layout says "
                                  f"{exp[0]} {list(exp[1])}", location=location)
        if nbytes != exp[2]:
            raise SnapshotCorrupt(f"payload part {name} says {nbytes!r} bytes; its shape and dtype make {exp[2]}",
                                  location=location)
