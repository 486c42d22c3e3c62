"""Starting a node process when a client finds none at its socket.

``python -m store.node`` is started detached (a session of its own: it outlives the engine that
started it), with the client's configuration written beside the socket, and its output appended
to ``<socket>.log``. A lock beside the socket (``<socket>.spawn.lock``) makes starters take turns:
the second engine to find no node waits for the first one's node and starts none.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from store.config import KvwarmConfig
from store.errors import NodeUnavailable

log = logging.getLogger("kvwarm.node")


def lock_path(sock: Path) -> Path:
    """The lock a running node holds beside its socket (its pid inside)."""
    return sock.with_name(sock.name + ".node.lock")


def _held(path: Path) -> bool:
    """Whether another process holds the lock file ``path`` (taken and released at once when free)."""
    try:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def node_holds_lock(sock: Path) -> bool:
    """Whether a node process holds the socket's lock (it runs, or is starting and not yet listening)."""
    return _held(lock_path(sock))


def starting(sock: Path) -> bool:
    """Whether a node at ``sock`` is on its way: a starter holds the spawn lock, or a node holds its lock."""
    return _held(sock.with_name(sock.name + ".spawn.lock")) or node_holds_lock(sock)


def wait_starting(sock: Path, timeout_s: float, *, poll_s: float = 0.05) -> bool:
    """Whether a node answers at ``sock``, waiting up to ``timeout_s`` while one is on its way
    (:func:`starting`); with none answering and none starting, ``False`` at once."""
    end = time.monotonic() + timeout_s
    while True:
        if answers(sock):
            return True
        if time.monotonic() >= end or not starting(sock):
            return False
        time.sleep(poll_s)


def _wait_answers(path: Path, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if answers(path):
            return True
        time.sleep(0.05)
    return False


def answers(path: Path) -> bool:
    """Whether something accepts connections at the socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def write_config(config: KvwarmConfig, path: Path) -> Path:
    """``config`` as a JSON file beside the socket (owner-only; replaced atomically), for the node to read."""
    out = path.with_name(path.name + ".config.json")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config.model_dump(mode="json"), f)
    os.replace(tmp, out)
    return out


def start_node(path: Path, config: KvwarmConfig, store_url: str | None = None, *, timeout_s: float = 60.0) -> int | None:
    """Start a node at ``path`` unless one answers there (or another starter's does, once its turn
    ends); wait until it answers. Returns the started node's pid (``None``: another's answers).

    Raises:
        NodeUnavailable: the node exited or did not answer within ``timeout_s`` (its log's tail in
            the message).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".spawn.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if answers(path):
            return None
        if node_holds_lock(path):  # a node is starting (`prefill node` by hand, a service): wait for it
            if _wait_answers(path, timeout_s):
                return None
            raise NodeUnavailable(f"a kvwarm node holds {lock_path(path)} but did not answer at {path} within "
                                  f"{timeout_s:.0f} s; see its log, or stop it")
        cmd = [sys.executable, "-m", "store.node", "--socket", str(path), "--config", str(write_config(config, path))]
        if store_url:
            cmd += ["--store", store_url]
        if config.node.autostart_idle_s is not None:
            cmd += ["--exit-idle", repr(float(config.node.autostart_idle_s))]
        logfile = path.with_name(path.name + ".log")
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        log.info("kvwarm node: started pid %d at %s (log %s)", proc.pid, path, logfile)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if answers(path):
                return proc.pid
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        else:
            proc.kill()
        raise NodeUnavailable(f"the kvwarm node started at {path} did not answer (exit status {proc.poll()}); "
                              f"its log {logfile} ends: {_tail(logfile)}")


def _tail(path: Path, n: int = 1500) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(empty)"
