"""The reuse model: hand-computed classes, closed outcomes only, recency, and the fallback."""
from __future__ import annotations

import numpy as np
import pytest

from forecasting.mining.prefix_tree import PrefixTree, mine_hash_ids
from forecasting.planning.reuse import (N_AGES, N_CLASSES, NEVER, Occurrences, ReuseConfig, ReuseModel, age_bin,
                                       chain_links)
from store.errors import BadInputError


def _tree(chains: list[list[int]], times_s: list[float]) -> PrefixTree:
    lengths = [len(c) for c in chains]
    return mine_hash_ids(np.round(np.asarray(times_s) * 1e6).astype(np.int64),
                         np.asarray([b for c in chains for b in c], dtype=np.int64),
                         np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), block_size=4)


def test_chain_links_give_each_use_its_neighbours_and_each_request_its_seen_prefix() -> None:
    # Block ids are dense already: 0 is the shared root; request 2 continues request 0.
    offsets = np.array([0, 2, 4, 7])
    ids = np.array([0, 1, 0, 2, 0, 1, 3])
    request, position, prev, nxt, lead = chain_links(offsets, ids, 4)
    assert request.tolist() == [0, 0, 1, 1, 2, 2, 2] and position.tolist() == [0, 1, 0, 1, 0, 1, 2]
    assert prev.tolist() == [-1, -1, 0, -1, 1, 0, -1]
    assert nxt.tolist() == [1, 2, 2, NEVER, NEVER, NEVER, NEVER]
    assert lead.tolist() == [0, 1, 2]


def test_classes_are_known_when_the_request_arrives() -> None:
    # r0 [a, b] at 0 s; r1 [a, b, c] at 10 s (a continuation 10 s later); r2 [a] at 50 s.
    occ = Occurrences.of(_tree([[1, 2], [1, 2, 3], [1]], [0.0, 10.0, 50.0]))
    classes = occ.classes()
    per_request = 6 * 5  # chain-length bins x gap bins
    uses, tail = classes // per_request // 2, classes // per_request % 2
    assert uses.tolist() == [0, 0, 1, 1, 0, 2] and tail.tolist() == [0, 1, 0, 0, 1, 1]
    gap = classes % 5
    assert gap.tolist() == [0, 0, 1, 1, 1, 0]  # r1 follows r0 after 10 s (< 30 s); r2 shares one block only
    assert classes.max() < N_CLASSES


def test_only_outcomes_closed_before_the_plan_count() -> None:
    chains = [[1, 2]] * 4
    config = ReuseConfig(horizon_s=15.0, min_outcomes=1)
    past = Occurrences.of(_tree(chains[:3], [0.0, 10.0, 20.0]))
    # An occurrence at t0 is closed at the plan's time t when t0 + 15 < t.
    assert ReuseModel.fit(past, 26.0, config).closed == 4  # the requests at 0 s and 10 s, two blocks each
    assert ReuseModel.fit(past, 24.0, config).closed == 2  # 10 + 15 is not before 24
    with pytest.raises(BadInputError, match="cut the logs at the plan's time"):
        ReuseModel.fit(Occurrences.of(_tree(chains, [0.0, 10.0, 20.0, 30.0])), 30.0, config)


def test_expected_uses_follow_the_class_table_and_fall_with_age() -> None:
    # History: short first turns always continue 5 s later; long first prompts never come back.
    chains, times = [], []
    for k in range(40):
        chains += [[100 + k, 200 + k], [100 + k, 200 + k, 300 + k],
                   list(range(10_000 + 100 * k, 10_000 + 100 * k + 70))]
        times += [20.0 * k, 20.0 * k + 5.0, 20.0 * k + 6.0]
    # Then, with no outcome known yet: a short first turn two requests and none before the plan, and a long one.
    chains += [[800, 801], list(range(50_000, 50_070)), [900, 901]]
    times += [1000.0, 1189.0, 1190.0]
    tree = _tree(chains, times)
    occ = Occurrences.of(tree)
    model = ReuseModel.fit(occ, 1200.0, ReuseConfig(horizon_s=30.0, min_outcomes=10))
    assert not model.fallback and model.closed > 0
    uses = model.expected_uses(occ)
    first = {int(tree.prefix_values(n)[-1]): n for n in np.flatnonzero(tree.depth <= 2)}
    long_new = occ.nodes[occ.offsets[-3]:occ.offsets[-2]]
    assert uses[first[900]] > 5 * uses[long_new].max()  # the table: short first turns come back
    assert uses[first[900]] > uses[first[800]] > 0  # the same class, older in requests: less expected


