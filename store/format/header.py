"""The self-describing header of a snapshot, and the checks a reader makes against it.

The header is canonical JSON (sorted keys, no spaces) stored in the Arrow schema
metadata, with its own xxh3 checksum next to it. It records everything needed to
trust and use the payload without asking anyone: identity (key, parent, tokens,
tenant salt id), the model it came from, layout, precision and scales' places,
lifetimes, measured quantisation error, and a checksum per payload part.
"""
from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

import xxhash

from store.errors import SnapshotCorrupt, SnapshotMismatch, UnknownFormatVersion
from store.format.geometry import check_geometry
from store.format.precision import Precision
from store.identity.keys import FORMAT_VERSION, Block, KeyRoot, chain_key, root_key, tokens_digest

FORMAT_NAME = "kvwarm-kv-snapshot"
#: Where a snapshot's KV was computed (the optional header field ``source``): the prefill job
#: (transformers), or a serving engine whose KV the connector wrote back.
PREFILL, WRITE_BACK = "prefill", "write-back"
SOURCES: tuple[str, ...] = (PREFILL, WRITE_BACK)
#: What :attr:`SnapshotHeader.origin` says of a snapshot written before headers recorded a source.
UNKNOWN_SOURCE = "unknown"

try:  # a faster parser of the same JSON where installed (~3x); the stdlib's otherwise
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = None


def _loads(raw: bytes) -> Any:
    # orjson takes a scratch buffer of several times a long document: a genuine header is a few KiB,
    # and a long one (a hostile one) goes to the stdlib, whose objects cost about twice the text.
    if _fast_loads is not None and len(raw) <= 1 << 16:
        try:
            return _fast_loads(raw)
        except ValueError:
            pass  # e.g. NaN in quant_error, which json writes and orjson refuses: the stdlib decides
    return json.loads(raw)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass instance as a shallow dict of its fields (``json.dumps`` default hook)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")
    return {name: getattr(obj, name) for name in _field_names(type(obj))}


