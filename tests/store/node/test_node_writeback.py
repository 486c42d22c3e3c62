"""Write-back through a real node process: an engine's writer hands its blocks through a ring, the node
writes them, byte for byte what the engine writes itself; kill -9 of either end."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from store.format.precision import Precision
from store.identity.keys import block_chain
from store.kernels.gather import block_ids, gather_quantise
from store.node.block_record import block_meta, write_block
from store.node.client import NodeClient
from store.tiers.base import object_name
from tests.store.engines.vllm.worker_setup import IDENT, KB
from tests.store.node.factories import (
    HANG_S,
    REPO,
    env,
    eventually,
    gone,
    node_config,
    start_prefill_node,
    stop,
    write_config,
)
from tests.store.node.ring_saves_setup import NOW, RATIO, caches, local_writer, ring_writer, saves

PRECISIONS = {"fp8-head": Precision(), "fp8-keep": Precision(keep_layers=(1,), keep_dtype="fp16"),
              "bf16": Precision(compression="bf16")}


def _config(tmp_path, sock_dir, precision: Precision, **sections):  # type: ignore[no-untyped-def]
    kv = {"block_size": KB, "compression": precision.compression, "keep_layers": list(precision.keep_layers),
          "keep_dtype": precision.keep_dtype}
    return node_config(tmp_path / "node-tier", sock_dir / "n.sock", kv_cache=kv, node={"agent": False}, **sections)


def _blocks(precision: Precision, config):  # type: ignore[no-untyped-def]
    root = IDENT.key_root(precision, KB, config.tenant("acme").salt)
    return [b for spec in saves() for b in block_chain(root, spec.token_ids)[spec.first:]]


def _node_counts(config) -> dict:  # type: ignore[no-untyped-def]
    with NodeClient(config, autostart=False) as client:
        client.connect()
        return client.stats()["write_back"]


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_blocks_handed_to_the_node_are_on_nvme_byte_for_byte_as_the_engine_writes_them(tmp_path, sock_dir, node_pids,
                                                                                       name):
    precision = PRECISIONS[name]
    config = _config(tmp_path, sock_dir, precision)
    proc = start_prefill_node(write_config(config, tmp_path / "kvwarm.json"), sock_dir / "n.sock", "--no-agent")
    node_pids.append(proc.pid)
    lay, kv = caches()
    via_node = ring_writer(tmp_path / "node-tier", config, lay, precision, sock_dir)
    itself = local_writer(tmp_path / "engine-tier", config, lay, precision)
    try:
        assert via_node.handoff is not None and via_node.handoff.client.wait_connected(HANG_S)
        for w in (via_node, itself):
            assert w.copy_out_step(saves(), kv) == [None, None]
            assert w.drain(HANG_S)
        blocks = _blocks(precision, config)
        assert len(blocks) == 8
        for block in blocks:
            name_ = object_name("acme", block.key)
            mine = itself.local.read(name_)
            assert mine is not None and via_node.local.read(name_) == mine
        assert via_node.counters.totals()["write_back_handed"] == 8
        assert "written_back_blocks" not in via_node.counters.totals()  # the engine wrote nothing itself
        counts = _node_counts(config)
        assert counts["written_back_blocks"] == 8 and counts["rings"] == 1
        # the same blocks again (a save planned twice, or records read again): the same objects, skipped
        assert via_node.copy_out_step(saves(), kv) == [None, None] and via_node.drain(HANG_S)
        assert eventually(lambda: _node_counts(config).get("write_back_skipped:present") == 8)
        assert _node_counts(config)["written_back_blocks"] == 8
    finally:
        via_node.close()
        itself.close()
    ring = via_node.handoff.ring.path
    assert eventually(lambda: not os.path.exists(ring))  # the engine let go: the node removed its ring
    assert eventually(lambda: _node_counts(config)["rings"] == 0)


def test_kill_9_of_an_engine_mid_write_back_keeps_what_it_committed_and_discards_the_rest(tmp_path, sock_dir,
                                                                                          node_pids):
    config = _config(tmp_path, sock_dir, Precision())
    cfile = write_config(config, tmp_path / "kvwarm.json")
    proc = start_prefill_node(cfile, sock_dir / "n.sock", "--no-agent")
    node_pids.append(proc.pid)
    engine = subprocess.Popen([sys.executable, "-m", "tests.store.node.ring_engine", str(cfile), str(sock_dir)],
                              env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = engine.stdout.readline()  # type: ignore[union-attr]
        assert line, engine.stderr.read().decode()  # type: ignore[union-attr]
        said = json.loads(line)
        assert said["ready"] and said["handed"] == 8
        stop(engine.pid, signal.SIGKILL)
        assert gone(engine.pid)
    finally:
        if engine.poll() is None:
            stop(engine.pid, signal.SIGKILL)
            engine.wait()
    assert eventually(lambda: not os.path.exists(said["ring"]))  # drained, its open slot discarded, removed
    counts = _node_counts(config)
    assert counts["written_back_blocks"] == 8 and counts["write_back_dropped:engine_gone"] == 1
    assert counts["rings"] == 0
    with NodeClient(config, autostart=False) as client:  # and on the node's Prometheus endpoint, by reason
        port = client.connect()["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert 'kvwarm_node_write_back_dropped_total{reason="engine_gone"} 1.0' in text
    assert "kvwarm_node_written_back_blocks_total 8.0" in text and "kvwarm_node_upload_dropped_total" in text
    from store.tiers.local import LocalTier

    tier = LocalTier(tmp_path / "node-tier", cap_bytes=1 << 30)
    assert all(tier.exists(object_name("acme", b.key)) for b in _blocks(Precision(), config))


def test_kill_9_of_the_node_the_engine_writes_itself_and_a_new_node_stores_what_was_left_once(tmp_path, sock_dir,
                                                                                              node_pids):
    precision = Precision()
    config = _config(tmp_path, sock_dir, precision)
    cfile = write_config(config, tmp_path / "kvwarm.json")
    proc = start_prefill_node(cfile, sock_dir / "n.sock", "--no-agent")
    node_pids.append(proc.pid)
    lay, kv = caches()
    writer = ring_writer(tmp_path / "node-tier", config, lay, precision, sock_dir)
    handoff = writer.handoff
    try:
        assert handoff is not None and handoff.client.wait_connected(HANG_S) and handoff.attached()
        stop(proc.pid, signal.SIGKILL)
        assert gone(proc.pid)
        first, second = saves()
        assert writer.copy_out_step([second], kv) == [None]  # no node now: the engine writes it itself
        assert writer.drain(HANG_S)
        mine = writer.counters.totals()
        assert mine["written_back_blocks"] == 5 and "write_back_handed" not in mine
        root = IDENT.key_root(precision, KB, config.tenant("acme").salt)
        blocks = block_chain(root, second.token_ids)[second.first:]
        written = {b.key: writer.local.read(object_name("acme", b.key)) for b in blocks}
        # the same blocks, committed to the ring just before the node died (it never read them)
        layers = [gather_quantise(c, lay, block_ids(second.block_ids, "cpu"), ratio=RATIO, precision=precision,
                                  layer=i) for i, c in enumerate(kv)]
        for j, b in enumerate(blocks):
            meta = block_meta("acme", b, chain=0, precision=precision, now=NOW, layers=len(layers))
            assert write_block(handoff.writer, handoff.sizes, meta, b.tokens, [x.block(j) for x in layers],
                               [float(x.errors[0][j]) for x in layers], [float(x.errors[1][j]) for x in layers])
        # a new node: the engine announces its ring again with its next save; the records left are
        # stored once (already on NVMe: skipped, the same object), the new save written by the node
        second_node = start_prefill_node(cfile, sock_dir / "n.sock", "--no-agent")
        node_pids.append(second_node.pid)
        assert handoff.client.wait_connected(HANG_S)
        assert writer.copy_out_step([first], kv) == [None] and writer.drain(HANG_S)
        assert handoff.announced == 2 and writer.counters.totals()["write_back_handed"] == 3
        counts = _node_counts(config)
        assert counts.get("write_back_skipped:present") == 5 and counts["written_back_blocks"] == 3
        for key, data in written.items():
            assert data is not None and writer.local.read(object_name("acme", key)) == data
    finally:
        writer.close()


def test_a_tenant_whose_secret_the_node_lacks_is_written_by_the_engine(tmp_path, sock_dir, node_pids, monkeypatch):
    precision = Precision()
    config = _config(tmp_path, sock_dir, precision, tenants={"beta": {"secret_env": "KVWARM_TEST_BETA"}})
    monkeypatch.delenv("KVWARM_TEST_BETA", raising=False)
    proc = start_prefill_node(write_config(config, tmp_path / "kvwarm.json"), sock_dir / "n.sock", "--no-agent")
    node_pids.append(proc.pid)
    monkeypatch.setenv("KVWARM_TEST_BETA", "beta-secret-of-enough-length")  # the engine has it, the node not
    lay, kv = caches()
    writer = ring_writer(tmp_path / "node-tier", config, lay, precision, sock_dir)
    try:
        first, second = saves()
        assert writer.copy_out_step([first, dataclasses.replace(second, tenant="beta")], kv) == [None, None]
        assert writer.drain(HANG_S)
        mine = writer.counters.totals()
        assert mine["write_back_handed"] == 3 and mine["written_back_blocks"] == 5  # acme's to the node, beta's here
        assert _node_counts(config)["written_back_blocks"] == 3
        root = IDENT.key_root(precision, KB, config.tenant("beta").salt)
        assert all(writer.local.exists(object_name("beta", b.key))
                   for b in block_chain(root, second.token_ids)[second.first:])
    finally:
        writer.close()
