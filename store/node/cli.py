"""``prefill node``: run the machine's kvwarm node process (also ``python -m store.node``).

    prefill node [--config FILE] [--store URL] [--socket PATH] [--metrics-port N] [--gc-interval S] [--no-agent]

It serves until SIGTERM or SIGINT, then closes its socket, writes fleet memory once more and
exits 0. Exit 1 when another node already serves the socket, 2 for a bad configuration.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Sequence

from store.cli import add_location_options, location_options
from store.config import load_config
from store.errors import BadInputError, KvwarmError
from store.node.handshake import socket_path

log = logging.getLogger("kvwarm.node")


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", help="the Unix socket to serve (default: node.socket, else "
                   "$XDG_RUNTIME_DIR/kvwarm/node.sock or node.sock under kvwarm's home)")
    p.add_argument("--metrics-port", type=int, metavar="N", help="Prometheus port (default: node.metrics_port; "
                   "0: any free port; -1: none)")
    p.add_argument("--gc-interval", type=float, metavar="S", help="seconds between GCs of the node tier "
                   "(default: node.gc_interval_s)")
    p.add_argument("--no-agent", action="store_true", help="do not follow published plans or warm from the fleet's "
                   "memory (default: node.agent)")


def add_node_command(sub: Any) -> None:
    """Register ``prefill node`` on an argparse subparsers object."""
    p = sub.add_parser("node", help="run the machine's kvwarm node process",
                       description="Run the kvwarm node process: one per machine, shared by every engine on it. "
                                   "It owns the node tier (NVMe) and its index, every S3 read and write, the node "
                                   "agent, fleet memory, the node tier's GC and a Prometheus endpoint, and answers "
                                   "engines on a Unix socket. Serves until SIGTERM or SIGINT. See docs/guides/node.md.")
    _add_options(p)
    add_location_options(p)
    p.set_defaults(func=run_node)


def run_node(args: argparse.Namespace) -> int:
    """Serve until a signal; the exit status."""
    from store.node.server import NodeServer
    from store.node.service import NodeService

    config = load_config(args.config)
    path = socket_path(config, args.socket)
    server = NodeServer(path, lambda: NodeService(
        config, args.store, metrics_port=args.metrics_port, gc_interval_s=args.gc_interval,
        agent=False if args.no_agent else None))
    done = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        log.info("kvwarm node: signal %d, stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.start()
    print(f"kvwarm node pid {server.service.stats()['pid']} serving {path} (node tier {server.service.local.url}, "
          f"metrics port {server.service.metrics_port})", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m store.node``: what a client starts (:mod:`store.node.spawn`)."""
    parser = argparse.ArgumentParser(prog="python -m store.node", description="Run the kvwarm node process.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    _add_options(parser)
    add_location_options(parser)
    args = parser.parse_args(argv)
    location_options(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_node(args)
    except BadInputError as exc:
        print(f"kvwarm node: error: {exc}", file=sys.stderr)
        return 2
    except KvwarmError as exc:
        print(f"kvwarm node: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
