"""Request logs as a replay trace: the pipeline's logs, keyed like kvwarm traces, for ``prefill simulate``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from forecasting.ingest.log_trace import read_log_trace
from forecasting.ingest.traces import TraceError, read_kvwarm, simulation_root
from forecasting.mining.prefix_tree import MiningError
from forecasting.simulate.cli import add_simulate_command
from store.errors import BadInputError
from store.identity.keys import block_keys


def chars(texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
    """A character-level tokenizer with the fast tokenizers' calling convention."""
    assert add_special_tokens is False  # mining and the simulation tokenise without BOS/EOS
    return {"input_ids": [[ord(c) for c in t] for t in texts]}


ROWS = [
    {"timestamp": "2026-03-01T00:00:00Z", "tenant": "acme", "model": "m", "prompt": "abcdef"},
    {"timestamp": "2026-03-01T00:00:10Z", "tenant": "acme", "model": "m", "token_ids": [97, 98, 99, 100, 120],
     "prompt_tokens": 5, "output_tokens": 7},
    {"timestamp": "2026-03-01T00:00:20Z", "tenant": "globex", "model": "m", "hash_ids": [5, 6]},
    {"timestamp": "2026-03-01T00:00:30Z", "tenant": "acme", "model": "other", "token_ids": [1, 2]},
    {"timestamp": "not a time", "tenant": "acme", "model": "m", "prompt": "x"},
]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_logs_become_the_trace_a_kvwarm_token_log_would_be(tmp_path: Path) -> None:
    log = write(tmp_path / "requests.jsonl", ROWS)
    trace, report = read_log_trace(log, block_size=2, load_tokenizer=lambda name: chars, model="m")
    # The malformed row is quarantined and counted, not fatal; the other model's row is left out.
    assert (report.rows_read, report.rows_used, report.rows_quarantined) == (5, 4, 1)
    assert len(trace) == 3 and list(trace.timestamps_s) == [0.0, 10.0, 20.0]
    assert trace.start_s == pytest.approx(1772323200.0)
    # Text is tokenised as mining does, then keyed like a kvwarm trace's token_ids rows.
    root = simulation_root("acme", 2)
    names = trace.key_names
    assert [names[b] for b in trace.chain(0)] == block_keys(root, [97, 98, 99, 100, 101, 102])
    assert [names[b] for b in trace.chain(1)] == block_keys(root, [97, 98, 99, 100])
    assert list(trace.chain(1)) == list(trace.chain(0)[:2])  # the shared prefix is the same two blocks
    # Hash ids are chained block ids already: kept, per tenant, at block_size tokens each.
    assert [names[b] for b in trace.chain(2)] == ["globex/5", "globex/6"]
    assert list(trace.input_tokens) == [6, 5, 4] and list(trace.output_tokens) == [0, 7, 0]
    # The same requests as a kvwarm token log give the same keys.
    kv = write(tmp_path / "kv.jsonl", [{"timestamp": 0, "tenant": "acme", "token_ids": [97, 98, 99, 100, 101, 102]}])
    other = read_kvwarm(kv, block_size=2)
    assert [other.key_names[b] for b in other.chain(0)] == [names[b] for b in trace.chain(0)]


def test_logs_need_one_model_and_a_tokenizer_for_text(tmp_path: Path) -> None:
    log = write(tmp_path / "requests.jsonl", ROWS)
    with pytest.raises(MiningError, match="the log holds 2 models"):
        read_log_trace(log, block_size=2, load_tokenizer=lambda name: chars)
    with pytest.raises(TraceError, match=r"requests.jsonl: 1 row\(s\) have prompt text only: pass the model"):
        read_log_trace(log, block_size=2, model="m")
    asked: list[str] = []
    only_m = write(tmp_path / "m.jsonl", [r for r in ROWS if r["model"] == "m"])
    read_log_trace(only_m, block_size=2, load_tokenizer=lambda name: asked.append(name) or chars)
    assert asked == ["m"]  # the log's one model names the tokenizer
    tokens = write(tmp_path / "t.jsonl", [ROWS[1]])
    read_log_trace(tokens, block_size=2, load_tokenizer=lambda name: asked.append(name) or chars)
    assert asked == ["m"]  # nothing to tokenise: no tokenizer is loaded
    with pytest.raises(TraceError, match="block size must be positive"):
        read_log_trace(tokens, block_size=0)


def test_simulate_reads_the_pipelines_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write(tmp_path / "requests.jsonl", ROWS)
    parser = argparse.ArgumentParser(prog="prefill")
    add_simulate_command(parser.add_subparsers(dest="cmd", required=True), load_tokenizer=lambda name: chars)
    argv = ["simulate", "--trace", str(log), "--format", "logs", "--model", "m", "--block-size", "2",
            "--scenario", "steady", "--policy", "vllm"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "3 requests" in out and "logs: rows read 5, used 4, quarantined 1" in out
    # Request 1 hits the two blocks request 0 left: 4 of the 15 prompt tokens.
    args = parser.parse_args(argv + ["--json"])
    assert args.func(args) == 0
    vllm = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]
    assert vllm["policy"] == "vllm" and (vllm["hit_tokens"], vllm["tokens"]) == (4, 15)
    args = parser.parse_args(argv[:5] + argv[7:])
    with pytest.raises(BadInputError, match="the log holds 2 models"):
        args.func(args)
    args = parser.parse_args(argv[:6] + ["llama"] + argv[7:])
    with pytest.raises(BadInputError, match=r"no request of model 'llama' in .*\(its models: m, other\)"):
        args.func(args)
