"""Starting a node: a starter that finds a node holding the socket's lock (starting, not yet listening)
waits for it and starts none."""
from __future__ import annotations

import fcntl
import socket
import threading

import pytest

from store.config import parse_config
from store.errors import NodeUnavailable
from store.node.spawn import lock_path, node_holds_lock, start_node, starting, wait_starting


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


def test_a_save_waits_for_a_node_on_its_way_and_for_nothing_when_none_is(sock_dir):
    """:func:`wait_starting` (the write-back ring's first save): no node and no starter, no wait; a starter
    holding the spawn lock, waited for until its node answers; a wait that ends without one, ``False``."""
    sock = sock_dir / "w.sock"
    waits = []
    assert not wait_starting(sock, 60, poll_s=0.01) and not starting(sock)  # nothing on its way: at once
    with open(sock.with_name(sock.name + ".spawn.lock"), "a") as spawning:
        fcntl.flock(spawning, fcntl.LOCK_EX)  # an engine's client is starting a node
        assert starting(sock)
        assert not wait_starting(sock, 0.2, poll_s=0.01)  # it did not answer in time
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ready = threading.Timer(0.3, lambda: (waits.append(1), listener.bind(str(sock)), listener.listen()))
        ready.start()
        try:
            assert wait_starting(sock, 60, poll_s=0.01) and waits == [1]
        finally:
            ready.join()
            listener.close()
