"""The connector and the machine's node process, on a real engine: the engine starts the node when none
answers, probes through it, and serves through a kill -9 of it with vLLM's own tokens.

The engine's scheduler role starts a node at the config's ``node.socket`` on its own (``node.autostart``).
The test waits for it, lets the engine serve stored prefixes, kills the node with SIGKILL, lets the
engine serve the same prompts again (the probe asks the NVMe tier itself: counted ``fallbacks``), then
waits for the client to have started a new node and lets the engine serve them a third time through it.
Before the first and the third round the engine waits until its scheduler's client has said hello (a driver
``until`` step): the node answering is not yet the client connected, and a probe before that asks the tier.
Every call must give vLLM's cold tokens, and every stored prefix must load in all three rounds.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from bench.lib.vllm_engine import start_engine
from store.node.spawn import answers, lock_path
from tests.store.engines.vllm.harness import (
    connector,
    count,
    engine_spec,
    entry,
    expected_load,
    outcome,
    prefill_here,
    request,
    write_config,
)
from tests.store.engines.vllm.prompts import all_ids, stored_prefix

NAMES = ["two_blocks", "one_block"]
#: only a hang reaches it
HANG_S = 120.0


def _node_pid(sock: Path) -> int | None:
    """The pid of the node that answers at ``sock`` (from the lock it holds), else ``None``."""
    if not answers(sock):
        return None
    try:
        return int(lock_path(sock).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _wait_node(sock: Path, *, not_pid: int | None = None) -> int:
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        pid = _node_pid(sock)
        if pid is not None and pid != not_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no kvwarm node (other than {not_pid}) answered at {sock} within {HANG_S:.0f} s")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
def node_run(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("node")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))  # a socket path holds at most 107 bytes
    sock = sock_dir / "node.sock"
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="bf16",
                       node={"socket": str(sock), "metrics_port": 0, "autostart_idle_s": 60.0})
    prefill_here(cfg, [entry(stored_prefix(n)) for n in NAMES])
    ids = all_ids()
    round_ = [request(ids[n]) for n in NAMES]
    steps = [{"name": "started", "barrier": True},
             # the node answers; the scheduler's client says hello on its own thread: its first probes wait for that
             {"name": "linked", "until": ["scheduler", "node", "connected"], "timeout_s": HANG_S},
             {"name": "through_node", "requests": round_, "together": True},
             {"name": "kill", "barrier": True},
             {"name": "node_killed", "requests": round_, "together": True},
             {"name": "restarted", "barrier": True},
             {"name": "relinked", "until": ["scheduler", "node", "connected"], "timeout_s": HANG_S},
             {"name": "new_node", "requests": round_, "together": True}]
    pids: list[int] = []
    proc = start_engine(engine_spec(steps, extra=connector(cfg, write_back=False)), d / "engine")
    try:
        proc.at_barrier("started")
        pids.append(_wait_node(sock))  # the engine's scheduler role started it
        proc.go("started")
        proc.at_barrier("kill")
        os.kill(pids[0], signal.SIGKILL)
        proc.go("kill")
        proc.at_barrier("restarted")  # the failed probes set the client reconnecting: it starts a new node
        pids.append(_wait_node(sock, not_pid=pids[0]))
        proc.go("restarted")
        run = proc.wait()
    finally:
        proc.stop()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return run, pids


def test_the_engine_starts_a_node_serves_through_its_kill_9_with_vllms_tokens_and_starts_another(
        node_run, same_as_cold):
    run, pids = node_run
    assert len(set(pids)) == 2 and _gone(pids[0])
    ids = all_ids()
    for step in ("through_node", "node_killed", "new_node"):
        for name, call in zip(NAMES, run.calls(step)):
            same_as_cold(name, call["tokens"])
            want = expected_load(len(stored_prefix(name)) // 256 * 256, len(ids[name]))
            assert outcome(call).get("loaded_tokens") == want, (step, name, outcome(call))
    node = {step: run.stats(step)["node"] for step in ("through_node", "node_killed", "new_node")}
    assert node["through_node"]["connected"] and node["through_node"]["fallbacks"] == 0, node
    # finished requests' blocks went to the node's fleet memory (not the engine's own files) while it answered
    assert node["through_node"]["fleet_records"] == len(NAMES), node
    assert node["new_node"]["fleet_records"] > node["through_node"]["fleet_records"], node
    assert node["node_killed"]["fallbacks"] > 0, node  # the probes the tier answered while the node was away
    # the client reconnects on its own thread once it has started the new node: a probe or two may still fall back
    assert node["new_node"]["connected"], node
    assert count(run.stats("new_node"), "hits") == 3 * len(NAMES)
