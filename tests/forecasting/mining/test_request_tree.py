"""Mining a log whichever way it names its prompts: Mooncake-format traces run through the pipeline as logs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.logs import read_logs
from forecasting.ingest.traces import read_mooncake, simulation_root
from forecasting.mining.demand import build_demand
from forecasting.mining.prefix_tree import MiningError, mine_trace
from forecasting.mining.request_tree import hash_only, mine_requests

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"


def test_a_mooncake_trace_is_mined_as_logs_end_to_end(tmp_path: Path) -> None:
    trace = read_mooncake(MOONCAKE)
    rows = requests_from_trace(trace, origin=pd.Timestamp("2026-03-02"))
    path = tmp_path / "mooncake.jsonl"
    with path.open("w") as fh:
        for r in rows.itertuples(index=False):
            fh.write(json.dumps({"timestamp": r.timestamp.isoformat(), "tenant": r.tenant, "model": r.model,
                                 "hash_ids": [int(h) for h in r.hash_ids], "prompt_tokens": int(r.prompt_tokens),
                                 "output_tokens": int(r.output_tokens)}) + "\n")
    log = read_logs(path)  # the pipeline's own reader: nothing quarantined
    assert log.report.rows_used == len(trace) and log.report.rows_quarantined == 0
    assert hash_only(log.requests)
    tree = mine_requests(log.requests, block_size=512)
    direct = mine_trace(trace)
    assert tree.unit == "hash_ids" and tree.n_nodes == direct.n_nodes
    assert sorted(tree.count.tolist()) == sorted(direct.count.tolist())
    demand = build_demand(tree, k=3, bucket="1min")
    assert len(demand.prefixes) and demand.prefixes["token_ids"].isna().all()  # no tokens: nothing to prefill
    assert demand.total["y"].sum() == len(trace)


def test_token_rows_are_mined_with_the_store_keys_and_need_roots() -> None:
    rows = pd.DataFrame({"timestamp": pd.to_datetime([0, 1], unit="s"), "tenant": ["acme", "acme"], "model": "m",
                         "token_ids": [np.arange(8), np.arange(12)]})
    assert not hash_only(rows)
    tree = mine_requests(rows, block_size=4, roots={"acme": simulation_root("acme", 4)})
    assert tree.unit == "tokens" and tree.n_nodes == 3
    with pytest.raises(MiningError, match="pass the tenants' key roots"):
        mine_requests(rows, block_size=4)
    with pytest.raises(MiningError, match="block size"):
        mine_requests(rows, block_size=8, roots={"acme": simulation_root("acme", 4)})
