"""Families: MinHash LSH groups a template's requests; their common prefix; the adaptive threshold."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forecasting.ingest.logs import read_logs
from forecasting.ingest.traces import from_chains
from forecasting.mining.families import adapt_threshold, batch_shingles, find_families, shingles
from forecasting.mining.prefix_tree import candidates, mine_text, mine_trace
from store.identity.keys import block_keys
from tests.forecasting.logs_factory import key_roots as roots
from tests.forecasting.logs_factory import make_tokenizer, standard_log, write_jsonl


@pytest.fixture(scope="module")
def mined(tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    log = standard_log()
    write_jsonl(log, root, bad=False)
    requests = read_logs(root).requests
    # Rows are written in time order, so row i of the log is request i of the tree.
    assert list(requests["request_id"]) == [r["request_id"] for r in log.rows]
    tree = mine_text(requests, make_tokenizer(), roots())
    return log, tree, find_families(tree)


def test_families_are_exactly_the_templates(mined) -> None:
    log, tree, fams = mined
    names = np.asarray([n or "" for n in log.template_of_row], dtype=object)
    got = {frozenset(np.flatnonzero(fams.labels == f)) for f in range(len(fams.table))}
    want = {frozenset(np.flatnonzero(names == t.name)) for t in log.templates}
    assert got == want
    assert np.all(fams.labels[names == ""] == -1)  # noise prompts belong to no family
    assert fams.threshold == 0.85 and fams.num_perm == 128


def test_a_familys_common_prefix_is_its_template_and_a_candidate(mined) -> None:
    log, tree, fams = mined
    tok = make_tokenizer()
    cands = set(candidates(tree, k=3).tolist())
    for row in fams.table.itertuples():
        members = np.flatnonzero(fams.labels == row.Index)
        template = log.template(log.template_of_row[members[0]])
        keys = block_keys(roots()[template.tenant], tok(template.text, add_special_tokens=False)["input_ids"])
        assert tree.node_keys([row.lcp_node]) == [keys[-1]] and row.lcp_blocks == len(keys)
        assert row.lcp_node in cands and row.size == len(members) and row.tenant == template.tenant
        assert row.family == f"f-{keys[-1][:16]}"


def test_node_families_label_templates_not_the_shared_system_prompt(mined) -> None:
    log, tree, fams = mined
    per_node = fams.node_families(tree)
    tok = make_tokenizer()
    system = block_keys(roots()["acme"], tok(log.system_prompts["acme"], add_special_tokens=False)["input_ids"])[-1]
    cands = candidates(tree, k=3)
    labels = dict(zip(tree.node_keys(cands), per_node[cands].tolist()))
    assert labels.pop(system) == -1
    assert sorted(labels.values()) == list(range(len(fams.table)))


def test_families_are_reproducible(mined) -> None:
    _, tree, fams = mined
    again = find_families(tree)
    assert np.array_equal(again.labels, fams.labels)
    pd.testing.assert_frame_equal(again.table, fams.table)


def test_prompts_that_differ_right_after_a_shared_prefix_form_a_family() -> None:
    shared = list(range(1000, 1040))
    chains = [shared + [2000 + 10 * i, 2001 + 10 * i] for i in range(6)] + [[5000 + i for i in range(40)]]
    tree = mine_trace(from_chains(range(7), chains, block_tokens=16))
    fams = find_families(tree, threshold=0.85)
    assert len(fams.table) == 1 and fams.table.loc[0, "size"] == 6 and fams.labels[6] == -1
    node = int(fams.table.loc[0, "lcp_node"])
    assert list(tree.prefix_values(node)) == shared and node in candidates(tree, k=6)


def test_lower_threshold_merges_looser_prompts() -> None:
    base = list(range(100))
    chains = [base[:80] + [500 + 20 * i + j for j in range(20)] for i in range(4)]  # Jaccard 80/120 ~ 0.67
    tree = mine_trace(from_chains(range(4), chains, block_tokens=1))
    assert len(find_families(tree, threshold=0.85).table) == 0
    assert find_families(tree, threshold=0.5).table["size"].tolist() == [4]


def test_shingles_are_order_sensitive_ngrams() -> None:
    a, b = shingles(np.array([1, 2, 3, 4, 5]), 4), shingles(np.array([5, 4, 3, 2, 1]), 4)
    assert len(a) == 2 and a.dtype == np.uint32 and not set(a) & set(b)
    assert len(shingles(np.array([7, 8]), 4)) == 1 and len(shingles(np.array([], dtype=np.int64), 4)) == 0


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=9), max_size=6), n=st.integers(1, 4))
def test_batch_shingles_are_each_sequences_distinct_ngrams(seqs: list[list[int]], n: int) -> None:
    flat = np.asarray([v for s in seqs for v in s], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    values, out = batch_shingles(flat, offsets, n)
    for i, s in enumerate(seqs):
        width = min(n, len(s))
        grams = {tuple(s[j:j + width]) for j in range(len(s) - width + 1)} if s else set()
        assert out[i + 1] - out[i] == len(grams)  # no two distinct n-grams share a hash here
        assert np.array_equal(values[out[i]:out[i + 1]], shingles(np.asarray(s, dtype=np.int64), n))


@pytest.mark.parametrize("threshold, hit_rate, expected", [
    (0.85, 0.40, 0.765), (0.85, 0.50, 0.935), (0.85, 0.99, 0.935), (0.75, 0.10, 0.7), (0.72, 0.0, 0.7),
    (0.90, 0.90, 0.95), (0.95, 0.60, 0.95), (0.70, 0.49, 0.7),
])
def test_adaptive_threshold(threshold: float, hit_rate: float, expected: float) -> None:
    assert adapt_threshold(threshold, hit_rate) == pytest.approx(expected)


def test_bad_arguments_are_refused() -> None:
    tree = mine_trace(from_chains([0], [[1, 2]], block_tokens=1))
    with pytest.raises(ValueError, match="num_perm"):
        find_families(tree, num_perm=64)
    with pytest.raises(ValueError, match="threshold"):
        find_families(tree, threshold=1.5)
    with pytest.raises(ValueError, match="hit_rate"):
        adapt_threshold(0.85, 1.2)
