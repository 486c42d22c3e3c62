"""The node's Unix socket: one thread per client connection, frames in, frames out.

A connection's first frame is its hello (:class:`store.node.handshake.Handshake`): a client of
another kvwarm version or store configuration is answered :data:`Op.REFUSED` with the reason and
closed. Then each request frame gets exactly one reply. One node per socket: the node holds an
exclusive lock (``<socket>.node.lock``, its pid inside) for its life, so a second node on the same
socket refuses to start, and a socket file left by a killed node is replaced.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import IO, Callable

from store.errors import NodeRefused, OperationalError
from store.node.block_record import Announcement
from store.node.handshake import Handshake
from store.node.protocol import (
    Op,
    ProtocolError,
    decode_keys,
    encode_count,
    encode_paths,
    recv_frame,
    send_frame,
)
from store.node.service import NodeService
from store.node.spawn import lock_path

log = logging.getLogger("kvwarm.node")


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        service = self.server.service
        try:
            op, body = recv_frame(sock)
            if op != Op.HELLO:
                send_frame(sock, Op.ERROR, b"the first frame must be a hello")
                return
            try:
                service.handshake.check(Handshake.decode(body), where=f"{self.server.path} (pid {os.getpid()})")
            except NodeRefused as exc:
                service.counters.incr("hellos_refused")
                send_frame(sock, Op.REFUSED, str(exc).encode())
                return
            except ValueError as exc:
                send_frame(sock, Op.ERROR, f"bad hello: {exc}".encode())
                return
            service.counters.incr("hellos")
            send_frame(sock, Op.HELLO, json.dumps({
                "pid": os.getpid(), "version": service.handshake.version, "node_tier": service.local.url,
                "metrics_port": service.metrics_port}).encode())
        except (ConnectionError, ProtocolError, OSError):
            return
        service.connected(+1)
        try:
            self._serve(sock, service)
        finally:
            service.connected(-1)

    def _serve(self, sock: socket.socket, service: NodeService) -> None:
        while True:
            try:
                op, body = recv_frame(sock)
            except (ConnectionError, ProtocolError, OSError):
                return
            try:
                if op == Op.LOOKUP:
                    reply = encode_paths(service.lookup(decode_keys(body)))
                elif op == Op.PREFETCH:
                    reply = encode_count(service.prefetch(decode_keys(body)))
                elif op == Op.PENDING:
                    reply = encode_count(service.pending(decode_keys(body)))
                elif op == Op.RECORD:
                    service.record(decode_keys(body))
                    reply = b""
                elif op == Op.ATTACH:
                    reply = json.dumps(service.attach(Announcement.decode(body))).encode()
                elif op == Op.STATS:
                    reply = json.dumps(service.stats()).encode()
                else:
                    raise ProtocolError(f"unknown op {op}")
            except Exception as exc:  # noqa: BLE001 - one bad request is answered, the connection lives on
                service.counters.incr("errors")
                log.warning("kvwarm node: request op %s failed: %s", op, exc)
                try:
                    send_frame(sock, Op.ERROR, f"{type(exc).__name__}: {exc}".encode())
                except OSError:
                    return
                continue
            try:
                send_frame(sock, Op(op), reply)
            except OSError:
                return


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, path: Path, service: NodeService) -> None:
        self.path = path
        self.service = service
        super().__init__(str(path), _Handler)


class NodeServer:
    """A :class:`NodeService` on its socket.

    Args:
        path: the socket (its directory is created).
        service: makes what answers, once this node holds the socket's lock.

    Raises:
        OperationalError: another node holds the socket's lock (it runs).
    """

    def __init__(self, path: Path, service: Callable[[], NodeService]) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock: IO[str] = open(lock_path(path), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            pid = self._lock.read().strip() or "?"
            self._lock.close()
            raise OperationalError(f"a kvwarm node (pid {pid}) already serves {path}: stop it first, or give this "
                                   "one another node.socket") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()
        path.unlink(missing_ok=True)  # a killed node's socket file: no node holds the lock
        try:
            self.service = service()
        except BaseException:
            self._lock.close()
            raise
        self._server = _Server(path, self.service)
        os.chmod(path, 0o660)
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Answer clients until :meth:`shutdown`."""
        self._server.serve_forever(poll_interval=0.2)

    def start(self) -> "NodeServer":
        """Answer clients on a thread of its own (in-process use: tests, an embedding service)."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvwarm-node-socket", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop answering (from another thread than :meth:`serve_forever`'s)."""
        self._server.shutdown()

    def close(self) -> None:
        """Close the socket, remove its file, close the service, release the lock."""
        self._server.server_close()
        self.path.unlink(missing_ok=True)
        self.service.close()
        self._lock.close()
