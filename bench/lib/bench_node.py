"""The kvwarm node processes a bench's engines start, kept to the bench.

The connector starts a node by itself when none answers (``node.autostart``), at ``node.socket``
(by default one per user, ``~/.cache/kvwarm/node.sock``). A bench gives each store configuration a
socket of its own under its work directory (:func:`node_section`), so that its nodes neither meet
another run's nor outlive it, and stops them at its end (:func:`stop_nodes`).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

SOCKET = "node.sock"


def node_section(where: Path) -> dict[str, Any]:
    """The config's ``node`` section: its socket in ``where``, metrics on a free port (a node of
    another run on this machine may hold the default one)."""
    return {"socket": str(where / SOCKET), "metrics_port": 0}


def node_pid(sock: Path) -> int | None:
    """The pid in the lock the node process holds beside its socket (``None``: no node started)."""
    from store.node.spawn import lock_path

    try:
        return int(lock_path(sock).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_node(sock: Path, *, grace_s: float = 10.0) -> int | None:
    """SIGTERM the node at ``sock`` (SIGKILL after ``grace_s``); returns its pid (``None``: none runs there).

    Only a node that still holds its lock is signalled: the pid in a lock left by one that exited may be
    another process's by now."""
    from store.node.spawn import node_holds_lock

    pid = node_pid(sock)
    if pid is None or not node_holds_lock(sock):
        return None
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return pid


def stop_nodes(root: Path) -> list[int]:
    """Stop every node whose socket is under ``root``; their pids."""
    stopped = []
    for sock in sorted({p.with_name(SOCKET) for p in root.rglob("*.node.lock")}):
        if (pid := stop_node(sock)) is not None:
            stopped.append(pid)
    return stopped
