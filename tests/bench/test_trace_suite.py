"""The unseen-trace suite: deterministic, consistent Mooncake-format traces the reader takes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.lib import trace_suite
from bench.lib.trace_suite import BUNDLED_SERVEGEN, TRACES, build, idle_periods, write_suite
from forecasting.ingest.traces import read_mooncake
from store.errors import BadInputError


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("suite")
    return out, write_suite(out, seed=3)


def test_each_generator_is_deterministic_in_its_seed(suite: tuple[Path, dict], tmp_path: Path) -> None:
    out, manifest = suite
    again = write_suite(tmp_path, seed=3)
    assert again == manifest
    for name in TRACES:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (out / f"{name}.jsonl").read_bytes()
    assert build("agent", 4)[0] != build("agent", 3)[0]


@pytest.mark.parametrize("name", TRACES)
def test_lengths_agree_with_the_block_size_and_ids_are_chained(suite: tuple[Path, dict], name: str) -> None:
    out, manifest = suite
    rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    block = manifest["traces"][name]["block_tokens"]
    assert len(rows) == manifest["traces"][name]["requests"] > 500
    times = [r["timestamp"] for r in rows]
    assert times == sorted(times) and times[0] == 0
    parent: dict[int, int] = {}
    depth: dict[int, int] = {}
    reused = 0
    for r in rows:
        ids = r["hash_ids"]
        assert len(ids) == math.ceil(r["input_length"] / block) and r["output_length"] >= 1
        for i, b in enumerate(ids):
            # chained: an id always sits at the same depth behind the same parent
            assert parent.setdefault(b, ids[i - 1] if i else -1) == (ids[i - 1] if i else -1)
            assert depth.setdefault(b, i) == i
        reused += ids[0] in depth and len(ids) > 1
    assert reused > len(rows) / 2  # shared system prompts and continuing conversations


def test_the_sparse_day_has_an_idle_period_of_six_hours_or_more(suite: tuple[Path, dict]) -> None:
    _, manifest = suite
    m = manifest["traces"]["sparse-24h"]
    start, end = m["longest_idle_s"]
    assert end - start >= 6 * 3600 and 20 * 3600 < m["duration_s"] <= 24 * 3600
    requests, _ = build("sparse-24h", 3)
    assert idle_periods(requests, at_least_s=6 * 3600)[0][1] - requests[0].t_s == pytest.approx(end, abs=1e-3)
    # the agent trace is many fast steps: most gaps are seconds
    agent, _ = build("agent", 3)
    steps = [b.t_s - a.t_s for a, b in zip(agent, agent[1:])]
    assert sorted(steps)[len(steps) // 2] < 5.0


def test_the_sparse_day_runs_from_the_bundled_servegen_subset() -> None:
    assert (BUNDLED_SERVEGEN / "chunk-5-trace.csv").exists() and (BUNDLED_SERVEGEN / "chunk-17-trace.csv").exists()
    with pytest.raises(BadInputError, match="does not exist|cannot read"):
        trace_suite.sparse_24h(0, servegen=Path("/nonexistent-servegen"))
    with pytest.raises(BadInputError, match="the suite holds sparse-24h, blocks-32, agent"):
        build("mooncake")


@pytest.mark.parametrize("name", TRACES)
def test_the_mooncake_reader_reads_them(suite: tuple[Path, dict], name: str) -> None:
    out, manifest = suite
    block = manifest["traces"][name]["block_tokens"]
    trace = read_mooncake(out / f"{name}.jsonl")  # the block size inferred from the rows' lengths
    assert len(trace) == manifest["traces"][name]["requests"] and trace.n_blocks == manifest["traces"][name]["blocks"]
    assert trace.block_tokens == block
    assert trace.duration_s == pytest.approx(manifest["traces"][name]["duration_s"], abs=1e-3)
