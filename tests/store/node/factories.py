"""Helpers for the node tests: a config on a tmp store, a `prefill node` process, stopping it by pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from store.config import KvwarmConfig, parse_config
from store.node.spawn import answers

REPO = Path(__file__).resolve().parents[3]
#: how long a test waits for a node to start or a thing to happen: only a hang reaches it
HANG_S = 60.0


def node_config(tier: Path, sock: Path, **sections: dict[str, Any]) -> KvwarmConfig:
    """A config on the node tier ``tier`` with its node at ``sock``: any free metrics port, GC every hour unless given."""
    node = {"socket": str(sock), "metrics_port": 0, "gc_interval_s": 3600.0, **sections.pop("node", {})}
    kv = {"block_size": 16, **sections.pop("kv_cache", {})}
    store_section = {"url": f"file://{tier}", **sections.pop("store", {})}
    return parse_config({"store": store_section, "node": node, "kv_cache": kv, **sections})


def write_config(config: KvwarmConfig, path: Path) -> Path:
    """``config`` as a JSON file (what `prefill node --config` reads)."""
    import json

    path.write_text(json.dumps(config.model_dump(mode="json")))
    return path


def env() -> dict[str, str]:
    """The environment a node process runs in: this checkout first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def start_prefill_node(config_file: Path, sock: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`prefill node` as a process of its own; returns once it answers at ``sock``."""
    proc = subprocess.Popen([sys.executable, "-m", "prefill.cli", "node", "--config", str(config_file), *extra],
                            env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    end = time.monotonic() + HANG_S
    while not answers(sock):
        if proc.poll() is not None:
            raise AssertionError(f"prefill node exited {proc.returncode}: {proc.stdout.read().decode()}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("prefill node did not answer")
        time.sleep(0.05)
    return proc


def stop(pid: int, sig: int = signal.SIGTERM) -> None:
    """Signal one process we started (by its pid); ignore one already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def gone(pid: int, timeout_s: float = HANG_S) -> bool:
    """Wait for ``pid`` to exit (reaped by its parent or a zombie of ours)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return True
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.05)
    return False


def eventually(check, timeout_s: float = HANG_S) -> Any:  # type: ignore[no-untyped-def]
    """``check()``'s first truthy value, polled until ``timeout_s`` (only a hang reaches it)."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > end:
            return value
        time.sleep(0.05)
