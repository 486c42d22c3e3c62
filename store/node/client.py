"""A client of the node process: what an engine (or a ``KVLoader``) keeps in its own process.

    client = NodeClient(config)         # the socket from node.socket, else the default
    client.connect()                    # at start-up: starts a node when none answers (node.autostart)
    hit = client.lookup("acme", keys)   # one local round trip: hit.count leading keys held, hit.paths to map

A request is one frame out and one frame back on a connected Unix socket: no JSON, SQLite,
checksum or file I/O on the caller's thread. When the node goes away (killed, restarted) a
request raises :class:`store.errors.NodeUnavailable` at once, which the caller serves as a miss,
and the client reconnects on a thread of its own (starting a new node when ``autostart``),
so that the serving path never waits for a node to start. A node of another kvwarm version or
store configuration raises :class:`store.errors.NodeRefused`, naming what differs.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from store.config import KvwarmConfig
from store.errors import NodeRefused, NodeUnavailable
from store.node.handshake import Handshake, socket_path
from store.node.protocol import (
    Op,
    ProtocolError,
    decode_count,
    decode_paths,
    encode_keys,
    recv_frame,
    send_frame,
)
from store.node.spawn import start_node

if TYPE_CHECKING:
    from store.node.block_record import Announcement

log = logging.getLogger("kvwarm.node")


@dataclass(frozen=True)
class NodeLookup:
    """A lookup's answer: the node tier holds the first ``count`` keys asked, in the files ``paths``."""

    count: int
    paths: tuple[str, ...]


