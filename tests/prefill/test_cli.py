"""``prefill warm``: clear errors for each kind of bad input, and a working happy path."""
from __future__ import annotations

import json

import pytest

from prefill.cli import main
from prefill.inputs import InputError, parse_deadline
from prefill.numa import node_cpus, parse_cpulist


def warm(tmp_path, *args):
    return main(["warm", "--store", f"file://{tmp_path / 'store'}", "--block-size", "16", *args])


def test_happy_path_prints_the_report_then_a_rerun_writes_nothing(tmp_path, capsys):
    text = "You are a meticulous travel planner. Ask for dates, budget and interests before proposing anything."
    assert warm(tmp_path, "--text", text, "--json") == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["blocks_written"] >= 1 and first["blocks_left"] == 0
    assert warm(tmp_path, "--text", text, "--json") == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["blocks_written"] == 0 and again["tokens_computed"] == 0


@pytest.mark.parametrize("args, rc, message", [
    (["--model", "/nonexistent/model", "--text", "x" * 200], 2, "does not exist"),
    (["--model", "no-such-org/no-such-model-xyz", "--text", "x" * 200], 2, "unknown model"),
    ([], 2, "no prefixes given"),
    (["--text", "hi"], 2, "shorter than one block"),
    (["--text", "x" * 200, "--until", "2001-01-01T00:00Z"], 1, "already past"),
    (["--text", "x" * 200, "--until", "tomorrowish"], 2, "is not a time"),
    (["--token-ids", "1,2,x"], 2, "expected integers"),
])
def test_bad_input_gets_a_clear_error(tmp_path, capsys, monkeypatch, args, rc, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert warm(tmp_path, *args) == rc
    assert message in capsys.readouterr().err


def test_empty_file_and_store_that_cannot_be_reached(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert warm(tmp_path, "--file", str(empty)) == 2
    assert "holds no prefixes" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store:\n  s3:\n    endpoint_url: http://127.0.0.1:9\n    op_timeout_s: 2\n    retries: 0\n")
    rc = main(["warm", "--config", str(cfg), "--store", "s3://kvwarm-nowhere/x", "--block-size", "16",
               "--text", "x" * 200])
    assert rc == 1
    assert "Unavailable" in capsys.readouterr().err


def test_deadlines_parse_in_every_documented_form():
    now = 1_764_442_800.0  # 2025-11-29 19:00 UTC
    assert parse_deadline("+90m", now) == now + 5400
    assert parse_deadline("+2h", now) == now + 7200
    assert parse_deadline("2025-11-29T20:00Z", now) == now + 3600
    assert parse_deadline("2025-11-29T20:00", now) == now + 3600  # no offset: UTC
    assert parse_deadline("18:00", now) == now + 23 * 3600      # next 18:00 is tomorrow
    with pytest.raises(InputError):
        parse_deadline("soon", now)


def test_numa_pinning_reads_sysfs_and_is_a_no_op_without_it(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    dev = tmp_path / "bus/pci/devices/0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("16-31\n")
    assert node_cpus("0000:3B:00.0", tmp_path) == set(range(16, 32))
    (dev / "numa_node").write_text("-1\n")
    assert node_cpus("0000:3b:00.0", tmp_path) is None
    assert node_cpus("0000:00:00.0", tmp_path) is None
