"""Write-back through the node on a real engine (``loader.write_back_via = node``).

An engine on an empty bf16 store, whose connector starts the machine's node at a short socket
path, computes ``written_back`` (two full kvwarm blocks, nothing stored) with vLLM's own tokens.
Its worker hands the blocks to the node through its ring and writes nothing itself; the node
writes them to NVMe. Each file is an ordinary snapshot (checksums checked), and equals, byte for
byte but for its creation and expiry times, the file the engine's own writer wrote for the same
prompt on the ``bf16_engine`` (``loader.write_back_via = engine``).

Then the node is killed with SIGKILL while the engine serves more prompts (distinct corpus prompts of
one block each, sent together): the engine writes back what the node no longer takes, its client
starts a new node, and a last round goes through that one. Every prompt gives vLLM's own tokens, and
``prefill store audit --all`` then finds every written-back snapshot right: nothing torn, nothing wrong.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.lib.vllm_engine import start_engine
from prefill.cli import main
from store.config import load_config
from store.format.payload import map_file
from store.format.snapshot import read_snapshot
from store.node.client import NodeClient
from store.node.spawn import answers, lock_path
from tests.store.engines.vllm.harness import (
    TENANTS,
    connector,
    count,
    engine_spec,
    reasons,
    request,
    tiny_dir,
    write_config,
)
from tests.store.engines.vllm.prompts import all_ids
from tests.store.engines.vllm.writeback_names import PROMPT, written_names

#: only a hang reaches it
HANG_S = 120.0
#: one-block corpus prompts nothing stores: written back after the kill, and through the new node
KILLED, AFTER = [f"agree_{i}" for i in range(4)], [f"agree_{i}" for i in range(4, 6)]


@pytest.fixture(scope="module")
def via_node(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("via-node")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))  # a socket path holds at most 107 bytes
    sock = sock_dir / "node.sock"
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="bf16", tenants=TENANTS,
                       node={"socket": str(sock), "metrics_port": 0, "autostart_idle_s": 120.0},
                       loader={"write_back_via": "node"})
    ids = all_ids()
    steps = [{"name": "started", "barrier": True}, {"name": "write", "requests": [request(ids[PROMPT])]},
             {"name": "kill", "barrier": True}, {"name": "killed", "keys": []},  # the engine's figures then
             {"name": "node_killed", "requests": [request(ids[n]) for n in KILLED], "together": True},
             {"name": "restarted", "barrier": True},
             {"name": "new_node", "requests": [request(ids[n]) for n in AFTER], "together": True}]
    pids: list[int] = []
    proc = start_engine(engine_spec(steps, extra=connector(cfg)), d / "engine")
    try:
        proc.at_barrier("started")
        end = time.monotonic() + HANG_S
        while not answers(sock) and time.monotonic() < end:  # the node the scheduler role starts
            time.sleep(0.2)
        proc.go("started")  # until it answers, the worker writes its blocks itself
        proc.at_barrier("kill")
        with NodeClient(load_config(cfg), autostart=False) as client:
            pids.append(client.connect()["pid"])
            end = time.monotonic() + HANG_S
            while True:  # the first node's figures once it has stored the ring's blocks, then it is killed
                node = client.stats()
                if node["write_back"].get("written_back_blocks", 0) >= 2 or time.monotonic() > end:
                    break
                time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        proc.go("kill")
        proc.at_barrier("restarted")  # the engine's client starts a new node
        pids.append(_wait_new_node(sock, pids[0]))
        proc.go("restarted")
        run = proc.wait()
    finally:
        proc.stop()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(sock_dir, ignore_errors=True)
    return cfg, run, node


def _wait_new_node(sock: Path, old: int) -> int:
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        try:
            pid = int(lock_path(sock).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = None
        if pid is not None and pid != old and answers(sock):
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no new kvwarm node answered at {sock} within {HANG_S:.0f} s of the kill")


def test_the_engine_hands_its_blocks_to_the_node_with_vllms_tokens(via_node, cold):
    _, run, node = via_node
    call = run.calls("write")[0]
    assert call["tokens"] == cold[PROMPT]  # bf16 write-back of the engine's own KV: exactly its tokens
    worker = run.stats("killed", "worker")  # the ring had drained into the node, which was then killed
    assert count(worker, "write_back_handed") == 2
    assert count(worker, "written_back_blocks") == 0  # the engine wrote nothing itself
    assert not reasons(worker, "write_back_dropped")
    wb = node["write_back"]
    assert wb["written_back_blocks"] == 2 and node["rings_attached"] >= 1
    assert not [k for k in wb if k.startswith("write_back_dropped")]


def test_the_nodes_files_are_the_engines_own_writer_files(via_node, bf16_store, bf16_engine):
    cfg, _, _ = via_node
    ids = all_ids()[PROMPT]
    names = written_names(cfg)
    assert names == written_names(bf16_store)  # the same tenant salt: the same object names
    for i, name in enumerate(names):
        mine = Path(cfg).parent / "store" / "objects" / name
        theirs = bf16_store.parent / "store" / "objects" / name
        got = read_snapshot(map_file(mine), location=str(mine), verify_payload=True)
        want = read_snapshot(map_file(theirs), location=str(theirs), verify_payload=True)
        assert got.header.token_ids == tuple(ids[256 * i: 256 * (i + 1)])
        assert replace(got.header, created_at=0.0, expires_at=0.0) == \
            replace(want.header, created_at=0.0, expires_at=0.0)
        assert got.header.expires_at - got.header.created_at == pytest.approx(load_config(cfg).kv_cache.ttl_seconds())
        assert got.payload is not None and want.payload is not None
        assert got.payload[0].tobytes() == want.payload[0].tobytes()


def test_through_a_kill_9_of_the_node_every_prompt_has_vllms_tokens_and_the_audit_finds_nothing_wrong(
        via_node, cold, capsys):
    cfg, run, _ = via_node
    for step, names in (("node_killed", KILLED), ("new_node", AFTER)):
        for name, call in zip(names, run.calls(step)):
            assert call["tokens"] == cold[name], (step, name)
    worker = run.stats(None, "worker")
    # every full block of every prompt is stored, by the node or (while none took the ring) by the engine
    assert count(worker, "write_back_handed") + count(worker, "written_back_blocks") >= 2 + len(KILLED) + len(AFTER)
    code = main(["store", "audit", "--config", str(cfg), "--model", str(tiny_dir()), "--all", "--json",
                 "--dtype", "bf16", "--no-quarantine"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["differed"] == 0 and not report["unreadable"], report
    assert report["checked"] >= 2 + len(KILLED) + len(AFTER), report  # what the engine and both nodes wrote