@dataclass(frozen=True)
class Layout:
    """Geometry of the KV in a snapshot (one block: ``block_size`` tokens, every layer)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")


class Part(NamedTuple):
    """One contiguous array in the payload (a layer's K or V, or their scales).

    A named tuple, not a dataclass: a header has one Part per layer and K/V and scales
    (128 for a 32-layer model), and a reader builds them all on every open.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    xxh3: str


_PART_FIELDS = operator.itemgetter(*Part._fields)


def _parts(items: list[Any]) -> tuple[Part, ...]:
    """The header's part list (JSON objects with exactly Part's keys) as Parts.

    Raises:
        TypeError: an item is not such an object (the caller calls the header corrupt).
    """
    new = tuple.__new__
    try:
        out = tuple(new(Part, (name, dtype, tuple(shape), nbytes, xxh3))
                    for name, dtype, shape, nbytes, xxh3 in map(_PART_FIELDS, items))
    except (KeyError, IndexError) as exc:
        raise TypeError(f"a payload part lacks {exc}") from None
    if any(type(p) is not dict or len(p) != len(Part._fields) for p in items):
        raise TypeError(f"a payload part is not an object with exactly the keys {', '.join(Part._fields)}")
    return out


_STRING_FIELDS = ("key", "parent_key", "root_key", "tenant", "salt_id", "tokens_sha256", "model_fingerprint",
                  "tokenizer_fingerprint", "chat_template_hash", "adapter_hash", "kv_dtype", "quant_scheme")
_MAX_TOKEN = (1 << 32) - 1
_INT_ONLY = {int}  # ``bool`` is an ``int`` to isinstance, not to ``type(t) is int``
_MAX_STRING = 512  # a writer's longest is a hub id with its commit (`org/name@<40 hex>`), well under this
#: The largest header a reader parses: the fixed fields, a block's token ids (65,536 at most, up to 11
#: characters each) and a few hundred bytes a layer for parts and errors, with room to spare.
MAX_HEADER_BYTES = 1 << 20


def _real(value: object) -> bool:
    """A JSON number (``true`` is not one)."""
    return type(value) is float or type(value) is int


def _check_fields(h: "SnapshotHeader") -> None:
    """Each field read from JSON has the type readers use it as, and times are finite.

    Raises:
        TypeError, ValueError: one does not (the caller calls the header corrupt).
    """
    for name in _STRING_FIELDS:
        if type(getattr(h, name)) is not str or len(getattr(h, name)) > _MAX_STRING:
            raise TypeError(f"{name} must be a string of at most {_MAX_STRING} characters")
    if len(h.token_ids) > h.layout.block_size:
        raise ValueError(f"{len(h.token_ids)} token_ids, more than the layout's block_size {h.layout.block_size}")
    ids = h.token_ids  # at C speed: a header's every token is checked on every open
    if ids and (set(map(type, ids)) != _INT_ONLY or min(ids) < 0 or max(ids) > _MAX_TOKEN):
        raise ValueError("token_ids must be integers in [0, 2**32)")
    for name in ("created_at", "expires_at"):
        value = getattr(h, name)
        if not _real(value) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of unix seconds, got {value!r}")
    if type(h.quant_error) is not dict or any(
            type(k) is not str or type(v) is not list or not all(_real(x) for x in v) for k, v in h.quant_error.items()):
        raise TypeError("quant_error must map names to lists of numbers")


@dataclass(frozen=True)
class SnapshotHeader:
    """Everything a reader needs to trust and use a snapshot; see ``docs/reference/format.md``."""

    key: str
    parent_key: str
    root_key: str
    tenant: str
    salt_id: str
    token_ids: tuple[int, ...]
    tokens_sha256: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    chat_template_hash: str
    adapter_hash: str
    kv_dtype: str
    quant_scheme: str
    layout: Layout
    precision: Precision
    parts: tuple[Part, ...]
    created_at: float
    expires_at: float
    quant_error: dict[str, list[float]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    format: str = FORMAT_NAME
    # NOTE: optional, and absent from the JSON when None, so that it needed no new format
    # version: files written before it read as before (source None), and a header without
    # it is byte for byte what those versions wrote.
    source: str | None = None

    def __post_init__(self) -> None:
        if self.source is not None and not isinstance(self.source, str):
            raise TypeError(f"source must be a string, got {type(self.source).__name__}")

    @property
    def origin(self) -> str:
        """Where the KV was computed: ``prefill``, ``write-back``, or ``unknown`` (written before
        headers recorded it)."""
        return UNKNOWN_SOURCE if self.source is None else self.source

    # -- codec ---------------------------------------------------------------
    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys, compact)."""
        # The same bytes as json.dumps(asdict(self)), without asdict's deep copy of every
        # value (token ids, parts: ~2-3 ms a header) and without a default hook, which the
        # C encoder calls back into Python for each of the ~100 parts (~1 ms): the nested
        # dataclasses become shallow dicts here, and the encoder walks the rest itself.
        d = _fields_of(self)
        d["layout"] = _fields_of(self.layout)
        d["precision"] = _fields_of(self.precision)
        d["parts"] = [p._asdict() for p in self.parts]
        if d["source"] is None:
            del d["source"]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @staticmethod
    def from_json(raw: bytes, *, location: str = "") -> "SnapshotHeader":
        """Parse header bytes; raises :class:`UnknownFormatVersion` or :class:`SnapshotCorrupt`."""
        if len(raw) > MAX_HEADER_BYTES:  # refused unparsed: what a header holds is bounded by its block
            raise SnapshotCorrupt(f"header of {len(raw)} bytes, more than the {MAX_HEADER_BYTES} a snapshot's "
                                  "header can hold", location=location)
        try:
            d: dict[str, Any] = _loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SnapshotCorrupt(f"header is not valid JSON: {exc}", location=location) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise SnapshotCorrupt("not a kvwarm snapshot header", location=location)
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise UnknownFormatVersion(
                f"snapshot format version {version!r} is not supported by this reader "
                f"(it reads version {FORMAT_VERSION}); upgrade kvwarm or re-prefill",
                location=location,
            )
        try:
            d["layout"] = Layout(**d["layout"])
            prec = dict(d["precision"])
            prec["keep_layers"] = tuple(prec["keep_layers"])
            d["precision"] = Precision(**prec)
            d["parts"] = _parts(d["parts"])
            d["token_ids"] = tuple(d["token_ids"])
            header = SnapshotHeader(**d)
            _check_fields(header)
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotCorrupt(f"header fields are invalid: {exc}", location=location) from None
        check_geometry(header, location=location)
        return header

    @staticmethod
    def checksum(raw: bytes) -> str:
        """Checksum stored beside the header bytes."""
        return xxhash.xxh3_64_hexdigest(raw)

    # -- checks --------------------------------------------------------------
    def check_consistent(self, *, location: str = "") -> None:
        """Self-consistency: the key really is the hash of (parent, tokens).

        This catches a snapshot copied or renamed under another key even before any
        request names it.
        """
        if chain_key(self.parent_key, self.token_ids) != self.key:  # type: ignore[arg-type]
            raise SnapshotMismatch("header key is not the hash of its parent and tokens", location=location)
        if tokens_digest(self.token_ids) != self.tokens_sha256:
            raise SnapshotCorrupt("token digest does not match token ids", location=location)
        if len(self.token_ids) != self.layout.block_size:
            raise SnapshotCorrupt("token count differs from block size", location=location)

    def check_matches(self, block: Block, root: KeyRoot, *, location: str = "") -> None:
        """Refuse (with :class:`SnapshotMismatch`) unless this is exactly the asked block.

        Compares the stored token ids with the request's, so a hash collision can never
        serve KV computed for different tokens.
        """
        self.check_identity(block.key, root, location=location)
        if self.parent_key != block.parent:
            raise SnapshotMismatch(f"parent_key is {self.parent_key!r}, asked for {block.parent!r}", location=location)
        if self.token_ids != tuple(block.tokens):
            raise SnapshotMismatch("stored token ids differ from the request's (hash collision?)", location=location)

    def check_identity(self, key: str, root: KeyRoot, *, location: str = "") -> None:
        """Refuse (with :class:`SnapshotMismatch`) unless this is block ``key`` under ``root``
        (its key, model, tokenizer, salt, precision, format and block size), without its
        tokens: a copy by key (a node warming from the fleet's memory) checks this, and the
        lookup that later maps the block checks the tokens (:meth:`check_matches`)."""
        expected = {
            "key": key,
            "root_key": root_key(root),
            "salt_id": root.salt_id,
            "model_fingerprint": root.model_fingerprint,
            "tokenizer_fingerprint": root.tokenizer_fingerprint,
            "chat_template_hash": root.chat_template_hash,
            "adapter_hash": root.adapter_hash,
            "kv_dtype": root.kv_dtype,
            "quant_scheme": root.quant_scheme,
            "format_version": root.format_version,
        }
        for name, want in expected.items():
            have = getattr(self, name)
            if have != want:
                raise SnapshotMismatch(f"{name} is {have!r}, asked for {want!r}", location=location)
        if self.layout.block_size != root.block_size:
            raise SnapshotMismatch(
                f"block_size is {self.layout.block_size}, asked for {root.block_size}", location=location
            )

    def expired(self, now: float) -> bool:
        """True when ``now`` is at or past ``expires_at``: an expired snapshot is a miss."""
        return now >= self.expires_at

    @property
    def payload_nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
