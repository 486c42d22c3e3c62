"""The node the replay models, level by level, on hand-made traces (hand-computed outcomes)."""
from __future__ import annotations

import numpy as np
import pytest

from forecasting.ingest.traces import from_chains
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import Node, NodeShape, NodeTier, TierCosts
from store.cost import LoadCost, PrefillCost
from store.errors import BadInputError

# Prefill: 1 s a token; one block of 1 token. Local loads: 0.1 s a block; an S3 copy: 2 s a block.
PREFILL = PrefillCost(s_per_token=1.0, s_per_token_pair=0.0)
COSTS = TierCosts(PREFILL, LoadCost(bytes_per_s=10.0), LoadCost(bytes_per_s=0.5), block_bytes=1.0)


def _index(chains: list[list[int]], times: list[float] | None = None) -> BlockIndex:
    times = [float(i) for i in range(len(chains))] if times is None else times
    return BlockIndex.build(from_chains(times, chains))


def _dense(index: BlockIndex, *blocks: int) -> list[int]:
    where = {int(o): i for i, o in enumerate(index.original)}
    return [where[b] for b in blocks]


def _everything_stored_before(index: BlockIndex, row: int) -> np.ndarray:
    return np.full(index.n_unique, row, dtype=np.int64)


def test_the_tier_evicts_unplanned_blocks_by_recency_and_planned_ones_last() -> None:
    tier = NodeTier(3)
    tier.put([1, 2, 3], [(0.0, 1.0), (0.0, 2.0), (5.0, 3.0)])
    tier.put([4], [(0.0, 4.0)])  # over capacity: the least recent unplanned block (1) goes
    assert tier.blocks() == [2, 4, 3] and 1 not in tier
    tier.rekey(lambda b, k: (9.0 if b == 2 else 0.0, k[1]))  # a new plan: 2 is planned now, 3 no longer
    assert tier.blocks() == [3, 4, 2]
    tier.put([5], [(0.0, 5.0)])
    assert tier.blocks() == [4, 5, 2]
    copy = tier.copy()
    copy.put([6, 7], [(0.0, 6.0), (0.0, 7.0)])
    assert copy.blocks() == [6, 7, 2] and tier.blocks() == [4, 5, 2]


def test_a_request_takes_vllm_hits_then_node_tier_loads_then_misses() -> None:
    index = _index([[1, 2, 3], [1, 2, 3, 4]])
    node = Node(index, NodeShape(gpu_blocks=1, node_blocks=10), COSTS, _everything_stored_before(index, 99))
    first = node.serve(0)
    assert (first.gpu, first.node, first.s3) == (0, 0, 0) and first.ttft_s == pytest.approx(3.0)
    # vLLM kept only the root (one block); blocks 2 and 3 were written back to the node tier.
    second = node.serve(1)
    assert (second.gpu, second.node, second.s3) == (1, 2, 0)
    assert second.load_s == pytest.approx(0.2) and second.ttft_s == pytest.approx(0.2 + 1.0)


def test_a_load_slower_than_recomputing_is_not_taken() -> None:
    index = _index([[1, 2], [1, 2]])
    slow = TierCosts(PREFILL, LoadCost(bytes_per_s=0.5), COSTS.remote, block_bytes=1.0)
    node = Node(index, NodeShape(gpu_blocks=1, node_blocks=10), slow, _everything_stored_before(index, 99))
    node.serve(0)
    again = node.serve(1)
    assert again.node == 0 and again.ttft_s == pytest.approx(1.0)  # 2 s to load one token's block, 1 s to compute


def test_s3_hits_are_copied_for_next_time_or_waited_for_in_sync_mode() -> None:
    index = _index([[1, 2, 3], [7, 8], [1, 2, 3]], [0.0, 10.0, 10.0])
    stored = _everything_stored_before(index, 0)  # an earlier node wrote everything back
    node = Node(index, NodeShape(gpu_blocks=1, node_blocks=10), COSTS, stored)
    got = node.serve(0)
    assert (got.gpu, got.node, got.s3) == (0, 0, 0) and len(node.fetch) == 3  # miss now, copy for next time
    waits = Node(index, NodeShape(gpu_blocks=1, node_blocks=10, fetch_mode="sync", sync_timeout_s=100.0),
                 TierCosts(PREFILL, COSTS.local, LoadCost(bytes_per_s=4.0), block_bytes=1.0), stored)
    got = waits.serve(0)  # 3 blocks at 0.25 s each + their local loads, against 3 s of prefill
    assert got.s3 == 3 and got.load_s == pytest.approx(0.75 + 0.3) and got.ttft_s == pytest.approx(1.05)


def test_a_plan_prefetches_what_s3_has_and_its_priorities_outlast_recency() -> None:
    index = _index([[1, 2], [5], [6], [1, 2]], [0.0, 100.0, 101.0, 102.0])
    stored = _everything_stored_before(index, 0)
    node = Node(index, NodeShape(gpu_blocks=1, node_blocks=2), COSTS, stored)
    a, b = _dense(index, 1, 2)
    node.retain({a: 1.0, b: 1.0})
    assert node.prefetch([a, b], now=0.0, row=0) == 2
    node.land(4.0)  # two copies of 2 s each
    assert a in node.tier and b in node.tier
    for i in (1, 2):  # write-backs of unplanned blocks do not push the planned ones out
        node.land(100.0 + i)
        node.serve(i)
        assert a in node.tier and b in node.tier and len(node.tier) == 2
    got = node.serve(3)
    assert (got.gpu, got.node) == (0, 2)


