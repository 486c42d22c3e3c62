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


@pytest.fixture()
def no_model(monkeypatch):
    """``prefill warm`` with a model loader that must never be called."""
    calls = []
    monkeypatch.setattr("prefill.warm.load_model", lambda *a, **k: calls.append(a) or pytest.fail("model loaded"))
    return calls


TEXT = ["--text", "x" * 200]


@pytest.mark.parametrize("args, message", [
    (["--store", "typo://x", *TEXT], "'typo://x' has an unknown scheme; use file://, s3://"),
    (["--config", "/nonexistent/kvwarm.yaml", *TEXT], "config file '/nonexistent/kvwarm.yaml' does not exist"),
    (["--tenant", "Not A Name", *TEXT], "tenant name 'Not A Name' is not allowed"),
    (["--block-size", "0", *TEXT], "kv_cache.block_size = 0"),
    (["--device", "tpu9", *TEXT], "device 'tpu9' is not a device"),
    (["--plan", "/nonexistent/plan.json"], "plan file '/nonexistent/plan.json' does not exist"),
])
def test_everything_but_the_model_is_checked_before_the_model_loads(tmp_path, capsys, no_model, args, message):
    assert main(["warm", "--store", f"file://{tmp_path / 'store'}", *args]) == 2  # a later --store wins
    err = capsys.readouterr().err
    assert err.startswith("prefill: error: ") and message in err
    assert no_model == []


def test_a_bad_config_value_is_bad_input_before_the_model(tmp_path, capsys, no_model):
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("kv_cache:\n  compression: fp4\n")
    assert warm(tmp_path, "--config", str(cfg), *TEXT) == 2
    assert "kv_cache.compression" in capsys.readouterr().err and no_model == []


@pytest.mark.parametrize("bug", [ValueError("shapes (3,4) and (5,) not aligned"), TypeError("'NoneType' object")])
def test_a_bug_is_a_traceback_not_bad_input(tmp_path, capsys, monkeypatch, bug):
    """Only kvwarm's own errors are the user's fault: a ValueError from deep inside (torch, numpy) propagates."""
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr("prefill.warm.warm", broken)
    with pytest.raises(type(bug)) as raised:
        warm(tmp_path, *TEXT)
    assert raised.value is bug
    assert "error:" not in capsys.readouterr().err
    monkeypatch.setattr("forecasting.simulate.cli.simulate", broken)
    with pytest.raises(type(bug)):
        main(["simulate", "--trace", "tests/data/mooncake/conversation_head.jsonl", "--capacity-blocks", "64"])
    monkeypatch.setattr("store.cli._dispatch", broken)
    with pytest.raises(type(bug)):
        main(["store", "--store", f"file://{tmp_path / 'store'}", "ls", "--tenant", "acme"])
    assert "error:" not in capsys.readouterr().err


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
