"""The node's wire protocol: length-prefixed binary frames over a local Unix socket.

Every message is one frame, ``<u32 length><u8 op><body>`` (little-endian; ``length`` counts the
op byte and the body). A client sends a request and reads exactly one reply; the reply's op is
the request's, or :data:`Op.ERROR` (its body a UTF-8 message) or :data:`Op.REFUSED` (a hello the
node will not take). Only the hello and the stats are JSON; the hot path is fixed-width:

- ``HELLO``: body :meth:`store.node.handshake.Handshake.encode`; reply JSON ``{"pid", "version",
  "node_tier", "metrics_port"}``.
- ``LOOKUP``: body :func:`encode_keys` (a namespace and block keys as 32 raw bytes each); reply
  :func:`encode_paths`: how many leading keys the node tier holds, and their files to map.
- ``PREFETCH``: body :func:`encode_keys`; the node copies the chain from S3 into its tier in the
  background. Reply ``<u32 queued>``.
- ``PENDING``: body :func:`encode_keys`; reply ``<u32>``: how many of those keys the node's copies
  still have queued or in progress (0: the node tier holds all it will of them, for now).
- ``RECORD``: body :func:`encode_keys`; the blocks a request used, for fleet memory. Empty reply.
- ``STATS``: empty body; reply JSON of the node's counters.
- ``ATTACH``: body JSON :class:`store.node.block_record.Announcement` (an engine's write-back ring);
  the node attaches the ring's reader and stores what it carries. Reply JSON ``{"refused": [...]}``:
  the configured tenants whose secrets the node lacks (the engine writes their blocks itself).
"""
from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

from store.errors import OperationalError
from store.identity.tenant import check_tenant_name

#: the largest frame either side accepts (a lookup of 64k keys is 2 MiB)
MAX_FRAME = 16 << 20
#: the most keys one request names
MAX_KEYS = 1 << 16
_HEAD = struct.Struct("<IB")
_NS = struct.Struct("<HI")  # namespace length, key count
_COUNT = struct.Struct("<I")
_PATH = struct.Struct("<H")


class Op(enum.IntEnum):
    """A frame's kind."""

    HELLO = 1
    LOOKUP = 2
    PREFETCH = 3
    RECORD = 4
    STATS = 5
    ATTACH = 6
    PENDING = 7
    ERROR = 0xFE
    REFUSED = 0xFF


class ProtocolError(OperationalError, ValueError):
    """A frame that is not the protocol's (too long, truncated, an unknown op, bad fields)."""


@dataclass(frozen=True)
class Keys:
    """A request's namespace and its block keys (64 hex digits each), in chain order."""

    namespace: str
    keys: tuple[str, ...]


def send_frame(sock: socket.socket, op: Op, body: bytes = b"") -> None:
    """Write one frame (one ``sendall``)."""
    sock.sendall(_HEAD.pack(len(body) + 1, op) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the peer closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """Read one frame: ``(op, body)``.

    Raises:
        ConnectionResetError: the peer closed the connection (also mid-frame).
        ProtocolError: a frame longer than :data:`MAX_FRAME` or empty.
    """
    length, op = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if not 1 <= length <= MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes: frames hold 1 to {MAX_FRAME} bytes")
    return op, _recv_exact(sock, length - 1) if length > 1 else b""


def encode_keys(namespace: str, keys: "list[str] | tuple[str, ...]") -> bytes:
    """A namespace and its block keys as a request body.

    Raises:
        ValueError: a bad namespace, a key that is not 64 hex digits, or more than :data:`MAX_KEYS`.
    """
    ns = check_tenant_name(namespace).encode()
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request: at most {MAX_KEYS}")
    try:
        raw = b"".join(bytes.fromhex(k) for k in keys)
    except ValueError:
        raise ValueError("a block key is 64 hex digits") from None
    if len(raw) != 32 * len(keys):
        raise ValueError("a block key is 64 hex digits")
    return _NS.pack(len(ns), len(keys)) + ns + raw


def decode_keys(body: bytes) -> Keys:
    """:func:`encode_keys`'s inverse.

    Raises:
        ProtocolError: a truncated body or a bad namespace.
    """
    if len(body) < _NS.size:
        raise ProtocolError("a keys body is truncated")
    n_ns, n = _NS.unpack_from(body)
    start = _NS.size + n_ns
    if n > MAX_KEYS or len(body) != start + 32 * n:
        raise ProtocolError(f"a keys body of {len(body)} bytes does not hold {n} keys")
    try:
        ns = check_tenant_name(body[_NS.size:start].decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"bad namespace: {exc}") from None
    raw = body[start:]
    return Keys(ns, tuple(raw[i:i + 32].hex() for i in range(0, len(raw), 32)))


def encode_paths(paths: "list[str]") -> bytes:
    """A lookup's reply: the files of the leading keys the node tier holds (their count is their number)."""
    out = [_COUNT.pack(len(paths))]
    for p in paths:
        b = p.encode()
        out.append(_PATH.pack(len(b)) + b)
    return b"".join(out)


def decode_paths(body: bytes) -> list[str]:
    """:func:`encode_paths`'s inverse.

    Raises:
        ProtocolError: a truncated reply.
    """
    try:
        (n,) = _COUNT.unpack_from(body)
        off, out = _COUNT.size, []
        for _ in range(n):
            (k,) = _PATH.unpack_from(body, off)
            off += _PATH.size
            if off + k > len(body):
                raise ProtocolError("a lookup reply is truncated")
            out.append(body[off:off + k].decode())
            off += k
    except struct.error:
        raise ProtocolError("a lookup reply is truncated") from None
    return out


def encode_count(n: int) -> bytes:
    """A count as a reply body."""
    return _COUNT.pack(n)


def decode_count(body: bytes) -> int:
    """:func:`encode_count`'s inverse."""
    if len(body) != _COUNT.size:
        raise ProtocolError("a count reply is not 4 bytes")
    return _COUNT.unpack(body)[0]