def test_too_little_history_falls_back_to_recency_and_frequency() -> None:
    occ = Occurrences.of(_tree([[1], [1], [1], [2], [3]], [0.0, 1.0, 2.0, 3.0, 4.0]))
    model = ReuseModel.fit(occ, 5.0, ReuseConfig(min_outcomes=1000))
    assert model.fallback and model.p is None
    uses = model.expected_uses(occ)
    node_of = [int(occ.nodes[occ.offsets[i]]) for i in range(5)]  # request -> its one block
    often, once_old, once_recent = uses[node_of[2]], uses[node_of[3]], uses[node_of[4]]
    assert often > once_recent > once_old  # three uses beat one; then the more recent wins


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(BadInputError, match="ReuseConfig.tau_requests"):
        ReuseConfig(tau_requests=0)
    with pytest.raises(BadInputError, match="ReuseConfig.urgent_s"):
        ReuseConfig(urgent_s=-1.0)
    with pytest.raises(BadInputError, match="prior_rate"):
        ReuseConfig(prior_rate=1.0)


def _conversations(n: int, start_s: float = 0.0) -> tuple[list[list[int]], list[float]]:
    """``n`` two-turn conversations 5 s apart each, and one-off long prompts between them."""
    chains, times = [], []
    for k in range(n):
        chains += [[100 + k, 200 + k], [100 + k, 200 + k, 300 + k], list(range(10_000 + 100 * k, 10_000 + 100 * k + 8))]
        times += [start_s + 20.0 * k, start_s + 20.0 * k + 5.0, start_s + 20.0 * k + 6.0]
    return chains, times


def test_age_is_traffic_so_an_idle_gap_changes_no_forecast() -> None:
    chains, times = _conversations(40)
    chains, times = chains + [[5000, 5001]], times + [times[-1] + 14.0]  # a first turn, the last request
    occ = Occurrences.of(_tree(chains, times))
    config = ReuseConfig(horizon_s=30.0, min_outcomes=10)
    settled = ReuseModel.fit(occ, times[-1] + 31.0, config)  # every outcome closed
    nine_hours = ReuseModel.fit(occ, times[-1] + 9 * 3600.0, config)
    assert not settled.fallback and np.array_equal(settled.p, nine_hours.p)
    uses = settled.expected_uses(occ)
    assert uses.max() > 0.5 and np.array_equal(uses, nine_hours.expected_uses(occ))
    assert np.array_equal(settled.urgency(occ), nine_hours.urgency(occ))
    # the fallback too ages by requests, not seconds
    few = ReuseConfig(horizon_s=30.0, min_outcomes=10**6)
    assert np.array_equal(ReuseModel.fit(occ, times[-1] + 31.0, few).expected_uses(occ),
                          ReuseModel.fit(occ, times[-1] + 9 * 3600.0, few).expected_uses(occ))


def test_traffic_since_the_last_use_lowers_the_forecast_and_urgency_is_the_short_window() -> None:
    chains, times = _conversations(40)
    config = ReuseConfig(horizon_s=30.0, urgent_s=3.0, min_outcomes=10)
    model = ReuseModel.fit(Occurrences.of(_tree(chains, times)), times[-1] + 31.0, config)
    # the table: a first turn is used again (5 s later) when nothing came in between; after
    # other traffic without its continuation it rarely is
    assert model.p.shape == (N_CLASSES, N_AGES)
    first_turn = Occurrences.of(_tree(chains, times)).classes()[0]
    assert model.p[first_turn, 0] > 0.6 > 0.2 > model.p[first_turn, age_bin(np.array([5]))[0]]  # (shrunk: 40 cases)
    # 5 s is beyond the 3 s urgent window: urgency is low where the horizon's p is high
    assert model.p_urgent[first_turn, 0] < 0.2