def test_a_restart_keeps_the_node_tier_and_a_fork_is_independent() -> None:
    index = _index([[1, 2, 3], [1, 2, 3]])
    node = Node(index, NodeShape(gpu_blocks=8, node_blocks=8), COSTS, _everything_stored_before(index, 99))
    node.serve(0)
    other = node.fork()
    node.restart()
    got = node.serve(1)
    assert (got.gpu, got.node) == (0, 3)  # the engine's cache is gone, the node tier is not
    assert other.serve(1).gpu == 3  # the fork kept its own engine cache


def test_shapes_and_costs_are_checked() -> None:
    with pytest.raises(BadInputError, match="fetch mode"):
        NodeShape(gpu_blocks=1, node_blocks=1, fetch_mode="eager")
    with pytest.raises(BadInputError, match="node tier must hold"):
        NodeShape(gpu_blocks=1, node_blocks=0)
    assert NodeShape(gpu_blocks=1, node_blocks=0, store=False).node_blocks == 0
    with pytest.raises(BadInputError, match="prefetch_streams"):
        TierCosts(PREFILL, COSTS.local, COSTS.remote, 1.0, prefetch_streams=0)
    with pytest.raises(BadInputError, match="s3_bytes_per_s"):
        TierCosts(PREFILL, COSTS.local, COSTS.remote, 1.0, s3_bytes_per_s=0.0)


def test_streams_divide_a_copy_until_the_node_s3_link_is_the_slower() -> None:
    # one stream: 2 s a block; 4 streams: 0.5 s; a link of 1 byte/s caps them at 1 s a block
    four = TierCosts(PREFILL, COSTS.local, COSTS.remote, 1.0, prefetch_streams=4, fetch_streams=2)
    assert (four.copy_s, four.prefetch_s, four.fetch_s, four.link_s) == pytest.approx((2.0, 0.5, 1.0, 0.0))
    capped = TierCosts(PREFILL, COSTS.local, COSTS.remote, 1.0, prefetch_streams=4, s3_bytes_per_s=1.0)
    assert (capped.prefetch_s, capped.fetch_s, capped.link_s) == pytest.approx((1.0, 2.0, 1.0))


def test_the_prefetch_and_the_fetches_of_a_node_share_its_s3_link() -> None:
    index = _index([[1], [2], [3], [4]])
    shared = TierCosts(PREFILL, COSTS.local, COSTS.remote, 1.0, prefetch_streams=4, fetch_streams=4,
                       s3_bytes_per_s=1.0)  # each channel alone: 1 s a block; together still 1 s a block
    node = Node(index, NodeShape(gpu_blocks=1, node_blocks=10), shared, _everything_stored_before(index, 0))
    node.prefetch(_dense(index, 1, 2), now=0.0, row=0)
    node.fetch.submit(_dense(index, 3, 4), now=0.0)
    node.land(2.0)
    assert len(node.tier) == 2  # two blocks in 2 s over the link, not four
    node.land(4.0)
    assert len(node.tier) == 4


def test_this_hosts_level_costs_are_the_fit_of_the_calibration_file() -> None:
    import json
    from pathlib import Path

    from forecasting.simulate.tiers import HOST_S3_LINK_BYTES_PER_S, HOST_S3_STREAM, NODE_TIER

    doc = json.loads((Path(__file__).resolve().parents[3] / "bench" / "calibration" / "load-tiers.json").read_text())
    for constant, key in ((NODE_TIER, "node_tier"), (HOST_S3_STREAM, "s3_stream")):
        fitted = LoadCost.fit(doc[key]["points"])
        assert constant.bytes_per_s == pytest.approx(fitted.bytes_per_s, rel=1e-4)
        assert constant.s_per_file == pytest.approx(fitted.s_per_file, rel=1e-4, abs=1e-9)
    # this host's S3 link: one stream's rate times the speedup measured at the most streams
    streams = doc["s3_node_link"]["streams_mb_per_s"]
    speedup = max(streams)[1] / min(streams)[1]
    assert HOST_S3_LINK_BYTES_PER_S == pytest.approx(HOST_S3_STREAM.bytes_per_s * speedup, rel=1e-4)
    # a Mooncake block (512 tokens of an 8B model, FP8): about 4.6 ms from the node tier, 0.13 s from this host's S3
    block = 67587.875 * 512
    assert 0.004 < NODE_TIER.seconds(block) < 0.005 and 0.12 < HOST_S3_STREAM.seconds(block) < 0.14


def test_the_default_s3_is_awss_per_request_rate_at_the_loaders_streams() -> None:
    from forecasting.simulate.tiers import S3_LINK_BYTES_PER_S, S3_STREAM
    from store.config import LoaderConfig

    # 85-90 MB/s a request (AWS's guidance), times the loader's prefetch streams: 700 MB/s, 5.6 Gb/s
    assert 85e6 <= S3_STREAM.bytes_per_s <= 90e6
    assert S3_LINK_BYTES_PER_S == pytest.approx(LoaderConfig().prefetch_streams * S3_STREAM.bytes_per_s) == 700e6
    assert 0.39 < S3_STREAM.seconds(67587.875 * 512) < 0.4  # a Mooncake block, one stream
