"""Starting a node: a starter that finds a node holding the socket's lock (starting, not yet listening)
waits for it and starts none."""
from __future__ import annotations

import fcntl
import socket
import threading

import pytest

from store.config import parse_config
from store.errors import NodeUnavailable
from store.node.spawn import lock_path, node_holds_lock, start_node


def test_a_starter_waits_for_a_node_that_holds_the_lock_and_starts_none(sock_dir):
    sock = sock_dir / "n.sock"
    config = parse_config({"store": {"url": f"file://{sock_dir}/tier"}})
    assert not node_holds_lock(sock)
    with open(lock_path(sock), "a") as held:  # a node that is starting: it holds the lock, no socket yet
        fcntl.flock(held, fcntl.LOCK_EX)
        assert node_holds_lock(sock)
        with pytest.raises(NodeUnavailable, match="holds .*node.lock but did not answer"):
            start_node(sock, config, timeout_s=0.5)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ready = threading.Timer(0.3, lambda: (listener.bind(str(sock)), listener.listen()))
        ready.start()
        try:
            assert start_node(sock, config, timeout_s=60) is None  # it answered: nothing started
        finally:
            ready.join()
            listener.close()
    assert not node_holds_lock(sock)
    assert not (sock_dir / "n.sock.log").exists() and not (sock_dir / "n.sock.config.json").exists()
