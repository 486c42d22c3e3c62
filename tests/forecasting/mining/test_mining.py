"""Mining: prefix trees from text, token ids and hash ids; candidates with the store's keys."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forecasting.ingest.logs import read_logs
from forecasting.ingest.traces import from_chains
from forecasting.mining.block_paths import build_paths, content_ids
from forecasting.mining.prefix_tree import (
    MiningError,
    PrefixTree,
    bucket_counts,
    candidates,
    mine_hash_ids,
    mine_hash_log,
    mine_text,
    mine_trace,
)
from store.identity.keys import block_keys
from tests.forecasting.logs_factory import MODEL, generate_logs, key_roots, make_tokenizer, standard_log, write_jsonl

roots = key_roots


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> pd.DataFrame:
    root = tmp_path_factory.mktemp("logs")
    write_jsonl(standard_log(), root)
    return read_logs(root).requests


@pytest.fixture(scope="module")
def tree(requests, tok) -> PrefixTree:
    return mine_text(requests, tok, roots())


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_recovers_exactly_the_template_prefixes_with_store_keys(tree, tok) -> None:
    log = standard_log()
    expected = {}
    for t in log.templates:
        keys = block_keys(roots()[t.tenant], _ids(tok, t.text))
        expected[keys[-1]] = (t.tenant, len(keys), int(sum(t.hourly)) * log.days)
    system = log.system_prompts["acme"]
    sys_keys = block_keys(roots()["acme"], _ids(tok, system))
    expected[sys_keys[-1]] = ("acme", len(sys_keys), expected_count(log, "acme-a1", "acme-a2"))
    nodes = candidates(tree, k=3)
    got = {key: (tree.tenants[tree.node_tenant[n]], int(tree.depth[n]), int(tree.count[n]))
           for n, key in zip(nodes, tree.node_keys(nodes))}
    assert got == expected
    # The prefix's tokens are the template's tokens, and the key is the store's.
    for n in nodes:
        tokens = tree.prefix_values(n)
        root = roots()[tree.tenants[tree.node_tenant[n]]]
        assert tree.node_keys([n])[0] == block_keys(root, tokens)[-1]


def expected_count(log, *names: str) -> int:
    return int(log.hourly_counts(*names).sum())


def test_lower_k_adds_nothing_from_noise_and_higher_k_drops_sparse(tree) -> None:
    assert len(candidates(tree, k=2)) == len(candidates(tree, k=3)) == 5
    counts = sorted(int(tree.count[n]) for n in candidates(tree, k=13))
    assert 12 not in counts and len(counts) == 4


def test_text_and_token_id_rows_mine_the_same_keys(requests, tok) -> None:
    as_tokens = requests.copy()
    as_tokens["token_ids"] = [np.asarray(_ids(tok, p)) if p is not None else t
                              for p, t in zip(requests["prompt"], requests["token_ids"])]
    as_tokens["prompt"] = None
    a, b = mine_text(requests, tok, roots()), mine_text(as_tokens, None, roots())
    assert a.node_keys(candidates(a)) == b.node_keys(candidates(b))
    assert np.array_equal(a.count, b.count) and np.array_equal(a.path_nodes, b.path_nodes)


def test_small_batches_give_the_same_tree(requests, tok, tree) -> None:
    small = mine_text(requests, tok, roots(), batch_size=7)
    assert np.array_equal(small.path_nodes, tree.path_nodes) and np.array_equal(small.seq_values, tree.seq_values)


def test_tenants_never_share_a_prefix(tok) -> None:
    text = standard_log().templates[0].text
    frame = pd.DataFrame({"timestamp": pd.to_datetime(np.arange(8), unit="s"), "tenant": ["acme", "bolt"] * 4,
                          "model": MODEL, "prompt": [text + f"Question {i}" for i in range(8)], "token_ids": None})
    tree = mine_text(frame, tok, roots())
    nodes = candidates(tree, k=3)
    assert sorted(tree.tenants[tree.node_tenant[n]] for n in nodes) == ["acme", "bolt"]
    assert len(set(tree.node_keys(nodes))) == 2


def test_bad_inputs_raise_clear_errors(requests, tok) -> None:
    with pytest.raises(MiningError, match="would collide"):
        mine_text(requests, tok, roots()["acme"])
    with pytest.raises(MiningError, match="no KeyRoot for tenant"):
        mine_text(requests, tok, {"acme": roots()["acme"]})
    shared = {"acme": roots()["acme"], "bolt": roots()["acme"], "cira": roots()["cira"]}
    with pytest.raises(MiningError, match="share one KeyRoot"):
        mine_text(requests, tok, shared)
    with pytest.raises(MiningError, match="tokenizer"):
        mine_text(requests, None, roots())
    two = requests.assign(model=[MODEL, "other"] * (len(requests) // 2) + [MODEL] * (len(requests) % 2))
    with pytest.raises(MiningError, match="pass model="):
        mine_text(two, tok, roots())
    assert mine_text(two, tok, roots(), model="other").n_requests == len(requests) // 2
    one = requests.iloc[:3].assign(tenant="acme")
    for bad in ([5, -1, 7], [5, 2**32, 7], [1.5, 2.0]):
        rows = one.assign(token_ids=[np.array([1, 2]), bad, []])
        with pytest.raises(MiningError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
            mine_text(rows, None, {"acme": roots()["acme"]})


def test_candidates_keep_only_where_requests_part_ways() -> None:
    a, b, c, d, e = 1, 2, 3, 4, 5
    chains = [[a, b, c], [a, b, c], [a, b, d], [a, e], [a]]
    tree = mine_trace(from_chains(range(5), chains, block_tokens=4))
    path = {tuple(tree.prefix_values(n)): int(tree.count[n]) for n in candidates(tree, k=2)}
    assert path == {(a,): 5, (a, b): 3, (a, b, c): 2}
    assert {tuple(tree.prefix_values(n)) for n in candidates(tree, k=3)} == {(a,), (a, b)}
    with pytest.raises(MiningError):
        candidates(tree, k=0)


def test_hash_ids_are_compared_along_the_whole_path() -> None:
    # Not chained: id 7 follows two different blocks, so it names two different prefixes.
    tree = mine_trace(from_chains(range(4), [[1, 7], [2, 7], [1, 7], [2, 7, 8]], block_tokens=4))
    assert sorted(int(tree.count[n]) for n in range(tree.n_nodes)) == [1, 2, 2, 2, 2]
    assert len(set(tree.node_keys(range(tree.n_nodes)))) == tree.n_nodes
    with pytest.raises(MiningError, match="only a tree of token ids"):
        tree.all_node_keys()


def test_hash_id_logs_mine_without_a_tokenizer(tmp_path) -> None:
    rows = [{"timestamp": 1772409600 + i, "tenant": "acme", "model": "m", "hash_ids": [1, 2, 3 + i % 2]}
            for i in range(6)]
    rows += [{"timestamp": 1772409600, "tenant": "bolt", "model": "m", "hash_ids": [1, 2]},
             {"timestamp": 1772409601, "tenant": "bolt", "model": "m", "prompt": "text only: no blocks"}]
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tree = mine_hash_log(read_logs(tmp_path / "log.jsonl").requests, block_size=512)
    got = {(tree.tenants[tree.node_tenant[n]], tuple(tree.prefix_values(n))): int(tree.count[n])
           for n in candidates(tree, k=3)}
    assert got == {("acme", (1, 2)): 6, ("acme", (1, 2, 3)): 3, ("acme", (1, 2, 4)): 3}
    assert tree.n_requests == 8 and tree.block_size == 512


@settings(max_examples=60, deadline=None)
@given(chains=st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=25),
       tenants=st.lists(st.integers(0, 1), min_size=25, max_size=25), chained=st.booleans())
def test_tree_counts_match_brute_force(chains: list[list[int]], tenants: list[int], chained: bool) -> None:
    if chained:  # make ids name whole prefixes, as Mooncake's do: exercises the one-sort fast path
        names: dict[tuple, int] = {}
        chains = [[names.setdefault((tenants[i], *c[:j + 1]), len(names)) for j in range(len(c))]
                  for i, c in enumerate(chains)]
    codes = np.asarray(tenants[:len(chains)], dtype=np.int32)
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    ids = np.array([v for c in chains for v in c], dtype=np.int64)
    tree = mine_hash_ids(np.arange(len(chains)), ids, np.concatenate([[0], np.cumsum(lengths)]), block_size=1,
                         tenant_codes=codes, tenants=("x", "y"))
    brute = Counter((int(codes[i]), tuple(c[:j + 1])) for i, c in enumerate(chains) for j in range(len(c)))
    got = Counter({(int(tree.node_tenant[n]), tuple(int(v) for v in tree.prefix_values(n))): int(tree.count[n])
                   for n in range(tree.n_nodes)})
    assert got == brute
    assert np.all(tree.parent < np.arange(tree.n_nodes))  # parents are numbered first
    # The depth-by-depth builder partitions the blocks into the same nodes.
    slow = build_paths(content_ids(ids), lengths, codes)[0]
    assert len(np.unique(slow)) == tree.n_nodes
    assert len(np.unique(np.stack([slow, tree.path_nodes]), axis=1)[0]) == tree.n_nodes


@settings(max_examples=30, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), max_size=9), min_size=1, max_size=12))
def test_token_trees_use_the_store_keys(prompts: list[list[int]]) -> None:
    root = roots(block_size=2)["acme"]
    frame = pd.DataFrame({"timestamp": pd.to_datetime(np.arange(len(prompts)), unit="s"), "tenant": "acme",
                          "token_ids": [np.asarray(p, dtype=np.int64) if p else None for p in prompts]})
    tree = mine_text(frame, None, root)
    expected = Counter(k for p in prompts for k in block_keys(root, p))
    assert Counter(dict(zip(tree.node_keys(range(tree.n_nodes)), tree.count.tolist()))) == expected
    assert tree.all_node_keys() == tree.node_keys(range(tree.n_nodes))  # every node at once, the same keys


def test_bucket_counts_per_node_and_total() -> None:
    hour = 3_600_000_000
    tree = mine_trace(from_chains([0, 10, 3700, 3800, 7300], [[1, 2], [1, 2], [1, 3], [], [1, 2]], block_tokens=4))
    nodes = candidates(tree, k=2)
    per_node, total = bucket_counts(tree, nodes, hour, 0, 3)
    by_path = {tuple(tree.prefix_values(n)): list(per_node[j]) for j, n in enumerate(nodes)}
    assert by_path == {(1,): [2, 1, 1], (1, 2): [2, 0, 1]}
    assert list(total) == [2, 2, 1]


def test_a_second_generated_log_mines_the_same_prefixes(tok) -> None:
    other = generate_logs(tok, seed=99, days=1)
    frame = pd.DataFrame(other.rows).assign(timestamp=lambda f: [pd.Timestamp(t, unit="s") if not isinstance(t, str)
                                                                 else pd.Timestamp(t).tz_localize(None)
                                                                 for t in f["timestamp"]])
    frame["token_ids"] = [np.asarray(t) if isinstance(t, list) else None for t in frame["token_ids"]]
    a = mine_text(frame, tok, roots())
    keys = {block_keys(roots()[t.tenant], _ids(tok, t.text))[-1] for t in other.templates}
    assert keys <= set(a.node_keys(candidates(a)))