class NodeClient:
    """A connection to the machine's node process (thread-safe: one request at a time).

    Args:
        config: this process's configuration (its store settings must be the node's).
        store_url: overrides ``store.url`` (as ``--store`` does).
        socket: overrides ``node.socket``.
        autostart: start a node when none answers (default ``node.autostart``).
        timeout_s: the most one request waits for its reply.
        start_timeout_s: the most :meth:`connect` waits for a node it started.
        version: the kvwarm version this client announces (default: the installed one).
    """

    def __init__(self, config: KvwarmConfig, store_url: str | None = None, *,
                 socket: str | os.PathLike[str] | None = None, autostart: bool | None = None,
                 timeout_s: float = 2.0, start_timeout_s: float = 60.0, version: str | None = None) -> None:
        self.config = config
        self.store_url = store_url
        self.path = socket_path(config, socket)
        self.hello = Handshake.of(config, store_url, version=version)
        self.autostart = config.node.autostart if autostart is None else autostart
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.node: dict[str, Any] = {}  # the node's hello reply: pid, version, node_tier, metrics_port
        self.reconnects = 0
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._refused: NodeRefused | None = None
        self._reconnecting: threading.Thread | None = None
        self._closed = False

    # -- connecting --------------------------------------------------------------
    def connect(self) -> dict[str, Any]:
        """Connect and say hello, starting a node first when none answers and ``autostart`` is on.
        Returns the node's hello reply.

        Raises:
            NodeRefused: the node runs another kvwarm version or store configuration.
            NodeUnavailable: no node answers (and none could be started).
        """
        try:
            sock = self._open()
        except NodeUnavailable:
            if not self.autostart:
                raise
            start_node(self.path, self.config, self.store_url, timeout_s=self.start_timeout_s)
            sock = self._open()
        with self._lock:
            old, self._sock = self._sock, sock
            self._refused = None
        if old is not None:
            old.close()
        return self.node

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise NodeUnavailable(f"no kvwarm node answers at {self.path} ({exc.strerror or exc}); start one with "
                                  "`prefill node`, or turn node.autostart on") from None
        try:
            send_frame(sock, Op.HELLO, self.hello.encode())
            op, body = recv_frame(sock)
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise NodeUnavailable(f"the kvwarm node at {self.path} did not answer the hello: {exc}") from None
        if op == Op.REFUSED:
            sock.close()
            refused = NodeRefused(body.decode(errors="replace"))
            with self._lock:
                self._refused = refused
            raise refused
        if op != Op.HELLO:
            sock.close()
            raise NodeUnavailable(f"the kvwarm node at {self.path} answered the hello with: "
                                  f"{body.decode(errors='replace')}")
        self.node = json.loads(body.decode())
        return sock

    @property
    def connected(self) -> bool:
        """Whether a connection is open (it may still find the node gone)."""
        return self._sock is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait for a reconnection in progress; ``False`` when none connected in time (at once when the
        node refused this client, or the client is closed)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._sock is not None:
                return True
            if self._refused is not None or self._closed:
                return False
            time.sleep(0.05)
        return self._sock is not None

    def reconnect_in_background(self) -> None:
        """Reconnect on a thread of its own (one at a time), retrying with a growing pause (0.1 s to 5 s),
        starting a node when ``autostart``; what a failed request does, and what a process whose
        :meth:`connect` failed at start-up calls to keep trying. A refusal stops the retries."""
        with self._lock:
            if self._closed or (self._reconnecting is not None and self._reconnecting.is_alive()):
                return
            self._reconnecting = threading.Thread(target=self._reconnect, name="kvwarm-node-reconnect", daemon=True)
            self._reconnecting.start()

    def _reconnect(self) -> None:
        pause = 0.1
        while not self._closed:
            try:
                self.connect()
                self.reconnects += 1
                log.info("kvwarm node: reconnected to %s (pid %s)", self.path, self.node.get("pid"))
                return
            except NodeRefused as exc:  # a configuration to fix, not a failure: the engine works alone
                log.warning("kvwarm node: %s", exc)
                return
            except NodeUnavailable as exc:  # said once; the retries go on quietly (a node may be started later)
                log.log(logging.WARNING if pause == 0.1 else logging.DEBUG, "kvwarm node: %s; retrying", exc)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)

    # -- requests ----------------------------------------------------------------
    def _request(self, op: Op, body: bytes) -> bytes:
        with self._lock:
            sock = self._sock
            if sock is None:
                refused = self._refused
            else:
                try:
                    send_frame(sock, op, body)
                    rop, reply = recv_frame(sock)
                except (OSError, ProtocolError) as exc:
                    sock.close()
                    self._sock = None
                    reason = exc
                else:
                    reason = None
        if sock is None:
            if refused is not None:  # a new one each time: re-raising one instance grows its traceback
                raise NodeRefused(str(refused)) from None
            self.reconnect_in_background()
            raise NodeUnavailable(f"not connected to the kvwarm node at {self.path} (reconnecting)")
        if reason is not None:
            self.reconnect_in_background()
            raise NodeUnavailable(f"the kvwarm node at {self.path} went away ({reason}); reconnecting")
        if rop == Op.ERROR:
            raise NodeUnavailable(f"the kvwarm node at {self.path} could not answer: {reply.decode(errors='replace')}")
        return reply

    def lookup(self, namespace: str, keys: Sequence[str]) -> NodeLookup:
        """How many leading ``keys`` of ``namespace``'s chain the node tier holds, and their files.

        Raises:
            NodeUnavailable: no node answers now (serve a miss; the client reconnects meanwhile).
            NodeRefused: the node refused this client's hello.
        """
        if not keys:
            return NodeLookup(0, ())
        paths = decode_paths(self._request(Op.LOOKUP, encode_keys(namespace, list(keys))))
        return NodeLookup(len(paths), tuple(paths))

    def prefetch(self, namespace: str, keys: Sequence[str]) -> int:
        """Ask the node to copy the chain from the shared tier into its own; returns the blocks queued."""
        return decode_count(self._request(Op.PREFETCH, encode_keys(namespace, list(keys))))

    def pending(self, namespace: str, keys: Sequence[str]) -> int:
        """How many of ``keys`` the node's copies still have queued or in progress (0: the node tier
        holds all it will of them, for now: ask :meth:`lookup` how many)."""
        if not keys:
            return 0
        return decode_count(self._request(Op.PENDING, encode_keys(namespace, list(keys))))

    def record(self, namespace: str, keys: Sequence[str]) -> None:
        """Tell the node a request used these blocks (fleet memory)."""
        self._request(Op.RECORD, encode_keys(namespace, list(keys)))

    def attach(self, announcement: "Announcement") -> dict[str, Any]:
        """Hand the node an engine's write-back ring (it attaches the reader and stores what comes);
        returns ``{"refused": [...]}``, the configured tenants whose secrets the node lacks.

        Raises:
            NodeUnavailable: no node answers, or it could not attach the ring (the reply says why).
        """
        return json.loads(self._request(Op.ATTACH, announcement.encode()).decode())

    def stats(self) -> dict[str, Any]:
        """The node's counters and state."""
        return json.loads(self._request(Op.STATS, b"").decode())

    def close(self) -> None:
        """Close the connection and stop reconnecting (the node runs on)."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
