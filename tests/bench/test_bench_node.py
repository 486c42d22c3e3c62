"""A bench's node processes (bench/lib/bench_node.py): each configuration's socket under the bench's work
directory, and every node started there stopped at its end."""
from __future__ import annotations

import os
from pathlib import Path

from bench.lib.bench_node import SOCKET, node_pid, node_section, stop_nodes
from store.config import parse_config
from store.node.spawn import start_node


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our child, not reaped) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_the_nodes_started_under_a_work_directory_are_stopped_and_no_other(tmp_path: Path) -> None:
    pids = []
    for name in ("a",):
        where = tmp_path / "work" / name
        section = node_section(where)
        assert section["socket"] == str(where / SOCKET) and section["metrics_port"] == 0
        config = parse_config({"store": {"url": f"file://{where / 'nvme'}"}, "node": section})
        pids.append(start_node(Path(section["socket"]), config))
    assert all(pids) and [node_pid(tmp_path / "work" / n / SOCKET) for n in ("a",)] == pids
    assert stop_nodes(tmp_path / "elsewhere") == [] and all(map(_alive, pids))
    assert sorted(stop_nodes(tmp_path / "work")) == sorted(pids)
    assert not any(map(_alive, pids))
    assert stop_nodes(tmp_path / "work") == []  # their locks are released: nothing is stopped twice
