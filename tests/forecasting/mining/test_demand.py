"""Demand: the contract forecasting consumes, recovered exactly from logs with known patterns."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from forecasting.ingest.logs import read_logs
from forecasting.ingest.traces import from_chains
from forecasting.mining.demand import PREFIX_COLUMNS, Demand, build_demand
from forecasting.mining.families import find_families
from forecasting.mining.prefix_tree import mine_text, mine_trace
from store.identity.keys import block_keys
from tests.forecasting.logs_factory import START, key_roots, make_tokenizer, standard_log, write_parquet


@pytest.fixture(scope="module")
def demand(tmp_path_factory) -> Demand:
    root = tmp_path_factory.mktemp("logs")
    write_parquet(standard_log(), root)
    tok = make_tokenizer()
    tree = mine_text(read_logs(root).requests, tok, key_roots())
    return build_demand(tree, k=3, families=find_families(tree), decode=tok.decode)


def _key(tenant: str, text: str) -> str:
    return block_keys(key_roots()[tenant], make_tokenizer()(text, add_special_tokens=False)["input_ids"])[-1]


def test_each_template_has_exactly_its_known_hourly_demand(demand: Demand) -> None:
    log = standard_log()
    hours = pd.date_range(START, periods=24 * log.days, freq="h")
    for t in log.templates:
        series = demand.of(_key(t.tenant, t.text))
        assert list(series.index) == list(hours)  # zero buckets included
        assert np.array_equal(series.to_numpy(), log.hourly_counts(t.name))
    shared = demand.of(_key("acme", log.system_prompts["acme"]))
    assert np.array_equal(shared.to_numpy(), log.hourly_counts("acme-a1", "acme-a2"))
    assert np.array_equal(demand.total["y"].to_numpy(), log.total_counts())
    assert list(demand.total["ds"]) == list(hours)


def test_contract_columns_and_types(demand: Demand) -> None:
    s, p = demand.series, demand.prefixes
    assert list(s.columns) == ["unique_id", "ds", "y"] and s["y"].dtype == np.float64
    assert s["ds"].dt.tz is None and s["ds"].dtype.kind == "M"
    assert len(s) == len(p) * 48 and set(s["unique_id"]) == set(p["unique_id"]) and p["unique_id"].is_unique
    assert demand.bucket == pd.Timedelta(hours=1)
    assert list(p.columns[:len(PREFIX_COLUMNS)]) == list(PREFIX_COLUMNS)
    for row in p.itertuples():
        assert row.n_tokens == row.n_blocks * 16 == len(row.token_ids)
        assert isinstance(row.text, str) and row.text and row.tenant in ("acme", "bolt")
        assert row.distinct_requests == demand.of(row.unique_id).sum()


def test_prefix_rows_name_template_text_family_and_parent(demand: Demand) -> None:
    log = standard_log()
    system = _key("acme", log.system_prompts["acme"])
    for t in log.templates:
        row = demand.prefix(_key(t.tenant, t.text))
        assert row.text == t.text and row.family is not None
        assert row.parent == (system if t.tenant == "acme" else None)
        fam = demand.families[demand.families["unique_id"] == row.family]["y"].to_numpy()
        assert np.array_equal(fam, log.hourly_counts(t.name))
    top = demand.prefix(system)
    assert top.family is None and top.parent is None and top.text == log.system_prompts["acme"]


def test_daily_buckets_and_a_wider_range(demand: Demand) -> None:
    log = standard_log()
    tok = make_tokenizer()
    tree = mine_text(pd.DataFrame({"timestamp": [START + pd.Timedelta(hours=30)], "tenant": ["bolt"],
                                   "prompt": [log.template("bolt-b1").text]}), tok, key_roots())
    daily = build_demand(tree, k=1, bucket="1D", start=START, end=START + pd.Timedelta(days=3))
    assert list(daily.total["y"]) == [0, 1, 0]
    assert daily.series.groupby("unique_id")["y"].apply(list).tolist() == [[0, 1, 0]]
    assert daily.families.empty and list(daily.families.columns) == ["unique_id", "ds", "y"]


def test_hash_id_prefixes_have_no_tokens() -> None:
    tree = mine_trace(from_chains([0, 60, 120, 4000], [[1, 2, 3], [1, 2, 4], [1, 2], [9]], block_tokens=512))
    d = build_demand(tree, k=2)
    row = d.prefixes.iloc[0]
    assert (row.token_ids, row.text, row.hash_ids, row.n_tokens, row.n_blocks) == (None, None, [1, 2], 1024, 2)
    assert d.of(row.unique_id).tolist() == [3, 0] and d.total["y"].tolist() == [3, 1]
    assert re.fullmatch("[0-9a-f]{64}", row.unique_id)  # a sha256 of the tenant and the id path
    again = build_demand(mine_trace(from_chains([0, 60], [[1, 2, 3], [1, 2, 4]], block_tokens=512)), k=2)
    again_row = again.prefixes.iloc[0]
    assert again_row.hash_ids == [1, 2] and again_row.unique_id == row.unique_id  # same path, same id, every run


def test_demand_checks_its_frames() -> None:
    ok = pd.DataFrame({"ds": [], "y": []})
    with pytest.raises(ValueError, match="series lacks column"):
        Demand(ok, ok, pd.Timedelta("1h"), pd.DataFrame(columns=list(PREFIX_COLUMNS)))
    series = pd.DataFrame({"unique_id": [], "ds": [], "y": []})
    with pytest.raises(ValueError, match="positive"):
        Demand(series, ok, pd.Timedelta(0), pd.DataFrame(columns=list(PREFIX_COLUMNS)))
    tree = mine_trace(from_chains([0], [[1]], block_tokens=1))
    with pytest.raises(ValueError, match="bucket"):
        build_demand(tree, bucket="-1h")


def test_an_empty_log_gives_empty_frames() -> None:
    empty = pd.DataFrame({"timestamp": pd.Series(dtype="datetime64[us]"), "tenant": pd.Series(dtype=object),
                          "token_ids": pd.Series(dtype=object)})
    tree = mine_text(empty, None, key_roots())
    d = build_demand(tree, families=find_families(tree))
    assert d.series.empty and d.total.empty and d.prefixes.empty and d.families.empty
    assert list(d.prefixes.columns[:len(PREFIX_COLUMNS)]) == list(PREFIX_COLUMNS)
